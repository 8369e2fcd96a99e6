"""Built ahead against JIT on a real GPU (issue 12): for each case, build_job in a child with no
GPU (CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET=0), then run_job with the artifacts in a fresh
GPU process that has imported no source, and run_job without them (Triton's JIT, nvcc) for
comparison. Compares verdicts, correctness and the kernels' median times.

Run from the repository root (about 2 minutes on an H100):
    PYTHONPATH=server:clients/python/src python bench/gpu_prebuilt_check.py --out bench/results
or as the `prebuilt` stage of bench/run_gpu.sh. Writes gpu_prebuilt_check.json and .md to
--out and prints the table. Exit 1 when a case's prebuilt verdict differs from the JIT's (or a
step of it failed). --cpu-smoke checks the plumbing without a GPU (small sizes; the prebuilt
side then ends "no CUDA device", which is what is expected there).

Each case runs in processes of its own: a device fault poisons its process's CUDA context.
A case's run child runs the prebuilt job first (the process has then imported nothing of the
job: checked, as is that Triton compiled nothing), then the JIT job; a faulting case runs the
two in separate children."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "server", ROOT / "clients" / "python" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from kerneleval.internal.v1 import job_channel_pb2  # noqa: E402
from kerneleval.v1 import dtype_pb2, kernel_pb2  # noqa: E402

K = kernel_pb2
F32, F16 = dtype_pb2.DTYPE_FLOAT32, dtype_pb2.DTYPE_FLOAT16
IN, OUT = K.ARG_ROLE_INPUT, K.ARG_ROLE_OUTPUT
MARKER_ENV = "KE_PREBUILT_MARKER"
# Every Triton source writes a marker file when it is imported: the prebuilt run must not.
MARKER = f"""
import os as _os, pathlib as _pl
if _os.environ.get("{MARKER_ENV}"):
    _pl.Path(_os.environ["{MARKER_ENV}"]).write_text("imported")
"""

# ---------------------------------------------------------------------------------------------
# Kernels

TRITON_ADD = (
    MARKER
    + """
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)
"""
)
TRITON_ADD_F32_MATH = (
    MARKER
    + """
import triton
import triton.language as tl

@triton.jit
def add_ref(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x + y).to(out_ptr.dtype.element_ty), mask=mask)
"""
)
TRITON_AXPBY = (
    MARKER
    + """
import triton
import triton.language as tl

@triton.jit
def axpby(x_ptr, y_ptr, out_ptr, n, alpha, beta, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + beta * y, mask=mask)
"""
)
TRITON_STRIDED_COPY = (
    MARKER
    + """
import triton
import triton.language as tl

@triton.jit
def strided_copy(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs * stride, tl.load(x_ptr + offs * stride, mask=mask), mask=mask)
"""
)
TRITON_OOB = (
    MARKER
    + """
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    y = tl.load(y_ptr + offs)
    far = offs.to(tl.int64) + (1 << 36)  # 256 GiB past the buffer: unmapped
    tl.store(out_ptr + far, x + y)
"""
)
TRITON_MATMUL = (
    MARKER
    + """
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
)
# The reference takes the same arguments (BM, BN, BK too) but tiles 64x64x32 (< 48 KiB).
TRITON_MATMUL_REF = (
    MARKER
    + """
import triton
import triton.language as tl

@triton.jit
def matmul_ref(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):
    rm = tl.program_id(0) * 64 + tl.arange(0, 64)
    rn = tl.program_id(1) * 64 + tl.arange(0, 64)
    rk = tl.arange(0, 32)
    acc = tl.zeros((64, 64), dtype=tl.float32)
    for k in range(0, K, 32):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16))
"""
)
CUDA_KERNELS = """
__global__ void add(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
extern "C" __global__ void axpby(const float* x, const float* y, float* out, int n,
                                 float alpha, float beta) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = alpha * x[i] + beta * y[i];
}
extern "C" __global__ void copy(const float* x, float* out, int n, int stride) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i * stride] = x[i * stride];
}
"""

# ---------------------------------------------------------------------------------------------
# Cases


