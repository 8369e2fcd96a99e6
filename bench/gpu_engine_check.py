"""The engine on a real GPU: the same cases for all four kernel types, the KernelBench examples,
faults that kill a CUDA context (each in its own process), resource limits, the debug aids,
and the engine's median against triton.testing.do_bench in the same process.

Run from the repository root:
    PYTHONPATH=server:clients/python/src python bench/gpu_engine_check.py \
        --kernelbench ../shared/kernelbench --out bench/results
On a machine without a GPU, --cpu-smoke runs what can run (Triton under its interpreter).
Writes engine_check.json and engine_check.md to --out and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "clients" / "python" / "src")]

from kerneleval_server.engine import configure_process_environment  # noqa: E402

configure_process_environment()

import torch  # noqa: E402
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_pb2  # noqa: E402
from kerneleval_server.engine import (  # noqa: E402
    DeviceLimits,
    EngineConfig,
    NullReporter,
    run_job,
)

K = kernel_pb2
F32 = dtype_pb2.DTYPE_FLOAT32
F16 = dtype_pb2.DTYPE_FLOAT16
GPU = torch.cuda.is_available()

# ---------------------------------------------------------------------------------------------
# Kernels

TORCH_ADD = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, y):
        return x + y
"""
TRITON_ADD = """
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
TRITON_OOB = """
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
TRITON_BIG_SMEM = """
import triton
import triton.language as tl

@triton.jit
def matmul(a_ptr, b_ptr, c_ptr, M, N, K_, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K_, BK):
        a = tl.load(a_ptr + rm[:, None] * K_ + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.float16))
"""
CUDA_ADD = """
__global__ void add(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
extern "C" __global__ void add_half_done(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n / 2) out[i] = x[i] + y[i];
}
extern "C" __global__ void add_oob(const float* x, const float* y, float* out, int n) {
    long long i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i + (1LL << 36)] = x[i] + y[i];
}
extern "C" __global__ void add_off_by_one(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) out[i] = x[i] + y[i];
}
"""

# memcheck stops the kernel at its first bad access: the off-by-one kernel's read of x[n].
OOB_REPORT = re.compile(r"Invalid __global__ (read|write)")

N_ADD = 1 << 20 if GPU else 1 << 12  # the Triton interpreter is slow


def t(name: str, shape: list[int], dtype: Any = F32, role: Any = K.ARG_ROLE_INPUT) -> K.ArgSpec:
    return K.ArgSpec(name=name, role=role, tensor=K.TensorSpec(shape=shape, dtype=dtype))


def i(name: str, value: int, meta: bool = False) -> K.ArgSpec:
    return K.ArgSpec(name=name, int_value=value, meta=meta)


def add_args(n: int = N_ADD, block: int = 1024) -> list[K.ArgSpec]:
    return [
        t("x", [n]),
        t("y", [n]),
        t("out", [n], role=K.ARG_ROLE_OUTPUT),
        i("n", n),
        i("BLOCK", block, meta=True),
    ]


def ksrc(
    kind: Any,
    code: str,
    args: list[K.ArgSpec] | None = None,
    grid=(1, 1, 1),
    block=(1, 1, 1),
    entry: str = "",
    shared: int = 0,
    warps: int = 0,
    stages: int = 0,
) -> K.KernelSource:
    k = K.KernelSource(type=kind, source_code=code, entry_point=entry)
    if args:
        k.io.args.extend(args)
        k.io.launch.grid.CopyFrom(K.Dim3(x=grid[0], y=grid[1], z=grid[2]))
        k.io.launch.block.CopyFrom(K.Dim3(x=block[0], y=block[1], z=block[2]))
        k.io.launch.shared_memory_bytes = shared
        k.io.launch.num_warps = warps
        k.io.launch.num_stages = stages
    return k


def spec(kernel: K.KernelSource, reference: K.KernelSource | None = None, **opts: Any) -> K.JobSpec:
    s = K.JobSpec(kernel=kernel, options=K.EvalOptions(**opts))
    if reference is not None:
        s.reference.CopyFrom(reference)
    return s


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass
class Case:
    name: str
    kind: str
    spec: K.JobSpec
    expect: str  # verdict name
    code: int = 0  # expected cuda_error_code
    gpu_only: bool = False
    own_process: bool = False  # kills the CUDA context: run in a process of its own
    cpu_expect: str = ""  # the verdict without a GPU, when it differs
    device_limits: DeviceLimits | None = None
    check: str = ""  # extra check by name, see extra_check()


