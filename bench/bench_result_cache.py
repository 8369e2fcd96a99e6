"""RunBatch with repeated jobs: evaluations per second with the result cache, and without.

Issue 16's number: a RunBatch of 600 jobs of which 30% repeat an earlier job of the batch runs
at >= 1.4x the evaluations per second with the result cache as with every job run (with 30%
repeats the ideal is 1 / 0.7 = 1.43x: a repeat should cost nothing).

The batch (--jobs, --repeat-fraction): distinct jobs, each a PyTorch `ModelNew` `relu(x @ w)`
over --size x --size float32 matrices against the eager `Model` (a source of its own per
distinct job: a comment with its number), --correct-trials correctness trials, --warmup-count
warm-ups and --perf-trials timed trials: cheap, but real work (a job process, a check and a
timing run), so that the jobs and not the client bound the batch. Repeats are exact copies of
an earlier job of the batch (the same JobSpec), spread evenly through the list (3 of every 10
at 30%, never at the end), each of a job drawn at random (--seed) among those before it: one
whose original is still in flight shares its run, a later one takes the cached result; both
count.

Two arms, in one run, each against a service of its own started in a fresh state folder (the
second inherits nothing of the first: no cached result, no compiled kernel), each after
--warmup-jobs Evaluate calls of jobs not in the batch:
  - baseline: every job with EvalOptions.bypass_cache = true (each runs);
  - cache: the same batch as it is (the service's default: the result cache on).
Reports evaluations per second of each, the ratio cache / baseline, and how many results came
back with Job.result_origin RESULT_ORIGIN_CACHE and RESULT_ORIGIN_SHARED_RUN. Repeats must
get the same verdict as their originals. --rounds N runs both arms N times, alternating which
goes first, and reports the median ratio; each arm states the host's load average around its
batch (a shared host's other work shows there).

    PYTHONPATH=server:clients/python/src python3 bench/bench_result_cache.py --out DIR
    ... --jobs 60         # a quick check

Results: <out>/bench_result_cache.json and .md.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

MODEL = """import torch


class Model(torch.nn.Module):
    def forward(self, x, w):
        return torch.relu(x @ w)


def get_inputs():
    return [torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)]


def get_init_inputs():
    return []
"""
TARGET = 1.4
ARM_LABELS = {
    "baseline": "every job runs (bypass_cache)",
    "cache": "result cache on (default)",
}
ORIGINS = ("RESULT_ORIGIN_RUN", "RESULT_ORIGIN_CACHE", "RESULT_ORIGIN_SHARED_RUN")


def job_plan(count: int, repeat_fraction: float, seed: int = 16) -> list[int]:
    """For each slot of the batch, the number of the distinct job it runs. round(count *
    repeat_fraction) slots are repeats, spread evenly (slot i is one when (i + 1) * r // count
    passes a multiple; slot 0 never is), each naming a distinct job drawn at random among those
    before it; the others are new jobs, numbered 0, 1, ... in order."""
    repeats = round(count * repeat_fraction)
    if not 0 <= repeats < count:
        raise ValueError(f"repeat fraction {repeat_fraction} of {count} jobs leaves none to run")
    rng = random.Random(seed)
    plan: list[int] = []
    distinct = 0
    for i in range(count):
        if (i + 1) * repeats // count > i * repeats // count:
            plan.append(rng.randrange(distinct))
        else:
            plan.append(distinct)
            distinct += 1
    return plan


def job_spec(number: int, size: int, correct: int, warmup: int, perf: int) -> kernel_pb2.JobSpec:
    """Distinct job `number`: its own candidate source, the same reference and options."""
    spec = kernel_pb2.JobSpec(client_tag="bench-result-cache")
    ref = MODEL.replace("SIZE", str(size))
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = (
        ref.replace("class Model(", "class ModelNew(") + f"\n# candidate {number}\n"
    )
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.reference.source_code = ref
    o = spec.options
    o.correct_trial_count, o.warmup_count, o.perf_trial_count = correct, warmup, perf
    o.timeout.seconds = 300
    return spec


def batch(
    plan: list[int], args: argparse.Namespace, *, bypass: bool, offset: int = 0
) -> list[kernel_pb2.JobSpec]:
    """The batch's JobSpecs in plan order: a repeat is an exact copy of its original."""
    specs: dict[int, kernel_pb2.JobSpec] = {}
    out = []
    for number in plan:
        if number not in specs:
            s = job_spec(offset + number, args.size, args.correct_trials, args.warmup_count,
                         args.perf_trials)  # fmt: skip
            s.options.bypass_cache = bypass
            specs[number] = s
        copy = kernel_pb2.JobSpec()
        copy.CopyFrom(specs[number])
        out.append(copy)
    return out