def t(name: str, shape: list[int], dtype: int = F32, role: int = IN) -> K.ArgSpec:
    return K.ArgSpec(name=name, role=role, tensor=K.TensorSpec(shape=shape, dtype=dtype))


def s(name: str, value: float, meta: bool = False) -> K.ArgSpec:
    a = K.ArgSpec(name=name, meta=meta)
    if isinstance(value, float):
        a.float_value = value
    else:
        a.int_value = int(value)
    return a


def src(
    kind: int,
    code: str,
    args: list[K.ArgSpec],
    grid: tuple[int, int, int],
    block: tuple[int, int, int] = (1, 1, 1),
    entry: str = "",
    warps: int = 0,
    stages: int = 0,
) -> K.KernelSource:
    k = K.KernelSource(type=kind, source_code=code, entry_point=entry)
    k.io.args.extend(args)
    k.io.launch.grid.CopyFrom(K.Dim3(x=grid[0], y=grid[1], z=grid[2]))
    k.io.launch.block.CopyFrom(K.Dim3(x=block[0], y=block[1], z=block[2]))
    k.io.launch.num_warps = warps
    k.io.launch.num_stages = stages
    return k


def spec(kernel: K.KernelSource, reference: K.KernelSource | None = None) -> K.JobSpec:
    sp = K.JobSpec(kernel=kernel, client_tag="gpu_prebuilt_check")
    sp.options.perf_trial_count = 100
    sp.options.warmup_count = 10
    sp.options.correct_trial_count = 3
    if reference is not None:
        sp.reference.CopyFrom(reference)
    return sp


@dataclass
class Case:
    name: str
    what: str
    make: Callable[[bool], K.JobSpec]  # smoke -> spec
    expect: str = "VERDICT_OK"
    faults: bool = False  # poisons its process: prebuilt and JIT in separate children


def add_io(n: int, dtype: int = F32, block: int = 1024) -> list[K.ArgSpec]:
    return [t("x", [n], dtype), t("y", [n], dtype), t("out", [n], dtype, OUT), s("n", n),
            s("BLOCK", block, True)]  # fmt: skip


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def case_add(n_gpu: int) -> Callable[[bool], K.JobSpec]:
    def make(smoke: bool) -> K.JobSpec:
        n = 4096 if smoke else n_gpu
        args = add_io(n)
        return spec(
            src(K.KERNEL_TYPE_TRITON, TRITON_ADD, args, grid=(cdiv(n, 1024), 1, 1)),
            src(
                K.KERNEL_TYPE_CUDA,
                CUDA_KERNELS,
                args,
                grid=(cdiv(n, 256), 1, 1),
                block=(256, 1, 1),
                entry="add",
            ),  # fmt: skip
        )

    return make


def make_axpby(smoke: bool) -> K.JobSpec:
    n = 4099 if smoke else 1_000_003  # not a multiple of 16
    args = [t("x", [n]), t("y", [n]), t("out", [n], role=OUT), s("n", n), s("alpha", 0.5),
            s("beta", -2.0), s("BLOCK", 1024, True)]  # fmt: skip
    return spec(
        src(K.KERNEL_TYPE_TRITON, TRITON_AXPBY, args, grid=(cdiv(n, 1024), 1, 1)),
        src(
            K.KERNEL_TYPE_CUDA,
            CUDA_KERNELS,
            args,
            grid=(cdiv(n, 256), 1, 1),
            block=(256, 1, 1),
            entry="axpby",
        ),  # fmt: skip
    )


def make_fp16(smoke: bool) -> K.JobSpec:
    n = 4096 if smoke else 1 << 22
    args = add_io(n, F16)
    return spec(
        src(K.KERNEL_TYPE_TRITON, TRITON_ADD, args, grid=(cdiv(n, 1024), 1, 1)),
        src(K.KERNEL_TYPE_TRITON, TRITON_ADD_F32_MATH, args, grid=(cdiv(n, 1024), 1, 1)),
    )


