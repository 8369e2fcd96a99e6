"""Timing fidelity: the engine's median against do_bench and Nsight Compute, and its spread.

Kernels from ~5 us to ~20 ms, as eager PyTorch `Model`s: an elementwise `x * 2` at several
sizes, a softmax, fp32 matmuls. For each:
  - engine: kerneleval_server.engine.run_job in this process (CUDA events, L2 flushed,
    --trials timed trials) -> median;
  - do_bench: triton.testing.do_bench(fn, return_mode="median") on the same model and inputs;
  - ncu: `ncu --metrics gpu__time_duration.sum --csv --clock-control none` on a small script
    that launches the forward --ncu-forwards times (per-forward sum of kernel durations;
    caches flushed between kernels by ncu's default --cache-control all).
Then the run-to-run spread: the engine's median of one kernel over --repeats runs (min, max,
coefficient of variation).

    PYTHONPATH=server:clients/python/src python3 bench/bench_timing_fidelity.py --out DIR
    ... --cpu-smoke     # here: CPU timings only (no do_bench, no ncu), tiny sizes

Results: <out>/bench_timing_fidelity.json and .md.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

BASELINE = Path(__file__).resolve().parent / "_baseline.py"

ELEMENTWISE = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0

def get_inputs():
    return [torch.randn(SIZE)]

def get_init_inputs():
    return []
"""

SOFTMAX = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)

def get_inputs():
    return [torch.randn(ROWS, COLS)]

def get_init_inputs():
    return []
"""

MATMUL = """
import torch

class Model(torch.nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)

def get_inputs():
    return [torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)]

def get_init_inputs():
    return []