def arm_order(round_index: int) -> tuple[str, str]:
    """Baseline first in even rounds, the cache arm first in odd ones."""
    return ("baseline", "cache") if round_index % 2 == 0 else ("cache", "baseline")


def origin_counts(jobs: list[job_pb2.Job]) -> dict[str, int]:
    out: dict[str, int] = {}
    for j in jobs:
        name = job_pb2.ResultOrigin.Name(j.result_origin)
        out[name] = out.get(name, 0) + 1
    return out


def repeat_mismatches(plan: Sequence[int], verdicts: Sequence[int | None]) -> int:
    """Slots whose verdict differs from the first slot of the same distinct job's."""
    first: dict[int, int | None] = {}
    bad = 0
    for number, verdict in zip(plan, verdicts, strict=True):
        if number in first:
            bad += verdict != first[number]
        else:
            first[number] = verdict
    return bad


def run_arm(args: argparse.Namespace, plan: list[int], *, bypass: bool) -> dict[str, Any]:
    flags = ["--workers-per-device", str(args.workers_per_device)]
    svc = C.Service(flags, nvml="none", result_cache=True).start()  # a fresh state each time
    try:
        svc.wait_workers(args.workers_per_device)
        with svc.client() as c:  # warm-up: jobs of their own, not in the batch
            for spec in batch(list(range(args.warmup_jobs)), args, bypass=True, offset=10**6):
                c.evaluate(spec)
        specs = batch(plan, args, bypass=bypass)
        results: dict[int, job_pb2.Job] = {}
        refused = 0
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        with svc.client() as c:
            for be in c.run_batch(specs, max_in_flight=args.in_flight):
                if be.error is not None:
                    refused += 1
                    print("refused:", be.error.message, flush=True)
                elif be.event is not None and be.event.HasField("finished"):
                    results[int(be.request_tag)] = be.event.finished
                if len(results) + refused >= len(specs):
                    break
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()[0]
    finally:
        svc.stop()
    jobs = [results[i] for i in sorted(results)]
    verdicts = [results[i].result.verdict if i in results else None for i in range(len(specs))]
    ok = sum(1 for j in jobs if j.result.verdict == job_pb2.VERDICT_OK)
    return {
        "bypass_cache": bypass, "jobs": len(specs), "finished": len(jobs), "ok": ok,
        "refused": refused, "wall_s": wall, "evals_per_s": len(jobs) / wall if wall else 0.0,
        "result_origins": origin_counts(jobs),
        "repeat_verdict_mismatches": repeat_mismatches(plan, verdicts),
        "load_avg_1min": [load_before, load_after], "service_root": str(svc.root),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap, smoke=False)
    ap.add_argument("--jobs", type=int, default=600, help="jobs in the batch (600)")
    ap.add_argument("--repeat-fraction", type=float, default=0.3, help="repeats (0.3)")
    ap.add_argument("--seed", type=int, default=16, help="which earlier job each repeat is")
    ap.add_argument("--size", type=int, default=256, help="matrix side (256)")
    ap.add_argument("--correct-trials", type=int, default=2)
    ap.add_argument("--warmup-count", type=int, default=3)
    ap.add_argument("--perf-trials", type=int, default=20)
    ap.add_argument("--in-flight", type=int, default=16, help="RunBatch max in flight (16)")
    ap.add_argument("--workers-per-device", type=int, default=1, help="the service's (1)")
    ap.add_argument("--warmup-jobs", type=int, default=3, help="Evaluates before each arm (3)")
    ap.add_argument(
        "--rounds", type=int, default=1, help="both arms, in alternating order, this many times"
    )
    args = ap.parse_args()
    info = C.machine_info()
    plan = job_plan(args.jobs, args.repeat_fraction, args.seed)
    repeats = len(plan) - len(set(plan))
    data: dict[str, Any] = {
        "jobs": args.jobs, "repeats": repeats, "distinct": len(set(plan)),
        "repeat_fraction": args.repeat_fraction, "seed": args.seed, "size": args.size,
        "correct_trials": args.correct_trials, "warmup_count": args.warmup_count,
        "perf_trials": args.perf_trials, "in_flight": args.in_flight,
        "workers_per_device": args.workers_per_device, "engine": "CPU", "rounds": [],
    }  # fmt: skip
    for r in range(args.rounds):
        got: dict[str, Any] = {}
        for name in arm_order(r):
            got[name] = run_arm(args, plan, bypass=name == "baseline")
            print(f"round {r + 1}, {name}: {got[name]['evals_per_s']:.2f} evals/s", flush=True)
        got["ratio"] = C.ratio(got["cache"]["evals_per_s"], got["baseline"]["evals_per_s"])
        data["rounds"].append(got)
    rounds = data["rounds"]
    data["ratio"] = statistics.median(g["ratio"] for g in rounds)
    data["ideal_ratio"] = C.ratio(args.jobs, args.jobs - repeats)
    data["target"] = TARGET
    rows = []
    for r, got in enumerate(rounds):
        for name in arm_order(r):
            a = got[name]
            o = a["result_origins"]
            rows.append(
                [r + 1, ARM_LABELS[name], a["finished"], a["ok"], a["wall_s"], a["evals_per_s"],
                 *(o.get(k, 0) for k in ORIGINS), o.get("RESULT_ORIGIN_UNSPECIFIED", 0),
                 "/".join(f"{x:.1f}" for x in a["load_avg_1min"]),
                 C.ratio(a["evals_per_s"], got["baseline"]["evals_per_s"])]
            )  # fmt: skip
    verdict = "meets" if data["ratio"] >= TARGET else "misses"
    per_round = ", ".join(f"{g['ratio']:.2f}" for g in rounds)
    mismatches = sum(g[n]["repeat_verdict_mismatches"] for g in rounds for n in ARM_LABELS)
    notes = [
        f"Batch: {args.jobs} jobs, {repeats} of them exact repeats of an earlier job "
        f"({len(set(plan))} distinct), spread evenly through the list; each a PyTorch ModelNew "
        f"relu(x @ w) over {args.size}x{args.size} float32 against the eager Model, "
        f"{args.correct_trials} correctness trials, {args.warmup_count} warm-ups, "
        f"{args.perf_trials} timed trials; RunBatch with {args.in_flight} in flight; CPU "
        f"engine, {args.workers_per_device} job(s) at once.",
        "Each arm on a service of its own in a fresh state folder, after "
        f"{args.warmup_jobs} Evaluates of jobs not in the batch; rounds alternate which arm "
        "goes first.",
        f"cache / baseline: {data['ratio']:.2f}x (median over {len(rounds)} round(s): "
        f"{per_round}; {verdict} the issue's >= {TARGET}x; ideal with these repeats "
        f"{data['ideal_ratio']:.2f}x).",
        "Origins: RUN ran, CACHE took an earlier finished job's result, SHARED_RUN waited for "
        "an identical job in flight; unspecified is a service that does not say. Load: the "
        "host's 1-minute load average before/after the batch (other work on the host shows "
        "there).",
        f"Repeats whose verdict differed from their original's: {mismatches}.",
    ]
    C.write_results(
        args.out, "bench_result_cache", "RunBatch with repeated jobs: result cache vs none",
        info, data,
        [("Throughput", ["round", "arm", "finished", "OK", "wall s", "evals/s", "RUN", "CACHE",
                         "SHARED_RUN", "unspecified", "load", "x baseline"], rows)],
        notes,
    )  # fmt: skip
    good = all(
        g[n]["ok"] == args.jobs and g[n]["repeat_verdict_mismatches"] == 0
        for g in rounds
        for n in ARM_LABELS
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