def make_matmul(smoke: bool) -> K.JobSpec:
    n = 128 if smoke else 1024
    args = [t("a", [n, n], F16), t("b", [n, n], F16), t("c", [n, n], F16, OUT), s("M", n),
            s("N", n), s("K", n), s("BM", 128, True), s("BN", 128, True),
            s("BK", 64, True)]  # fmt: skip
    return spec(
        src(
            K.KERNEL_TYPE_TRITON,
            TRITON_MATMUL,
            args,
            grid=(n // 128, n // 128, 1),
            warps=8,
            stages=3,
        ),  # fmt: skip
        src(
            K.KERNEL_TYPE_TRITON,
            TRITON_MATMUL_REF,
            args,
            grid=(n // 64, n // 64, 1),
            warps=4,
            stages=2,
        ),  # fmt: skip
    )


def make_oob(smoke: bool) -> K.JobSpec:
    n = 4096 if smoke else 1 << 20
    return spec(src(K.KERNEL_TYPE_TRITON, TRITON_OOB, add_io(n), grid=(cdiv(n, 1024), 1, 1)))


def make_cuda(smoke: bool) -> K.JobSpec:
    n = 4096 if smoke else 1 << 24
    args = add_io(n)
    return spec(
        src(
            K.KERNEL_TYPE_CUDA,
            CUDA_KERNELS,
            args,
            grid=(cdiv(n, 256), 1, 1),
            block=(256, 1, 1),
            entry="add",
        ),  # fmt: skip
        src(K.KERNEL_TYPE_TRITON, TRITON_ADD, args, grid=(cdiv(n, 1024), 1, 1)),
    )


def make_stride_one(smoke: bool) -> K.JobSpec:
    n = 4096 if smoke else 1 << 24
    args = [t("x", [n]), t("out", [n], role=OUT), s("n", n), s("stride", 1),
            s("BLOCK", 1024, True)]  # fmt: skip
    return spec(
        src(K.KERNEL_TYPE_TRITON, TRITON_STRIDED_COPY, args, grid=(cdiv(n, 1024), 1, 1)),
        src(
            K.KERNEL_TYPE_CUDA,
            CUDA_KERNELS,
            args,
            grid=(cdiv(n, 256), 1, 1),
            block=(256, 1, 1),
            entry="copy",
        ),  # fmt: skip
    )


CASES = [
    Case("triton_add", "Triton add (BLOCK constexpr), 16M fp32, vs raw CUDA", case_add(1 << 24)),
    Case("triton_add_tiny", "Triton add, 4096 fp32 (launch-bound), vs raw CUDA", case_add(4096)),
    Case(
        "triton_scalars", "Triton alpha*x+beta*y, n=1000003 (not /16), float scalars", make_axpby
    ),  # fmt: skip
    Case("triton_fp16", "Triton add on fp16, 4M, vs a Triton reference", make_fp16),
    Case(
        "triton_big_smem",
        "Triton tl.dot 1024^3 fp16, 128x128x64 tiles, 3 stages (>48 KiB)",
        make_matmul,
    ),  # fmt: skip
    Case(
        "triton_oob",
        "Triton store 256 GiB out of bounds",
        make_oob,
        "VERDICT_DEVICE_FAULT",
        faults=True,
    ),  # fmt: skip
    Case("cuda_add", "raw CUDA add, 16M fp32, vs a Triton reference", make_cuda),
    Case(
        "triton_stride_one",
        "Triton strided copy, stride=1 (the JIT folds a 1, prebuilt not)",
        make_stride_one,
    ),  # fmt: skip
]
BY_NAME = {c.name: c for c in CASES}

# ---------------------------------------------------------------------------------------------
# Children


def child_build(case: Case, work: Path, arch: str, smoke: bool) -> None:
    """In a process with no GPU: build_job, the outcome to work/outcome.pb."""
    from kerneleval_server.engine import EngineConfig, NullReporter, build_job
    from kerneleval_server.engine.backends.triton_build import triton_compiles_here

    os.environ[MARKER_ENV] = str(work / "marker_build")
    t0 = time.perf_counter()
    out = build_job(case.make(smoke), NullReporter(), EngineConfig(work_dir=work / "build"), arch)
    info = {
        "seconds": round(time.perf_counter() - t0, 2),
        "compiled_in_process": triton_compiles_here(),
        "imported": (work / "marker_build").exists(),
    }
    (work / "outcome.pb").write_bytes(out.SerializeToString())
    (work / "build.json").write_text(json.dumps(info))


def _warm_gpu() -> None:
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        a = a @ a
        a /= a.norm()
    torch.cuda.synchronize()


def _run(case: Case, work: Path, mode: str, smoke: bool, prebuilt: list[Any]) -> dict[str, Any]:
    from google.protobuf import json_format
    from kerneleval.v1 import job_pb2
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job

    marker = work / f"marker_{mode}"
    os.environ[MARKER_ENV] = str(marker)
    t0 = time.perf_counter()
    outcome = run_job(
        case.make(smoke), NullReporter(), EngineConfig(work_dir=work / mode), prebuilt=prebuilt
    )
    r = outcome.result
    row = {
        "verdict": job_pb2.Verdict.Name(r.verdict),
        "compiled": r.compiled,
        "correctness": r.correctness,
        "trials_passed": r.validation.trials_passed,
        "trial_count": r.validation.trial_count,
        "max_abs_error": r.validation.max_abs_error,
        "median_ms": r.runtime.median_ms if r.runtime.trial_count else None,
        "ref_median_ms": r.reference_runtime.median_ms if r.reference_runtime.trial_count else None,
        "cuda_error_code": r.error.cuda_error_code,
        "message": (r.error.message or r.validation_error or r.compilation_error)[:400],
        "poisoned": outcome.context_poisoned,
        "imported": marker.exists(),
        "seconds": round(time.perf_counter() - t0, 2),
        "notes": list(r.notes),
        "result": json_format.MessageToDict(r),
    }
    return row


def _prebuilt_run(case: Case, work: Path, smoke: bool) -> dict[str, Any]:
    """run_job with the artifacts, counting what must not happen: Triton compiling, the
    engine importing a source."""
    import triton.compiler
    import triton.compiler.compiler
    from kerneleval_server.engine import loader

    calls: list[str] = []
    real_compile, real_import = triton.compiler.compiler.compile, loader.import_source

    def compile_(*a: Any, **k: Any) -> Any:
        calls.append("triton.compile")
        return real_compile(*a, **k)

    def import_(*a: Any, **k: Any) -> Any:
        calls.append("import_source")
        return real_import(*a, **k)

    out = job_channel_pb2.BuildOutcome()
    out.ParseFromString((work / "outcome.pb").read_bytes())
    triton.compiler.compile = compile_  # type: ignore[assignment]
    triton.compiler.compiler.compile = compile_  # type: ignore[assignment]
    loader.import_source = import_  # type: ignore[assignment]
    try:
        row = _run(case, work, "prebuilt", smoke, list(out.artifacts))
    finally:
        triton.compiler.compile = real_compile  # type: ignore[assignment]
        triton.compiler.compiler.compile = real_compile  # type: ignore[assignment]
        loader.import_source = real_import  # type: ignore[assignment]
    row["forbidden_calls"] = calls
    return row


def child_run(case: Case, work: Path, modes: list[str], smoke: bool) -> None:
    """On the GPU: run_job with the artifacts ("prebuilt") and/or without ("jit"); one JSON
    file per mode. The prebuilt run goes first: nothing of the job was imported before it."""
    from kerneleval_server.engine import configure_process_environment

    configure_process_environment()
    import torch

    if torch.cuda.is_available():
        _warm_gpu()
    for mode in modes:
        if mode == "prebuilt":
            row = _prebuilt_run(case, work, smoke)
        else:
            row = _run(case, work, mode, smoke, [])
        (work / f"{mode}.json").write_text(json.dumps(row, default=str))
        if row["poisoned"]:
            break
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: a dead CUDA context can hang it


# ---------------------------------------------------------------------------------------------
# The check


def _child(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), *args]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, (p.stdout + p.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout} s"


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "server"), str(ROOT / "clients" / "python" / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra)
    return env


