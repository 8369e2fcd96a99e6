"""Built ahead (issue 12): build_job compiles a job's kernels without a GPU, run_job launches
the artifacts without importing the sources, and the cubin launcher packs parameters as the
kernels expect (through a fake driver: no libcuda here).

Triton compiles for a GPU only in a process that imported it without TRITON_INTERPRET=1; this
one runs Triton under its interpreter, so the Triton builds run once, together, in a child
started with TRITON_INTERPRET=0 (this file run as a script): the `built` fixture. build_job's
own fallback child (used when a process has the interpreter) is tested here too."""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    CUDA,
    HAS_GPU,
    IN,
    OUT,
    TORCH,
    TORCH_ADD,
    TRITON,
    RecordingReporter,
    V,
    job,
    needs_gpu,
    needs_nvcc,
    scalar,
    source,
    tensor,
)
from engine_helpers import TRITON_ADD as ADD
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import dtype_pb2, kernel_pb2
from kerneleval_server.engine import EngineConfig, build_job, run_job

F16 = dtype_pb2.DTYPE_FLOAT16
ARCH = "sm_90"
cpu_only = pytest.mark.skipif(HAS_GPU, reason="checks what happens without a GPU")

SCALARS = """
import triton
import triton.language as tl

@triton.jit
def scaled(x_ptr, out_ptr, n, alpha, one, big, flag, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * one, mask=mask).to(tl.float32)
    y = x * alpha + (big > 0).to(tl.float32) + flag.to(tl.float32)
    tl.store(out_ptr + offs, y.to(tl.float16), mask=mask)
"""
AUTOTUNED = ADD.replace(
    "@triton.jit",
    "@triton.autotune(configs=[triton.Config({}, num_warps=2), triton.Config({}, num_warps=4)],"
    '\n                 key=["n"])\n@triton.jit',
)
MODEL_NEW = (
    "import torch\n"
    + ADD
    + """
class ModelNew(torch.nn.Module):
    def forward(self, x, y):
        out = torch.empty_like(x)
        add_kernel[(4,)](x, y, out, x.numel(), BLOCK=256)
        return out
"""
)
CUDA_ADD = """
__global__ void add(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
"""
MATMUL = """
import triton
import triton.language as tl

@triton.jit
def matmul(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16))
"""


def marker_line(path: Path) -> str:
    """A top-level statement that shows whether a source was imported."""
    return f"\nimport pathlib\npathlib.Path({str(path)!r}).write_text('imported')\n"


def add_args(n: int = 1024) -> list[kernel_pb2.ArgSpec]:
    return [
        tensor("x", [n]),
        tensor("y", [n]),
        tensor("out", [n], role=OUT),
        scalar("n", n),
        scalar("BLOCK", 256, meta=True),
    ]