"""


def kernels(smoke: bool) -> list[tuple[str, str]]:
    if smoke:
        return [
            ("elementwise 2^12", ELEMENTWISE.replace("SIZE", str(1 << 12))),
            ("elementwise 2^16", ELEMENTWISE.replace("SIZE", str(1 << 16))),
            ("softmax 64x1024", SOFTMAX.replace("ROWS", "64").replace("COLS", "1024")),
            ("matmul 128 fp32", MATMUL.replace("SIZE", "128")),
        ]
    out = [(f"elementwise 2^{k}", ELEMENTWISE.replace("SIZE", str(1 << k))) for k in
           (12, 18, 22, 26)]  # fmt: skip
    out.append(("softmax 4096x32768", SOFTMAX.replace("ROWS", "4096").replace("COLS", "32768")))
    out += [(f"matmul {s} fp32", MATMUL.replace("SIZE", str(s))) for s in (4096, 8192)]
    return out


def engine_median(source: str, trials: int, work: Path) -> tuple[float, str]:
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job

    spec = kernel_pb2.JobSpec()
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = source
    spec.options.correct_trial_count = 1
    spec.options.perf_trial_count = trials
    spec.options.warmup_count = 10
    work.mkdir(parents=True, exist_ok=True)
    outcome = run_job(spec, NullReporter(), EngineConfig(work_dir=Path(tempfile.mkdtemp(dir=work))))
    r = outcome.result
    if r.verdict != job_pb2.VERDICT_OK:
        return 0.0, f"{job_pb2.Verdict.Name(r.verdict)}: {r.error.message[:200]}"
    return r.runtime.median_ms, job_pb2.TimingSource.Name(r.runtime.source)


def load_model(source: str, path: Path) -> tuple[Any, list[Any]]:
    import importlib.util

    import torch

    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return mod.Model().to(dev), [x.to(dev) for x in mod.get_inputs()]


def do_bench_median(source: str, path: Path) -> float:
    import torch
    import triton.testing

    model, inputs = load_model(source, path)
    with torch.no_grad():
        value = float(triton.testing.do_bench(lambda: model(*inputs), return_mode="median"))
    return value


# ncu's unit names differ between versions.
_UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3,
          "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}  # fmt: skip


def ncu_median(ncu: str, path: Path, forwards: int) -> tuple[float, str]:
    """Per-forward ms from ncu's gpu__time_duration.sum (sum over the forward's kernels)."""
    cmd = [
        ncu, "--metrics", "gpu__time_duration.sum", "--csv", "--clock-control", "none",
        sys.executable, str(BASELINE), "launch", str(path), "--forwards", str(forwards),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=C.child_env(), timeout=600)
    total, kernels = parse_ncu_csv(proc.stdout)
    if not kernels:
        return 0.0, f"ncu failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-300:]}"
    return total / forwards, f"{kernels} kernel launches in {forwards} forwards"


def parse_ncu_csv(stdout: str) -> tuple[float, int]:
    """(sum of gpu__time_duration.sum in ms, kernel count) from `ncu --csv` output."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith('"')]
    total, kernels = 0.0, 0
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        total += value * _UNITS.get(row.get("Metric Unit", "nsecond"), 1e-6)
        kernels += 1
    return total, kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--trials", type=int, default=100, help="engine timed trials")
    ap.add_argument("--repeats", type=int, default=10, help="engine runs for the spread")
    ap.add_argument("--ncu-forwards", type=int, default=3)
    ap.add_argument("--spread-kernels", default="elementwise 2^22,matmul 4096 fp32")
    ap.add_argument("--no-ncu", action="store_true")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    if smoke:
        args.spread_kernels = "elementwise 2^16"
        args.trials = min(args.trials, 20)
    from kerneleval_server.engine import configure_process_environment

    configure_process_environment()
    import torch

    gpu = torch.cuda.is_available()
    info = C.machine_info()
    ncu = None if (args.no_ncu or not gpu) else shutil.which("ncu")
    if gpu and not ncu and not args.no_ncu:
        for cand in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu"):
            if os.path.exists(cand):
                ncu = cand
    tmp = Path(tempfile.mkdtemp(prefix="kerneleval-fidelity-"))
    rows: list[list[Any]] = []
    data: dict[str, Any] = {"kernels": {}, "spread": {}}
    for i, (name, source) in enumerate(kernels(smoke)):
        path = tmp / f"k{i}.py"
        path.write_text(source)
        t = time.perf_counter()
        eng, src = engine_median(source, args.trials, tmp / "work")
        db = do_bench_median(source, path) if gpu else 0.0
        nc, nc_note = ncu_median(ncu, path, args.ncu_forwards) if ncu else (0.0, "not run")
        data["kernels"][name] = {
            "engine_median_ms": eng, "engine_source": src,
            "do_bench_median_ms": db, "ncu_ms": nc, "ncu_note": nc_note,
        }  # fmt: skip
        rows.append([name, eng, db if gpu else "not run", nc if ncu else "not run",
                     C.ratio(eng, db) if db else "-", C.ratio(eng, nc) if nc else "-"])  # fmt: skip
        print(f"{name}: engine {eng:.4f} ms, do_bench {db:.4f}, ncu {nc:.4f} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)  # fmt: skip
    spread_rows: list[list[Any]] = []
    sources = dict(kernels(smoke))
    for name in [k.strip() for k in args.spread_kernels.split(",") if k.strip()]:
        if name not in sources:
            continue
        medians = [engine_median(sources[name], args.trials, tmp / "work")[0]
                   for _ in range(args.repeats)]  # fmt: skip
        mean = statistics.fmean(medians)
        cv = statistics.pstdev(medians) / mean if mean else 0.0
        data["spread"][name] = {"medians_ms": medians, "cv": cv}
        span = (max(medians) - min(medians)) / mean * 100 if mean else 0.0
        spread_rows.append([name, len(medians), min(medians), max(medians), mean, cv * 100.0, span])
    notes = [
        f"Engine: run_job in-process, {args.trials} timed trials, 10 warm-ups, L2 flushed; "
        "do_bench: triton.testing.do_bench(return_mode='median'); ncu: per-forward sum of "
        "gpu__time_duration.sum with --clock-control none (boost clocks, as the others).",
        "engine/do_bench and engine/ncu near 1.0 mean the engine's number is the kernel's time.",
    ]
    if not ncu:
        notes.append("ncu not run: " + ("no GPU" if not gpu else "ncu not found / --no-ncu"))
    if smoke:
        notes.append("CPU smoke run: CPU wall-clock timings only; not a benchmark.")
    C.write_results(
        args.out, "bench_timing_fidelity", "Timing fidelity: engine vs do_bench vs ncu", info,
        data,
        [("Median per kernel (ms)",
          ["kernel", "engine ms", "do_bench ms", "ncu ms", "engine/do_bench", "engine/ncu"], rows),
         (f"Run-to-run spread of the engine's median ({args.repeats} runs)",
          ["kernel", "runs", "min ms", "max ms", "mean ms", "CV %", "range % of mean"],
          spread_rows)],
        notes,
    )  # fmt: skip
    return 0 if all(v["engine_median_ms"] > 0 for v in data["kernels"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