def check_case(case: Case, root: Path, arch: str, smoke: bool) -> dict[str, Any]:
    work = root / case.name
    work.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"case": case.name, "what": case.what, "expect": case.expect}
    flags = ["--work", str(work), "--arch", arch] + (["--cpu-smoke"] if smoke else [])
    build_env = child_env({"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0"})
    rc, log = _child(["--build", case.name, *flags], build_env, 240)
    if not (work / "outcome.pb").exists():
        row["error"] = f"build child exit {rc}: {log}"
        return row
    out = job_channel_pb2.BuildOutcome()
    out.ParseFromString((work / "outcome.pb").read_bytes())
    row["build"] = json.loads((work / "build.json").read_text())
    row["artifacts"] = [
        {"role": a.role, "function": a.function, "num_warps": a.num_warps,
         "shared_bytes": a.shared_bytes, "cubin_bytes": len(a.cubin),
         "global_scratch_bytes": a.global_scratch_bytes}
        for a in out.artifacts
    ]  # fmt: skip
    row["run_whole"] = out.run_whole
    if out.HasField("result"):
        row["build_result"] = out.result.error.message or out.result.compilation_error[:400]
    if not out.artifacts:
        row["error"] = "nothing built: " + (out.run_whole or row.get("build_result", ""))
        return row
    run_env = child_env({})
    run_env.pop("TRITON_INTERPRET", None)
    if smoke:  # no GPU: only the prebuilt side is checked (the JIT side is the interpreter)
        runs = [["prebuilt"]]
    else:
        runs = [["prebuilt"], ["jit"]] if case.faults else [["prebuilt", "jit"]]
    for modes in runs:
        rc, log = _child(["--run", case.name, "--modes", ",".join(modes), *flags], run_env, 240)
        for mode in modes:
            f = work / f"{mode}.json"
            if f.exists():
                row[mode] = json.loads(f.read_text())
            else:
                row[mode] = {"verdict": f"run child exit {rc}", "message": log}
        if rc != 0 and not all((work / f"{m}.json").exists() for m in modes):
            row.setdefault("child_logs", []).append(log)
    return row