def triton_add(n: int = 1024, code: str = ADD, warps: int = 2) -> kernel_pb2.KernelSource:
    k = source(TRITON, code, add_args(n), grid=((n + 255) // 256, 1, 1))
    k.io.launch.num_warps = warps
    return k


def cuda_add(n: int = 1024, code: str = CUDA_ADD) -> kernel_pb2.KernelSource:
    """The same IOContract as triton_add: the meta BLOCK is not passed to a CUDA kernel."""
    return source(CUDA, code, add_args(n), grid=((n + 255) // 256, 1, 1), block=(256, 1, 1))


def scalars_args() -> list[kernel_pb2.ArgSpec]:
    flag = kernel_pb2.ArgSpec(name="flag", bool_value=True)
    return [
        tensor("x", [1000], F16),
        tensor("out", [1000], F16, OUT),
        scalar("n", 1000),  # not a multiple of 16
        scalar("alpha", 0.5),
        scalar("one", 1),  # the JIT would fold it into a constant
        scalar("big", 1 << 40),  # int64, a multiple of 16
        flag,
        scalar("BLOCK", 128, meta=True),
    ]


def matmul_source() -> kernel_pb2.KernelSource:
    args = [
        tensor("a", [512, 512], F16),
        tensor("b", [512, 512], F16),
        tensor("c", [512, 512], F16, OUT),
        scalar("M", 512),
        scalar("N", 512),
        scalar("K", 512),
        scalar("BM", 128, meta=True),
        scalar("BN", 128, meta=True),
        scalar("BK", 64, meta=True),
    ]
    k = source(TRITON, MATMUL, args, grid=(4, 4, 1))
    k.io.launch.num_warps, k.io.launch.num_stages = 8, 3
    return k


EXIT = "\nimport sys\nsys.exit(3)\n"
# The Triton builds, made in one child with Triton in compiled mode (see `built`).
CHILD_CASES: dict[str, Callable[[Path], kernel_pb2.JobSpec]] = {
    "add": lambda d: job(triton_add(code=ADD + marker_line(d / "add.imported"))),
    "scalars": lambda d: job(source(TRITON, SCALARS, scalars_args(), grid=(8, 1, 1))),
    "cuda_kernel_triton_reference": lambda d: job(cuda_add(), triton_add()),
    "matmul": lambda d: job(matmul_source()),
    "autotuned": lambda d: job(triton_add(code=AUTOTUNED)),
    "syntax_error": lambda d: job(triton_add(code=ADD.replace("mask = offs", "mask = = offs"))),
    "type_error": lambda d: job(triton_add(code=ADD.replace("(0, BLOCK)", "(0, n)"))),
    "top_level_raise": lambda d: job(triton_add(code=ADD + "\nraise RuntimeError('boom')\n")),
    "reference_exits": lambda d: job(triton_add(), triton_add(code=ADD + EXIT)),
    "meta_mismatch": lambda d: job(
        triton_add(code=ADD.replace("BLOCK: tl.constexpr", "BLOCK"))
    ),
}  # fmt: skip


def _child_main(out: Path) -> None:
    """Builds CHILD_CASES with Triton in compiled mode; records every attempt to reach a GPU."""
    import torch
    import triton.runtime.driver as triton_driver
    from kerneleval_server.engine.backends.triton_build import triton_compiles_here

    gpu_calls: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            gpu_calls.append(name)
            raise RuntimeError(f"build_job called {name}")

        return call

    torch.cuda.is_available = refuse("torch.cuda.is_available")  # type: ignore[assignment]
    torch.cuda.init = refuse("torch.cuda.init")  # type: ignore[assignment]
    triton_driver._create_driver = refuse("triton driver")  # type: ignore[attr-defined]
    summary: dict[str, Any] = {"compiles_here": triton_compiles_here()}
    for name, make in CHILD_CASES.items():
        rep = RecordingReporter()
        outcome = build_job(make(out), rep, EngineConfig(work_dir=out / "work"), ARCH)
        (out / f"{name}.pb").write_bytes(outcome.SerializeToString())
        summary[name] = rep.events
    summary["gpu_calls"] = gpu_calls
    (out / "summary.json").write_text(json.dumps(summary))


class Built:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.summary = json.loads((folder / "summary.json").read_text())

    def __getitem__(self, name: str) -> job_channel_pb2.BuildOutcome:
        out = job_channel_pb2.BuildOutcome()
        out.ParseFromString((self.folder / f"{name}.pb").read_bytes())
        return out

    def events(self, name: str) -> list[list[Any]]:
        return self.summary[name]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    folder = tmp_path_factory.mktemp("built")
    root = Path(__file__).resolve().parents[2]
    paths = [str(root / "server"), str(root / "clients" / "python" / "src")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
        "TRITON_INTERPRET": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "TRITON_CACHE_DIR": str(folder / "triton-cache"),
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Built(folder)


def config(tmp_path: Path, **kw: Any) -> EngineConfig:
    return EngineConfig(work_dir=tmp_path, **kw)


# -- build_job -------------------------------------------------------------------------------


def test_the_child_compiled_in_process_and_never_asked_for_a_gpu(built: Built) -> None:
    assert built.summary["compiles_here"] is True
    assert built.summary["gpu_calls"] == []


def test_triton_add_builds_one_artifact(built: Built) -> None:
    out = built["add"]
    assert not out.run_whole and not out.HasField("result") and out.job_id == ""
    assert len(out.artifacts) == 1
    a = out.artifacts[0]
    assert a.role == "kernel" and a.type == TRITON
    assert a.cubin.startswith(b"\x7fELF") and b"add_kernel" in a.cubin
    assert a.function == "add_kernel" and a.arch == ARCH
    assert a.num_warps == 2  # io.launch.num_warps
    assert a.shared_bytes == 0 and a.global_scratch_bytes == 0 and a.profile_scratch_bytes == 0
    # Every pointer (fresh tensors are 16-byte aligned) and n = 1024 are divisible by 16;
    # BLOCK is a constexpr.
    assert "x_ptr: *fp32 (divisible by 16)" in a.build_log
    assert "out_ptr: *fp32 (divisible by 16)" in a.build_log
    assert "n: i32 (divisible by 16)" in a.build_log and "BLOCK: constexpr" in a.build_log
    assert any("built ahead" in n and "2 warps" in n for n in a.notes)
    events = built.events("add")
    assert ["phase", V.PHASE_COMPILING] in events
    assert any(e[0] == "log" and "add_kernel" in e[1] for e in events)
    assert (built.folder / "add.imported").exists()  # building imports the source


def test_scalars_get_the_jits_types_and_a_one_stays_a_parameter(built: Built) -> None:
    out = built["scalars"]
    assert not out.run_whole and not out.HasField("result")
    log = out.artifacts[0].build_log
    for part in (
        "x_ptr: *fp16 (divisible by 16)",
        "n: i32,",  # 1000: not a multiple of 16
        "alpha: fp32,",
        "one: i32,",  # a parameter: the launch side passes every non-meta argument
        "big: i64 (divisible by 16)",
        "flag: u1,",
        "BLOCK: constexpr",
    ):
        assert part in log, (part, log)


@needs_nvcc
def test_raw_cuda_kernel_and_triton_reference_in_order(built: Built) -> None:
    out = built["cuda_kernel_triton_reference"]
    assert not out.run_whole and not out.HasField("result"), out
    assert [(a.role, a.type) for a in out.artifacts] == [("kernel", CUDA), ("reference", TRITON)]
    cuda, ref = out.artifacts
    assert cuda.cubin.startswith(b"\x7fELF") and cuda.function == "_Z3addPKfS0_Pfi"
    assert cuda.arch == ARCH and cuda.num_warps == 0 and cuda.shared_bytes == 0
    assert "nvcc" in cuda.build_log and "-arch=sm_90" in cuda.build_log
    assert any(n.startswith("ptxas (add, sm_90): Used") for n in cuda.notes)
    assert ref.function == "add_kernel" and ref.cubin.startswith(b"\x7fELF")


def test_matmul_over_48_kib_of_shared_memory(built: Built) -> None:
    a = built["matmul"].artifacts[0]
    assert a.function == "matmul" and a.num_warps == 8
    assert a.shared_bytes > 48 * 1024


def test_what_cannot_be_built_ahead_runs_whole(built: Built, tmp_path: Path) -> None:
    out = built["autotuned"]
    assert "Autotuner" in out.run_whole and "\n" not in out.run_whole
    assert not out.artifacts and not out.HasField("result")
    out = built["meta_mismatch"]
    assert "BLOCK" in out.run_whole and "constexpr" in out.run_whole and not out.artifacts
    # A TORCH reference is left to the judge: the kernel is built alone, and the reference's
    # code never runs here.
    marker = tmp_path / "torch.imported"
    spec = job(triton_add(), source(TORCH, TORCH_ADD + marker_line(marker)))
    out = build_job(spec, RecordingReporter(), config(tmp_path), ARCH)
    assert not out.run_whole and not out.HasField("result") and not marker.exists()
    assert [a.role for a in out.artifacts] == ["kernel"]
    # A kernel with host code runs whole, decided before anything is imported.
    spec = job(source(TORCH, TORCH_ADD + marker_line(marker)), triton_add())
    out = build_job(spec, RecordingReporter(), config(tmp_path), ARCH)
    assert out.run_whole == "kernel: KERNEL_TYPE_TORCH runs Python host code"
    assert not out.artifacts and not marker.exists()
    model_new = source(TRITON, MODEL_NEW, add_args()[:2])
    out = build_job(job(model_new), RecordingReporter(), config(tmp_path), ARCH)
    assert "ModelNew" in out.run_whole and not out.artifacts
    out = build_job(job(triton_add(), sanitize=True), RecordingReporter(), config(tmp_path), ARCH)
    assert out.run_whole.startswith("sanitize") and not out.artifacts


def test_compile_errors_are_results_with_run_jobs_verdict(built: Built, tmp_path: Path) -> None:
    out = built["syntax_error"]
    r = out.result
    assert not out.artifacts and not out.run_whole
    assert r.verdict == V.VERDICT_COMPILE_ERROR and not r.compiled
    assert r.compilation_error.startswith("syntax error at line")
    same = run_job(job(triton_add(code=ADD.replace("mask = offs", "mask = = offs"))),
                   RecordingReporter(), config(tmp_path))  # fmt: skip
    assert same.result.compilation_error == r.compilation_error
    r = built["type_error"].result
    assert r.verdict == V.VERDICT_COMPILE_ERROR and not r.compiled
    assert "arange" in r.compilation_error and not built["type_error"].artifacts


def test_top_level_exceptions_are_verdicts(built: Built) -> None:
    r = built["top_level_raise"].result
    assert r.verdict == V.VERDICT_COMPILE_ERROR
    assert r.compilation_error.startswith("importing the source raised RuntimeError: boom")
    r = built["reference_exits"].result
    assert r.verdict == V.VERDICT_COMPILE_ERROR
    assert r.compilation_error.startswith("reference: importing the source raised SystemExit")
    assert not built["reference_exits"].artifacts


@needs_nvcc
def test_cuda_compile_error_matches_run_job(tmp_path: Path) -> None:
    spec = job(cuda_add(code=CUDA_ADD + "\n__global__ void broken( { }\n"))
    out = build_job(spec, RecordingReporter(), config(tmp_path), ARCH)
    assert not out.artifacts and not out.run_whole
    assert out.result.verdict == V.VERDICT_COMPILE_ERROR and not out.result.compiled
    assert "nvcc failed" in out.result.compilation_error
    whole = run_job(spec, RecordingReporter(), config(tmp_path)).result
    assert whole.verdict == out.result.verdict
    assert whole.compilation_error.split("\n")[0] == out.result.compilation_error.split("\n")[0]


@needs_nvcc
def test_cuda_preflight_without_gpu_at_build_time(tmp_path: Path) -> None:
    from kerneleval_server.engine import DeviceLimits

    k = cuda_add()
    k.io.launch.block.x = 2048
    out = build_job(
        job(k), RecordingReporter(), config(tmp_path, device_limits=DeviceLimits()), ARCH
    )
    assert out.result.verdict == V.VERDICT_RESOURCE_LIMIT and out.result.compiled
    assert "2048 threads" in out.result.error.message and not out.artifacts


def test_invalid_spec_is_refused_like_run_job(tmp_path: Path) -> None:
    from kerneleval_server.spec.validation import Limits

    cfg = config(tmp_path, limits=Limits(max_args=2))
    rep = RecordingReporter()
    out = build_job(job(triton_add()), rep, cfg, ARCH)
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.error.exception_type == "InvalidArgument"
    assert (
        r.error.message == run_job(job(triton_add()), RecordingReporter(), cfg).result.error.message
    )
    assert not out.artifacts and rep.phases() == []


@cpu_only
def test_build_job_compiles_in_a_child_where_triton_is_interpreted(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kerneleval_server.engine.backends.triton_build import triton_compiles_here

    assert not triton_compiles_here()  # this process: TRITON_INTERPRET=1 (engine_helpers)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    rep = RecordingReporter()
    spec = job(triton_add(code=ADD + marker_line(tmp_path / "add.imported")))
    out = build_job(spec, rep, config(tmp_path), ARCH)
    assert not out.run_whole and not out.HasField("result"), out
    # What the in-process build made of the same kernel.
    a, same = out.artifacts[0], built["add"].artifacts[0]
    assert a.cubin.startswith(b"\x7fELF") and a.build_log == same.build_log
    assert (a.function, a.num_warps, a.shared_bytes) == (same.function, 2, 0)
    assert any(e[0] == "log" and "add_kernel" in e[1] for e in rep.events)
    assert rep.phases()[:1] == [V.PHASE_COMPILING]
    assert (tmp_path / "add.imported").exists()  # the child imported it
    # A compile error made in the child is the result here.
    bad = job(triton_add(code=ADD.replace("mask = offs", "mask = = offs")))
    r = build_job(bad, RecordingReporter(), config(tmp_path), ARCH).result
    assert r.verdict == V.VERDICT_COMPILE_ERROR and "syntax error" in r.compilation_error


# -- run_job with prebuilt -------------------------------------------------------------------


@cpu_only
def test_run_job_prebuilt_imports_nothing_and_says_no_device(
    built: Built, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import triton
    from kerneleval_server.engine import loader

    marker = built.folder / "add.imported"
    marker.unlink(missing_ok=True)
    spec = job(triton_add(code=ADD + marker_line(marker)))
    tried: list[str] = []
    monkeypatch.setattr(loader, "import_source", lambda *a, **k: tried.append("import"))
    monkeypatch.setattr(triton, "compile", lambda *a, **k: tried.append("compile"))
    rep = RecordingReporter()
    out = run_job(spec, rep, config(tmp_path), prebuilt=built["add"].artifacts)
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and r.compiled
    assert r.error.exception_type == "NoDeviceError"
    assert r.error.message == "no CUDA device: add_kernel compiled for sm_90 but cannot run here"
    assert "no CUDA device on this worker: the kernel compiled but cannot run" in r.notes
    assert any("built ahead" in n for n in r.notes)  # the artifact's notes
    assert any(e[0] == "log" and "compiled add_kernel for sm_90" in e[1] for e in rep.events)
    assert tried == [] and not marker.exists() and not out.context_poisoned


@cpu_only
@needs_nvcc
def test_run_job_prebuilt_cuda_matches_run_job_on_the_cpu(built: Built, tmp_path: Path) -> None:
    spec = job(cuda_add(), triton_add())
    prebuilt = built["cuda_kernel_triton_reference"].artifacts
    ahead = run_job(spec, RecordingReporter(), config(tmp_path), prebuilt=prebuilt).result
    whole = run_job(spec, RecordingReporter(), config(tmp_path)).result
    assert ahead.verdict == whole.verdict == V.VERDICT_CANNOT_RUN_HERE
    assert ahead.compiled and whole.compiled
    assert ahead.error.message == whole.error.message
    assert ahead.error.message == "no CUDA device: add compiled for sm_90 but cannot run here"
    ptxas = [n for n in whole.notes if n.startswith("ptxas")]
    assert ptxas and [n for n in ahead.notes if n.startswith("ptxas")] == ptxas


@needs_gpu
@pytest.mark.parametrize("name", ["add", "scalars", "matmul", "cuda_kernel_triton_reference"])
def test_prebuilt_kernels_run_on_the_gpu(built: Built, tmp_path: Path, name: str) -> None:
    import torch

    if f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}" != ARCH:
        pytest.skip(f"built for {ARCH}")
    spec = CHILD_CASES[name](built.folder)
    marker = built.folder / "add.imported"
    marker.unlink(missing_ok=True)
    ahead = run_job(spec, RecordingReporter(), config(tmp_path), prebuilt=built[name].artifacts)
    imported_ahead = marker.exists()
    whole = run_job(spec, RecordingReporter(), config(tmp_path / "jit"))
    for r in (ahead.result, whole.result):
        assert r.verdict == V.VERDICT_OK and r.correctness, r
        assert r.runtime.trial_count == 3 and r.runtime.median_ms > 0
    assert ahead.result.validation.trials_passed == whole.result.validation.trials_passed
    assert not ahead.context_poisoned
    if name == "add":
        assert (imported_ahead, marker.exists()) == (False, True)  # only the JIT run imports


def test_run_job_refuses_an_artifact_of_another_type(built: Built, tmp_path: Path) -> None:
    spec = job(cuda_add())
    out = run_job(spec, RecordingReporter(), config(tmp_path), prebuilt=built["add"].artifacts)
    assert out.result.verdict == V.VERDICT_RUNTIME_ERROR
    assert "KERNEL_TYPE_TRITON but its source is KERNEL_TYPE_CUDA" in out.result.error.message


# -- the Triton signature against the JIT's own ----------------------------------------------

PARITY = """
import triton
import triton.language as tl

@triton.jit
def plain(a, b, n, m, s, f, flag, BLOCK: tl.constexpr):
    pass

@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["m"])
def dns(a, b, n, m, s, f, flag, BLOCK: tl.constexpr):
    pass

@triton.jit
def annotated(a, b, n: tl.int64, m: tl.int32, s, f: tl.float32, flag, BLOCK: tl.constexpr):
    pass
"""


@pytest.mark.parametrize("kernel", ["plain", "dns", "annotated"])
@pytest.mark.parametrize(
    "dtypes,ints",
    [
        ((dtype_pb2.DTYPE_FLOAT32, dtype_pb2.DTYPE_INT64), (1024, 17, -32)),
        ((dtype_pb2.DTYPE_BFLOAT16, dtype_pb2.DTYPE_BOOL), (0, 2**31, 48)),
        ((dtype_pb2.DTYPE_UINT8, dtype_pb2.DTYPE_FLOAT64), (2**40 + 3, 16, 5)),
    ],
)
def test_signature_matches_the_jits(tmp_path: Path, kernel: str, dtypes: Any, ints: Any) -> None:
    import torch
    from kerneleval_server.engine import loader
    from kerneleval_server.engine.backends.triton_build import compiled_mode, signature
    from kerneleval_server.engine.inputs import build_args
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    with compiled_mode():
        module = loader.import_source(tmp_path, "parity", PARITY)
    fn = getattr(module, kernel)
    assert isinstance(fn, jit.JITFunction)
    io = kernel_pb2.IOContract()
    io.args.extend(
        [
            tensor("a", [64], dtypes[0]),
            tensor("b", [8, 8], dtypes[1], OUT),
            scalar("n", ints[0]),
            scalar("m", ints[1]),
            scalar("s", ints[2]),
            scalar("f", 0.25),
            kernel_pb2.ArgSpec(name="flag", bool_value=False),
            scalar("BLOCK", 64, meta=True),
        ]
    )
    backend = make_backend(GPUTarget("cuda", 90, 32))
    ours = signature(fn, list(io.args), backend.parse_attr)
    # The JIT's binder and _pack_args on the same values (CPU tensors: aligned like fresh
    # CUDA ones).
    values = build_args(io, 1, 0, torch.device("cpu")).values
    binder = jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*values)
    _, sig, constexprs, attrs = fn._pack_args(backend, {}, bound, spec, options)

    def nonempty(a: dict[Any, Any]) -> dict[Any, Any]:
        return {k: v for k, v in a.items() if v}

    assert ours[0] == sig
    assert ours[1] == constexprs
    assert nonempty(ours[2]) == nonempty(attrs)


# -- the cubin launcher, through a fake driver -----------------------------------------------


class FakeDriver:
    """Records what the launcher asks of the CUDA driver."""

    def __init__(
        self, sizes: list[int] | None, max_threads: int = 1024, read: list[int] | None = None
    ) -> None:
        self.sizes = sizes
        self.read = read or sizes or []  # the bytes to record of each parameter
        self.max_threads = max_threads
        self.loaded: list[bytes] = []
        self.attributes: list[tuple[int, int]] = []
        self.launches: list[dict[str, Any]] = []
        self.unloaded = 0

    def load(self, cubin: bytes) -> ctypes.c_void_p:
        self.loaded.append(cubin)
        return ctypes.c_void_p(0x1000)

    def unload(self, module: Any) -> None:
        self.unloaded += 1

    def function(self, module: Any, name: str) -> ctypes.c_void_p:
        self.name = name
        return ctypes.c_void_p(0x2000)

    def param_sizes(self, func: Any) -> list[int] | None:
        return self.sizes

    def attribute(self, func: Any, attr: int) -> int:
        return {0: self.max_threads, 1: 0}[attr]

    def set_attribute(self, func: Any, attr: int, value: int, what: str) -> None:
        self.attributes.append((attr, value))

    def launch(self, func: Any, grid: Any, block: Any, shared: int, stream: int, params: Any,
               what: str) -> None:  # fmt: skip
        n = min(len(params), len(self.read))
        raw: list[bytes | None] = [ctypes.string_at(params[i], self.read[i]) for i in range(n)]
        raw += [None] * (len(params) - n)
        self.launches.append(
            {"grid": grid, "block": block, "shared": shared, "stream": stream, "params": raw}
        )


def triton_artifact(**kw: Any) -> job_channel_pb2.KernelArtifact:
    base: dict[str, Any] = dict(
        role="kernel", type=TRITON, cubin=b"\x7fELF fake", function="k", arch="sm_90",
        num_warps=4, shared_bytes=1024, global_scratch_align=1, profile_scratch_align=1,
    )  # fmt: skip
    return job_channel_pb2.KernelArtifact(**{**base, **kw})


def launch_args() -> Any:
    import torch
    from kerneleval_server.engine.inputs import TrialArgs

    x = torch.arange(8, dtype=torch.float32)
    out = torch.zeros(8)
    values = [x, out, 1000, 1 << 40, 0.5, True, 128]
    names = ["x", "out", "n", "big", "alpha", "flag", "BLOCK"]
    roles = [IN, OUT, IN, IN, IN, IN, IN]
    return TrialArgs(values, names, roles, [False] * 6 + [True])


def test_triton_launch_packs_params_scratch_and_geometry() -> None:
    from kerneleval_server.engine.backends.prebuilt import TritonCubinLaunch

    sizes = [8, 8, 4, 8, 4, 1, 8, 8]  # six arguments, then global and profile scratch
    drv = FakeDriver(sizes)
    launch = kernel_pb2.LaunchConfig(grid=kernel_pb2.Dim3(x=3, y=2))
    art = triton_artifact(num_warps=8, shared_bytes=64 * 1024)
    runner = TritonCubinLaunch(art, launch, driver=drv, stream=lambda: 77, device="cpu")
    runner.check_threads()
    runner.allow_shared()
    assert drv.loaded == [b"\x7fELF fake"] and drv.name == "k"
    assert drv.attributes == [(8, 64 * 1024)]  # MAX_DYNAMIC_SHARED_SIZE_BYTES above 48 KiB
    args = launch_args()
    runner(args)
    (rec,) = drv.launches
    assert rec["grid"] == (3, 2, 1) and rec["block"] == (256, 1, 1)
    assert rec["shared"] == 64 * 1024 and rec["stream"] == 77
    p = rec["params"]
    assert p[0] == struct.pack("<Q", args.values[0].data_ptr())
    assert p[1] == struct.pack("<Q", args.values[1].data_ptr())
    assert p[2] == struct.pack("<i", 1000)
    assert p[3] == struct.pack("<q", 1 << 40)
    assert p[4] == struct.pack("<f", 0.5)
    assert p[5] == b"\x01"
    assert p[6] == p[7] == b"\0" * 8  # no scratch: NULL
    # The same arguments again: the packed array is reused; new tensors get new addresses.
    packed = runner._packed
    runner(args)
    assert runner._packed is packed and drv.launches[1]["params"] == p
    fresh = args.clone()
    runner(fresh)
    assert runner._packed is not packed
    assert drv.launches[2]["params"][0] == struct.pack("<Q", fresh.values[0].data_ptr())
    fresh.values[2] = 999
    runner(fresh)
    assert drv.launches[3]["params"][2] == struct.pack("<i", 999)
    assert drv.attributes == [(8, 64 * 1024)]  # set once


def test_triton_launch_allocates_scratch_per_program() -> None:
    from kerneleval_server.engine.backends.prebuilt import TritonCubinLaunch

    drv = FakeDriver([8, 8, 4, 8, 4, 1, 8, 8])
    launch = kernel_pb2.LaunchConfig(grid=kernel_pb2.Dim3(x=3, y=2))
    art = triton_artifact(global_scratch_bytes=100, global_scratch_align=128)
    runner = TritonCubinLaunch(art, launch, driver=drv, stream=lambda: 0, device="cpu")
    runner(launch_args())
    assert drv.attributes == []  # 1 KiB of shared memory: no opt-in
    assert runner._packed is not None
    (buf,) = runner._packed.scratch
    ptr = struct.unpack("<Q", drv.launches[0]["params"][6])[0]
    assert ptr % 128 == 0 and buf.data_ptr() <= ptr
    assert ptr + 100 * 6 <= buf.data_ptr() + buf.numel()  # 6 programs
    assert drv.launches[0]["params"][7] == b"\0" * 8  # no profile scratch


def test_triton_launch_without_param_info_and_with_wrong_counts() -> None:
    from kerneleval_server.engine.backends.prebuilt import TritonCubinLaunch

    # A driver without cuFuncGetParamInfo: scalars sized by their value, as the JIT types
    # them, and both scratch pointers passed (the kernel reads the ones it has).
    drv = FakeDriver(None, read=[8, 8, 4, 8, 4, 1, 8, 8])
    launch = kernel_pb2.LaunchConfig()
    runner = TritonCubinLaunch(
        triton_artifact(), launch, driver=drv, stream=lambda: 0, device="cpu"
    )
    runner(launch_args())
    p = drv.launches[0]["params"]
    assert len(p) == 8 and p[2] == struct.pack("<i", 1000) and p[3] == struct.pack("<q", 1 << 40)
    assert p[4] == struct.pack("<f", 0.5) and p[6] == p[7] == b"\0" * 8
    assert drv.launches[0]["grid"] == (1, 1, 1) and drv.launches[0]["block"] == (128, 1, 1)
    short = TritonCubinLaunch(triton_artifact(), launch, driver=FakeDriver([8, 8, 8]),
                              stream=lambda: 0, device="cpu")  # fmt: skip
    with pytest.raises(TypeError, match="takes 3 parameters .* gives 6 arguments"):
        short(launch_args())
    few_threads = TritonCubinLaunch(triton_artifact(num_warps=16), launch,
                                    driver=FakeDriver([8] * 8, max_threads=256),
                                    device="cpu")  # fmt: skip
    from kerneleval_server.engine.preflight import ResourceLimitError

    with pytest.raises(ResourceLimitError, match="threads: the kernel needs 512"):
        few_threads.check_threads()


def test_raw_cuda_launch_uses_the_iocontract_geometry() -> None:
    from kerneleval_server.engine.backends.cuda import CudaLaunch
    from kerneleval_server.engine.device import DeviceLimits

    drv = FakeDriver([8, 8, 4, 8, 4, 1])
    launch = kernel_pb2.LaunchConfig(
        grid=kernel_pb2.Dim3(x=5), block=kernel_pb2.Dim3(x=32, y=4), shared_memory_bytes=50_000
    )
    runner = CudaLaunch(b"cubin", "_Z1kPfS_ixfb", launch, driver=drv)
    runner.stream, runner.device = (lambda: 5), "cpu"
    runner.preflight(DeviceLimits(max_shared_memory_per_block_optin=100_000))
    runner(launch_args())
    (rec,) = drv.launches
    assert rec["grid"] == (5, 1, 1) and rec["block"] == (32, 4, 1) and rec["shared"] == 50_000
    assert drv.attributes == [(8, 50_000)]
    assert len([x for x in rec["params"] if x is not None]) == 6  # no scratch pointers
    del runner
    import gc

    gc.collect()
    assert drv.unloaded == 1  # the module goes with its launcher


if __name__ == "__main__":  # the `built` fixture's child
    _child_main(Path(sys.argv[1]))


@needs_nvcc
def test_a_reference_given_built_is_not_built_again(tmp_path: Path) -> None:
    """The front end keeps a raw CUDA reference built for an earlier job and gives it to the
    next build of a job with that reference (jobs/manager.py: _reference_built_before): the
    build compiles the kernel alone."""
    spec = job(cuda_add(), cuda_add())
    both = build_job(spec, RecordingReporter(), config(tmp_path), ARCH)
    assert [a.role for a in both.artifacts] == ["kernel", "reference"], both
    reference = both.artifacts[1]
    alone = build_job(spec, RecordingReporter(), config(tmp_path), ARCH, prebuilt=[reference])
    assert [a.role for a in alone.artifacts] == ["kernel"], alone
    assert alone.artifacts[0].function == both.artifacts[0].function
