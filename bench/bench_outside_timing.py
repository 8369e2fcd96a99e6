"""Times bounded from outside the candidate's process (issue 40): what the judge's driven calls
say of honest kernels, and of kernels that lie about their time.

One service, its defaults. Compared through `Compare` with KernelBench's options:
  - honest: each sampled level-1 problem of ../shared/kernelbench against itself (its `Model`
    renamed `ModelNew`): the speedup must read 1.00 at the median, with no flag; per job the
    path's own cost per call (a call of no work), the tolerance, and how far the kernel's own
    clock was from the judge's bound (engine/timed_calls.py, from the result's note);
  - hostile: a clock rewritten in its process (CUDA events' elapsed_time), work left on a side
    stream after it returns, a cache keyed on its input's pointer and version; each must come
    back timed by the bound (flag time_outside_bound) or INCORRECT, never faster than honest.

    PYTHONPATH=server:clients/python/src python3 bench/bench_outside_timing.py --out DIR
    ... --cpu-smoke    # here: the CPU, small problems

Results: <out>/bench_outside_timing.json and .md.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from kerneleval.kernelbench import job_from_sources, kernelbench_options  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402

KERNELBENCH = Path(os.environ.get("KERNELBENCH", C.REPO.parent / "shared" / "kernelbench"))
NOTE = re.compile(
    r"path's own cost ([\d.]+) us a call, the kernel's clock within (-?[\d.]+) us of the "
    r"judge's \(tolerance ([\d.]+) us\)"
)

REFERENCE = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2.0


def get_inputs():
    return [torch.randn(SIZE)]


def get_init_inputs():
    return []
"""

HOSTILE = {
    "honest": """
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2.0
""",
    "events-rewritten": """
import torch

torch.cuda.Event.elapsed_time = lambda self, end: 0.001


class ModelNew(torch.nn.Module):
    def forward(self, x):
        y = x
        for _ in range(20):
            y = torch.relu(y) * 1.0
        return torch.relu(x) * 2.0 + (y - y)
""",
    "side-stream": """
import torch

_side = None


class ModelNew(torch.nn.Module):
    def forward(self, x):
        global _side
        if _side is None:
            _side = torch.cuda.Stream()
        _side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(_side):
            y = x
            for _ in range(20):
                y = torch.relu(y) * 1.0
            out = torch.relu(x) * 2.0 + (y - y)
        return out
""",
    "cache-by-version": """
import torch

_seen = {}


class ModelNew(torch.nn.Module):
    def forward(self, x):
        key = (x.data_ptr(), x._version)
        if key not in _seen:
            y = x
            for _ in range(20):
                y = torch.relu(y) * 1.0
            _seen[key] = torch.relu(x) * 2.0 + (y - y)
        return _seen[key]
""",
}


def honest_pair(problem: Path) -> tuple[str, str]:
    reference = problem.read_text()
    return re.sub(r"\bModel\b", "ModelNew", reference), reference


def note_numbers(result: job_pb2.EvalResult) -> tuple[float, float, float] | None:
    for n in result.notes:
        m = NOTE.search(n)
        if m:
            return float(m.group(1)), float(m.group(2)), float(m.group(3))
    return None


def row(name: str, job: job_pb2.Job) -> dict[str, Any]:
    r = job.result
    numbers = note_numbers(r)
    return {
        "name": name, "verdict": job_pb2.Verdict.Name(r.verdict),
        "speedup": r.speedup, "kernel_ms": r.runtime.median_ms,
        "reference_ms": r.reference_runtime.median_ms,
        "source": job_pb2.TimingSource.Name(r.runtime.source),
        "flags": [f.rule_id for f in r.flags if f.source == job_pb2.FLAG_SOURCE_RUNTIME],
        "path_us": numbers[0] if numbers else None, "gap_us": numbers[1] if numbers else None,
        "tolerance_us": numbers[2] if numbers else None,
        "why": (r.error.message or r.validation_error or job.state_reason)[:200]
        or (f"over torch.compile {r.compiled_speedup:.2f}x (compiled reference "
            f"{r.compiled_reference_runtime.median_ms:.4f} ms)" if r.compiled_speedup else ""),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--every", type=int, default=5, help="every Nth level-1 problem")
    ap.add_argument("--budget-s", type=float, default=150.0, help="honest problems started for")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    info = C.machine_info()
    svc = C.Service([] if smoke else ["--devices", "0"], nvml="none" if smoke else "real").start()
    honest: list[dict[str, Any]] = []
    hostile: list[dict[str, Any]] = []
    try:
        svc.wait_workers(1)
        options = kernelbench_options()
        with svc.client() as c:
            size = "4096" if smoke else "1 << 24"
            for name, source in HOSTILE.items():
                if smoke and name in ("events-rewritten", "side-stream"):
                    continue  # CUDA only
                spec = job_from_sources(source, REFERENCE.replace("SIZE", size), options=options)
                job = c.compare(spec)
                hostile.append(row(name, job))
                print(hostile[-1], flush=True)
                if name == "honest":  # and against torch.compile of the reference (issue 43)
                    spec.options.compile_baseline = True
                    job = c.compare(spec)
                    hostile.append(row("honest, torch.compile baseline", job))
                    print(hostile[-1], job.result.compiled_speedup, flush=True)
            problems = sorted((KERNELBENCH / "level1").glob("*.py"), key=lambda p: p.name)
            began = time.monotonic()
            for problem in problems[:: args.every][: 3 if smoke else None]:
                if time.monotonic() - began > args.budget_s:
                    break
                kernel, reference = honest_pair(problem)
                spec = job_from_sources(kernel, reference, options=options)
                job = c.compare(spec)
                honest.append(row(problem.stem, job))
                print(honest[-1], flush=True)
        log_tail = svc.tail()[-3000:]
    finally:
        svc.stop()
    ok = [h for h in honest if h["verdict"] == "VERDICT_OK" and h["speedup"] > 0]
    speedups = [h["speedup"] for h in ok]
    gaps = [h["gap_us"] for h in ok if h["gap_us"] is not None]
    paths = [h["path_us"] for h in ok if h["path_us"] is not None]
    summary = {
        "honest_ok": f"{len(ok)}/{len(honest)}",
        "speedup_median": statistics.median(speedups) if speedups else None,
        "speedup_p10_p90": (
            [statistics.quantiles(speedups, n=10)[0], statistics.quantiles(speedups, n=10)[-1]]
            if len(speedups) >= 2 else None
        ),
        "flagged_honest": sum(1 for h in honest if h["flags"]),
        "gap_us_median": statistics.median(gaps) if gaps else None,
        "path_us_median": statistics.median(paths) if paths else None,
    }  # fmt: skip
    cols = ["name", "verdict", "speedup", "kernel_ms", "reference_ms", "source", "flags",
            "path_us", "gap_us", "tolerance_us"]  # fmt: skip
    tables = [
        ("candidates that lie about their time, and an honest one",
         cols + ["why"], [[h[k] for k in cols + ["why"]] for h in hostile]),
        ("level-1 problems against themselves (ModelNew = Model)", cols,
         [[h[k] for k in cols] for h in honest]),
    ]  # fmt: skip
    notes = [f"{k}: {v}" for k, v in summary.items()]
    data = {"summary": summary, "honest": honest, "hostile": hostile, "service_log": log_tail}
    C.write_results(args.out, "bench_outside_timing", "Times from outside (issue 40)", info,
                    data, tables, notes)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