def judge(row: dict[str, Any], smoke: bool) -> dict[str, Any]:
    pre, jit = row.get("prebuilt", {}), row.get("jit", {})
    problems = []
    if "error" in row:
        problems.append(row["error"])
    elif smoke:
        # No GPU: the JIT runs Triton under its interpreter; prebuilt cubins cannot run.
        if pre.get("verdict") != "VERDICT_RUNTIME_ERROR" or "no CUDA device" not in pre.get(
            "message", ""
        ):
            problems.append(f"prebuilt without a GPU: {pre.get('verdict')} {pre.get('message')}")
    else:
        if pre.get("verdict") != jit.get("verdict"):
            problems.append(
                f"verdicts differ: prebuilt {pre.get('verdict')}, jit {jit.get('verdict')}"
            )
        if pre.get("verdict") != row["expect"]:
            problems.append(f"prebuilt verdict {pre.get('verdict')}, expected {row['expect']}")
        if pre.get("correctness") != jit.get("correctness"):
            problems.append("correctness differs")
    if pre.get("imported"):
        problems.append("the prebuilt run imported the job's source")
    if pre.get("forbidden_calls"):
        problems.append(f"the prebuilt run called {sorted(set(pre['forbidden_calls']))}")
    if row.get("build", {}).get("imported") is False and "error" not in row:
        problems.append("the build did not import the source (marker missing)")
    pm, jm = pre.get("median_ms"), jit.get("median_ms")
    row["ratio"] = round(pm / jm, 3) if pm and jm else None
    prm, jrm = pre.get("ref_median_ms"), jit.get("ref_median_ms")
    row["ref_ratio"] = round(prm / jrm, 3) if prm and jrm else None
    row["problems"] = problems
    row["pass"] = not problems
    return row


def _fmt_ms(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) and v else "-"


