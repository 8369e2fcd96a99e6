"""What the engine's tamper defences cost a job on the warm path (issue 13: "Evaluate's warm path
no more than 2 ms slower than without it").

A job process arms engine/tamper.py before any job code runs: an audit hook that refuses the
ways to reach the engine's timing (and is asked about every audited event the job causes
from then on), and a snapshot of every name the timing relies on, compared after the timed
trials (`check_timers`). `prepare()` takes the snapshot as the process starts, before it says
it is ready, so only the hook's calls and the comparison are on a job's path.

Here the same jobs run through `engine.run_job` in two kinds of fresh child process, one
armed as a job process is, one never armed, alternating for --rounds rounds (each child warms
up first, then runs --jobs jobs of each kind). Per kind: the median job wall time of each arm
and their difference. Also the defences' own steps, timed alone in an armed process:
`prepare()` (off the job path), `arm()` after it, and one `check_timers()`.
Kinds: a tiny Triton `ModelNew` against its eager reference with no timing (the latency
path) and with 20 timed trials, and a PyTorch `ModelNew` (`relu(x @ w)`) against its `Model`.

    PYTHONPATH=server:clients/python/src python3 bench/bench_hardening.py --out DIR
    ... --cpu-smoke       # here: CPU, Triton interpreter, few jobs

Results: <out>/bench_hardening.json and .md (bench_hardening_smoke.* with --cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

NAME = "bench_hardening"
ARMS = ("armed", "unarmed")

TORCH_MODEL = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(SIZE, SIZE) / SIZE ** 0.5)

    def forward(self, x):
        return torch.relu(x @ self.w)

def get_inputs():
    return [torch.randn(SIZE, SIZE)]

def get_init_inputs():
    return []
"""
TORCH_MODEL_NEW = TORCH_MODEL.replace("class Model(", "class ModelNew(")


def specs(smoke: bool) -> dict[str, kernel_pb2.JobSpec]:
    n, size = (4096, 64) if smoke else (1 << 20, 256)
    out: dict[str, kernel_pb2.JobSpec] = {}
    out["triton ModelNew, no timing"] = K.triton_add_spec(n)
    out["triton ModelNew, no timing"].options.CopyFrom(K.options(correct=1, perf=0))
    out["triton ModelNew, 20 timed trials"] = K.triton_add_spec(n)
    out["triton ModelNew, 20 timed trials"].options.CopyFrom(K.options(correct=1, perf=20))
    torch_job = K.torch_spec(TORCH_MODEL_NEW.replace("SIZE", str(size)), "bench-hardening")
    torch_job.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    torch_job.reference.source_code = TORCH_MODEL.replace("SIZE", str(size))
    torch_job.options.CopyFrom(K.options(correct=1, perf=20))
    out["torch ModelNew, 20 timed trials"] = torch_job
    return out


# ---- the child: one arm, every kind ---------------------------------------------------------


def child(arm: str, jobs: int, warmup: int, smoke: bool) -> dict[str, Any]:
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job, tamper

    steps: dict[str, float] = {}
    if arm == "armed":  # as a job process does: prepare() as it starts, arm() before job code
        t0 = time.perf_counter()
        tamper.prepare()
        steps["prepare() (as the process starts) ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        tamper.arm()
        steps["arm() after prepare() ms"] = (time.perf_counter() - t0) * 1e3
    work = Path(tempfile.mkdtemp(prefix="kerneleval-bench-hardening-"))
    config = EngineConfig(work_dir=work)
    times: dict[str, list[float]] = {}
    verdicts: dict[str, list[str]] = {}
    for kind, spec in specs(smoke).items():
        for i in range(warmup + jobs):
            t0 = time.perf_counter()
            outcome = run_job(spec, NullReporter(), config)
            ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.setdefault(kind, []).append(ms)
                verdicts.setdefault(kind, []).append(job_pb2.Verdict.Name(outcome.result.verdict))
    if arm == "armed":
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            changed = tamper.check_timers()
        steps["check_timers() ms"] = (time.perf_counter() - t0) * 1e3 / n
        steps["check_timers() found changes"] = float(len(changed))
    return {"arm": arm, "times": times, "verdicts": verdicts, "steps": steps}


# ---- the parent: alternating arms -----------------------------------------------------------


def run_child(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", arm, "--jobs", str(args.jobs),
           "--warmup", str(args.warmup)] + (["--cpu-smoke"] if args.cpu_smoke else [])  # fmt: skip
    env = C.child_env({"TRITON_INTERPRET": "1"} if args.cpu_smoke else {})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--rounds", type=int, default=0, help="child pairs (default 3; smoke 1)")
    ap.add_argument(
        "--jobs", type=int, default=0, help="jobs per kind a child (default 40; smoke 4)"
    )
    ap.add_argument("--warmup", type=int, default=3, help="jobs per kind a child runs first")
    ap.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    ap.add_argument("--child-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.cpu_smoke
    args.rounds = args.rounds or (1 if smoke else 3)
    args.jobs = args.jobs or (4 if smoke else 40)
    if args.child:
        print(json.dumps(child(args.child, args.jobs, args.warmup, smoke)))
        return 0
    if args.out == str(C.DEFAULT_OUT):
        args.out = str(C.DEFAULT_OUT / ("cpu" if smoke else "gpu"))

    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):  # alternate which arm goes first
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            runs.append(run_child(arm, args))
            print(f"round {r + 1}: {arm} done", flush=True)

    kinds = list(specs(smoke))
    rows, problems = [], []
    for kind in kinds:
        per = {a: [t for x in runs if x["arm"] == a for t in x["times"][kind]] for a in ARMS}
        medians = {a: statistics.median(per[a]) for a in ARMS}
        # Per round pair: the armed median minus the unarmed one (the machine's drift cancels).
        deltas = []
        for r in range(args.rounds):
            pair = {x["arm"]: statistics.median(x["times"][kind]) for x in runs[2 * r : 2 * r + 2]}
            deltas.append(pair["armed"] - pair["unarmed"])
        verdicts = {v for x in runs for v in x["verdicts"][kind]}
        if verdicts != {"VERDICT_OK"}:
            problems.append(f"{kind}: verdicts {sorted(verdicts)}")
        rows.append([kind, medians["armed"], medians["unarmed"], statistics.median(deltas),
                     C.ratio(medians["armed"], medians["unarmed"]), len(per["armed"])])  # fmt: skip
    step_rows = []
    for step in runs[0]["steps"] if runs[0]["arm"] == "armed" else runs[1]["steps"]:
        values = [x["steps"][step] for x in runs if x["arm"] == "armed"]
        step_rows.append([step, statistics.median(values)])
    info = C.machine_info()
    C.write_results(
        args.out, NAME + ("_smoke" if smoke else ""),
        "The tamper defences on a job's warm path: armed vs never armed (engine.run_job)",
        info,
        {"runs": runs, "rounds": args.rounds, "jobs": args.jobs, "problems": problems},
        [("job wall time, ms (median over every job of every round)",
          ["kind", "armed", "unarmed", "armed - unarmed (median of rounds)", "ratio", "jobs"],
          rows),
         ("the defences' own steps, in an armed process", ["step", "median"], step_rows)],
        notes=[f"{args.rounds} rounds of one armed and one unarmed child (alternating which goes "
               f"first), {args.jobs} jobs a kind each after {args.warmup} warm-up jobs",
               *problems],
    )  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