def cases(kb: Path) -> list[Case]:
    ex = kb / "examples"
    grid = (N_ADD // 1024, 1, 1)
    ref = ksrc(K.KERNEL_TYPE_TORCH, TORCH_ADD)
    out: list[Case] = [
        Case(
            "torch add (evaluate)",
            "TORCH",
            spec(ksrc(K.KERNEL_TYPE_TORCH, TORCH_ADD, add_args()[:2])),
            "VERDICT_OK",
        ),
        Case(
            "triton add from IOContract vs torch",
            "TRITON",
            spec(ksrc(K.KERNEL_TYPE_TRITON, TRITON_ADD, add_args(), grid=grid), ref),
            "VERDICT_OK",
        ),
        Case(
            "cuda add (nvcc, driver launch) vs torch",
            "CUDA",
            spec(
                ksrc(
                    K.KERNEL_TYPE_CUDA,
                    CUDA_ADD,
                    add_args()[:4],
                    grid=grid,
                    block=(1024, 1, 1),
                    entry="add",
                ),
                ref,
            ),
            "VERDICT_OK",
            cpu_expect="VERDICT_RUNTIME_ERROR",
        ),
        Case(
            "cuda kernel leaving half the output unwritten",
            "CUDA",
            spec(
                ksrc(
                    K.KERNEL_TYPE_CUDA,
                    CUDA_ADD,
                    add_args()[:4],
                    grid=grid,
                    block=(1024, 1, 1),
                    entry="add_half_done",
                ),
                ref,
            ),
            "VERDICT_INCORRECT",
            cpu_expect="VERDICT_RUNTIME_ERROR",
        ),
        Case(
            "cuda block of 2048 threads",
            "CUDA",
            spec(
                ksrc(
                    K.KERNEL_TYPE_CUDA,
                    CUDA_ADD,
                    add_args()[:4],
                    grid=grid,
                    block=(2048, 1, 1),
                    entry="add",
                )
            ),
            "VERDICT_RESOURCE_LIMIT",
            device_limits=None if GPU else DeviceLimits(),
        ),
        Case(
            "cuda 1 MiB of dynamic shared memory",
            "CUDA",
            spec(
                ksrc(
                    K.KERNEL_TYPE_CUDA,
                    CUDA_ADD,
                    add_args()[:4],
                    grid=grid,
                    block=(256, 1, 1),
                    entry="add",
                    shared=1 << 20,
                )
            ),
            "VERDICT_RESOURCE_LIMIT",
            device_limits=None if GPU else DeviceLimits(),
        ),
        Case(
            "triton matmul needing > device shared memory",
            "TRITON",
            spec(
                ksrc(
                    K.KERNEL_TYPE_TRITON,
                    TRITON_BIG_SMEM,
                    [
                        t("a", [512, 512], F16),
                        t("b", [512, 512], F16),
                        t("c", [512, 512], F16, K.ARG_ROLE_OUTPUT),
                        i("M", 512),
                        i("N", 512),
                        i("K_", 512),
                        i("BM", 256, True),
                        i("BN", 256, True),
                        i("BK", 128, True),
                    ],
                    grid=(2, 2, 1),
                    warps=8,
                    stages=4,
                )
            ),
            "VERDICT_RESOURCE_LIMIT",
            gpu_only=True,
        ),
        Case(
            "triton out-of-bounds store",
            "TRITON",
            spec(ksrc(K.KERNEL_TYPE_TRITON, TRITON_OOB, add_args(), grid=grid), ref),
            "VERDICT_DEVICE_FAULT",
            code=700,
            gpu_only=True,
            own_process=True,
            check="poisoned",
        ),
        Case(
            "cuda out-of-bounds write",
            "CUDA",
            spec(
                ksrc(
                    K.KERNEL_TYPE_CUDA,
                    CUDA_ADD,
                    add_args()[:4],
                    grid=grid,
                    block=(1024, 1, 1),
                    entry="add_oob",
                ),
                ref,
            ),
            "VERDICT_DEVICE_FAULT",
            code=700,
            gpu_only=True,
            own_process=True,
            check="poisoned",
        ),
        Case(
            "triton out-of-bounds store, launch_blocking (engine's own child)",
            "TRITON",
            spec(
                ksrc(K.KERNEL_TYPE_TRITON, TRITON_OOB, add_args(), grid=grid),
                ref,
                launch_blocking=True,
            ),
            "VERDICT_DEVICE_FAULT",
            code=700,
            gpu_only=True,
            own_process=True,
            check="not_poisoned",
        ),
        Case(
            "cuda off-by-one access under compute-sanitizer",
            "CUDA",
            spec(
                ksrc(
                    K.KERNEL_TYPE_CUDA,
                    CUDA_ADD,
                    add_args(1000)[:4],
                    grid=(1, 1, 1),
                    block=(1024, 1, 1),
                    entry="add_off_by_one",
                ),
                ref,
                sanitize=True,
            ),
            "VERDICT_DEVICE_FAULT",
            gpu_only=True,
            check="sanitizer",
        ),
        Case(
            "triton add with device_metrics (ncu)",
            "TRITON",
            spec(
                ksrc(K.KERNEL_TYPE_TRITON, TRITON_ADD, add_args(), grid=grid),
                ref,
                device_metrics=True,
            ),
            "VERDICT_OK",
            gpu_only=True,
            check="metrics",
        ),
    ]
    if ex.exists():
        out += [
            Case(
                "KernelBench example: triton ModelNew vs Model",
                "TRITON",
                spec(
                    ksrc(K.KERNEL_TYPE_TRITON, (ex / "model_new_ex_add_triton.py").read_text()),
                    ksrc(K.KERNEL_TYPE_TORCH, (ex / "model_ex_add.py").read_text()),
                ),
                "VERDICT_OK",
            ),
            Case(
                "KernelBench example: load_inline add vs Model",
                "TORCH_CUDA",
                spec(
                    ksrc(K.KERNEL_TYPE_TORCH_CUDA, (ex / "model_new_ex_add.py").read_text()),
                    ksrc(K.KERNEL_TYPE_TORCH, (ex / "model_ex_add.py").read_text()),
                ),
                "VERDICT_OK",
                cpu_expect="VERDICT_RUNTIME_ERROR",
            ),
        ]
    return out


def run_case(c: Case, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    outcome = run_job(
        c.spec, NullReporter(), EngineConfig(work_dir=work, device_limits=c.device_limits)
    )
    r = outcome.result
    row = {
        "case": c.name,
        "type": c.kind,
        "verdict": job_pb2.Verdict.Name(r.verdict),
        "cuda_error": f"{r.error.cuda_error_name} {r.error.cuda_error_code}".strip()
        if r.error.cuda_error_code
        else "",
        "poisoned": outcome.context_poisoned,
        "median_ms": round(r.runtime.median_ms, 5) if r.runtime.trial_count else None,
        "speedup": round(r.speedup, 3) if r.speedup else None,
        "message": (r.error.message or r.validation_error or r.compilation_error)[:300],
        "notes": list(r.notes),
        "sanitizer_report": r.sanitizer_report[:3000],
        "sanitizer_saw_oob": bool(OOB_REPORT.search(r.sanitizer_report)),
        "metrics": dict(r.device_metrics.values),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    return row


def judge(c: Case, row: dict[str, Any]) -> dict[str, Any]:
    want = c.expect if GPU or not c.cpu_expect else c.cpu_expect
    ok = row["verdict"] == want
    if GPU and c.code:
        ok = ok and row["cuda_error"].endswith(str(c.code))
    if GPU and c.check == "poisoned":
        ok = ok and row["poisoned"]
    if GPU and c.check == "not_poisoned":
        ok = ok and not row["poisoned"]
    if GPU and c.check == "sanitizer":
        ok = ok and row["sanitizer_saw_oob"]
    if GPU and c.check == "metrics":
        ok = ok and row["metrics"].get("gpu__time_duration.sum", 0) > 0
    row["expected"] = want
    row["pass"] = ok
    return row


def run_in_own_process(c: Case, kb: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "row.json"
        cmd = [
            sys.executable,
            __file__,
            "--kernelbench",
            str(kb),
            "--case",
            c.name,
            "--case-out",
            str(out),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if out.exists():
            return dict(json.loads(out.read_text()))
        return {
            "case": c.name,
            "type": c.kind,
            "verdict": f"process exit {proc.returncode}",
            "message": (proc.stdout + proc.stderr)[-600:],
            "poisoned": None,
            "cuda_error": "",
            "notes": [],
        }


# ---------------------------------------------------------------------------------------------
# Timing against do_bench


@dataclass
class TimingCase:
    name: str
    source: str
    shapes: list[list[int]]
    dtype: int = F32
    rows: dict[str, Any] = field(default_factory=dict)


COPY = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x.clone()
"""
MATMUL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a @ b
"""
SOFTMAX = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)
"""


def timing_cases(smoke: bool) -> list[TimingCase]:
    if smoke:
        return [
            TimingCase("copy 64K", COPY, [[1 << 16]]),
            TimingCase("matmul 128", MATMUL, [[128, 128], [128, 128]]),
            TimingCase("softmax 256x1024", SOFTMAX, [[256, 1024]]),
        ]
    out = []
    for n in (1 << 22, 1 << 25, 1 << 28):
        out.append(TimingCase(f"copy {n * 4 >> 20} MiB fp32", COPY, [[n]]))
    for n in (512, 4096, 16384):
        out.append(TimingCase(f"matmul {n} fp16", MATMUL, [[n, n], [n, n]], F16))
    for r, c in ((1024, 1024), (8192, 8192), (32768, 16384)):
        out.append(TimingCase(f"softmax {r}x{c} fp32", SOFTMAX, [[r, c]]))
    return out


def time_case(tc: TimingCase, work: Path, trials: int) -> dict[str, Any]:
    args = [t(f"x{j}", s, tc.dtype) for j, s in enumerate(tc.shapes)]
    s = spec(ksrc(K.KERNEL_TYPE_TORCH, tc.source, args), perf_trial_count=trials, warmup_count=10)
    r = run_job(s, NullReporter(), EngineConfig(work_dir=work)).result
    row: dict[str, Any] = {
        "kernel": tc.name,
        "verdict": job_pb2.Verdict.Name(r.verdict),
        "engine_median_ms": r.runtime.median_ms,
        "engine_min_ms": r.runtime.min_ms,
        "engine_p95_ms": r.runtime.p95_ms,
        "source": job_pb2.TimingSource.Name(r.runtime.source),
        "notes": list(r.notes),
    }
    if GPU:
        import triton.testing

        ns: dict[str, Any] = {}
        exec(tc.source, ns)
        model = ns["Model"]().cuda()
        dt = torch.float16 if tc.dtype == F16 else torch.float32
        inputs = [torch.randn(*sh, device="cuda", dtype=dt) for sh in tc.shapes]
        ref = triton.testing.do_bench(lambda: model(*inputs), return_mode="median")
        row["do_bench_median_ms"] = ref
        row["ratio"] = r.runtime.median_ms / ref if ref else None
        row["within_3pct"] = row["ratio"] is not None and abs(row["ratio"] - 1) <= 0.03
        del inputs, model
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------
# Report


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v if v is not None else "").replace("|", "/").replace("\n", " ")[:90]

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def device_line() -> str:
    from kerneleval_server.engine.device import device_info

    d = device_info()
    return (
        f"{d.name} (cc {d.compute_capability or '-'}, driver {d.driver_version or '-'}, "
        f"CUDA {d.cuda_version or '-'}), torch {d.torch_version}, triton {d.triton_version}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--kernelbench", default=str(ROOT.parent / "shared" / "kernelbench"))
    p.add_argument("--cpu-smoke", action="store_true", help="no GPU: skip the GPU-only parts")
    p.add_argument("--skip-tools", action="store_true", help="skip compute-sanitizer and ncu")
    p.add_argument("--trials", type=int, default=200, help="timed trials per timing kernel")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--case-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    kb = Path(a.kernelbench)
    work = Path(tempfile.mkdtemp(prefix="ke_engine_check_"))

    if a.case:  # a child running one case that may kill its CUDA context
        c = next(c for c in cases(kb) if c.name == a.case)
        row = judge(c, run_case(c, work))
        Path(a.case_out).write_text(json.dumps(row))
        sys.stdout.flush()
        os._exit(0)

    if not GPU and not a.cpu_smoke:
        print("no CUDA GPU: use --cpu-smoke", file=sys.stderr)
        return 2
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    own: list[Case] = []
    for c in cases(kb):
        if c.gpu_only and not GPU:
            continue
        if a.skip_tools and c.check in ("sanitizer", "metrics"):
            continue
        if c.own_process:
            own.append(c)
            continue
        print(f"... {c.name}", flush=True)
        rows.append(judge(c, run_case(c, work)))

    timings = []
    for tc in timing_cases(a.cpu_smoke or not GPU):
        print(f"... timing {tc.name}", flush=True)
        timings.append(time_case(tc, work, 20 if a.cpu_smoke else a.trials))

    for c in own:  # last, each in a fresh process: these kill the CUDA context
        print(f"... {c.name} (own process)", flush=True)
        row = run_in_own_process(c, kb)
        row.setdefault("pass", False)
        rows.append(row)

    elapsed = time.perf_counter() - started
    result = {
        "device": device_line(),
        "seconds": round(elapsed, 1),
        "cases": rows,
        "timing": timings,
    }
    (out_dir / "engine_check.json").write_text(json.dumps(result, indent=2))
    case_cols = [
        "case",
        "type",
        "verdict",
        "expected",
        "pass",
        "cuda_error",
        "poisoned",
        "median_ms",
        "seconds",
        "message",
    ]
    timing_cols = [
        "kernel",
        "engine_median_ms",
        "do_bench_median_ms",
        "ratio",
        "within_3pct",
        "engine_p95_ms",
        "source",
    ]
    md = (
        f"# Engine check\n\n{result['device']}; {elapsed:.0f} s.\n\n## Cases\n\n"
        f"{table(rows, case_cols)}\n\n## Timing: engine median vs triton.testing.do_bench\n\n"
        f"{table(timings, timing_cols)}\n"
    )
    (out_dir / "engine_check.md").write_text(md)
    print(md)
    failed = [r["case"] for r in rows if not r.get("pass")]
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