def report(rows: list[dict[str, Any]], out: Path, arch: str, smoke: bool, took: float) -> None:
    headers = [
        "case", "expect", "jit verdict", "prebuilt verdict", "jit ok", "prebuilt ok",
        "jit median ms", "prebuilt median ms", "ratio", "ref ratio", "smem", "pass",
    ]  # fmt: skip
    table = []
    for r in rows:
        pre, jit = r.get("prebuilt", {}), r.get("jit", {})
        smem = max((a["shared_bytes"] for a in r.get("artifacts", [])), default=0)
        table.append([
            r["case"], r["expect"].removeprefix("VERDICT_"),
            str(jit.get("verdict", "-")).removeprefix("VERDICT_"),
            str(pre.get("verdict", "-")).removeprefix("VERDICT_"),
            jit.get("correctness", "-"), pre.get("correctness", "-"),
            _fmt_ms(jit.get("median_ms")), _fmt_ms(pre.get("median_ms")),
            r.get("ratio") or "-", r.get("ref_ratio") or "-", smem, "yes" if r["pass"] else "NO",
        ])  # fmt: skip
    cells = [headers] + [[str(c) for c in row] for row in table]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    import platform

    try:
        import torch
        import triton

        versions = f"torch {torch.__version__}, triton {triton.__version__}"
    except Exception:  # noqa: BLE001 - informative only
        versions = ""
    head = (
        f"gpu_prebuilt_check: arch {arch}{' (cpu smoke)' if smoke else ''}; {versions}; "
        f"python {platform.python_version()}; {took:.0f} s"
    )
    text = "\n".join(lines)
    print(f"\n{head}\n\n{text}\n")
    problems = [f"- {r['case']}: {p}" for r in rows for p in r["problems"]]
    if problems:
        print("problems:\n" + "\n".join(problems))
    md = [
        "# Built ahead against JIT",
        "",
        head,
        "",
        "ratio: the kernel's median time prebuilt / JIT (ref ratio: the reference's). Each "
        "case's prebuilt run is first in its process (the JIT run follows it there).",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(" --- " for _ in headers) + "|",
        *["| " + " | ".join(str(c) for c in row) + " |" for row in table],
        "",
    ]
    if problems:
        md += ["Problems:", "", *problems, ""]
    md += ["Cases:", "", *[f"- {r['case']}: {r['what']}" for r in rows], ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_prebuilt_check.md").write_text("\n".join(md))
    (out / "gpu_prebuilt_check.json").write_text(
        json.dumps(
            {"arch": arch, "smoke": smoke, "seconds": took, "versions": versions, "cases": rows},
            indent=2,
            default=str,
        )
        + "\n"  # fmt: skip
    )
    print(f"wrote {out / 'gpu_prebuilt_check.json'} and .md")


def detect_arch() -> str:
    try:
        p = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        cap = p.stdout.strip().splitlines()[0].strip()
        major, minor = cap.split(".")
        return f"sm_{int(major)}{int(minor)}"
    except Exception:  # noqa: BLE001 - no nvidia-smi: torch asks the GPU, else the default
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
        return "sm_90"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: check the plumbing")
    ap.add_argument("--arch", default="", help="default: the GPU's (nvidia-smi)")
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="prebuilt,jit", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.build:
        child_build(BY_NAME[a.build], Path(a.work), a.arch, a.cpu_smoke)
        return 0
    if a.run:
        child_run(BY_NAME[a.run], Path(a.work), a.modes.split(","), a.cpu_smoke)
        return 0
    arch = a.arch or detect_arch()
    names = [n for n in a.cases.split(",") if n] or [c.name for c in CASES]
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="prebuilt-check-") as d:
        for name in names:
            case = BY_NAME[name]
            print(f"--- {name}: {case.what}", flush=True)
            try:
                row = judge(check_case(case, Path(d), arch, a.cpu_smoke), a.cpu_smoke)
            except Exception as e:  # noqa: BLE001 - one case failing does not stop the others
                row = {"case": name, "what": case.what, "expect": case.expect, "pass": False,
                       "problems": [f"{type(e).__name__}: {e}"]}  # fmt: skip
            pre, jit = row.get("prebuilt", {}), row.get("jit", {})
            print(
                f"    prebuilt {pre.get('verdict')} {_fmt_ms(pre.get('median_ms'))} ms, "
                f"jit {jit.get('verdict')} {_fmt_ms(jit.get('median_ms'))} ms, "
                f"{'pass' if row['pass'] else 'FAIL: ' + '; '.join(row['problems'])}",
                flush=True,
            )
            rows.append(row)
    report(rows, Path(a.out), arch, a.cpu_smoke, time.perf_counter() - t0)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
