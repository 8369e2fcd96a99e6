"""KernelBench level 1 through the service: every problem with Evaluate, the examples with Compare.

Every level-1 `Model` of a KernelBench folder (--kernelbench) goes through Evaluate on one GPU
(--in-flight jobs at a time, 20 timed trials), and the example pairs (examples/model_ex_X.py
with model_new_ex_X.py, and model_ex_add.py with model_new_ex_add_triton.py) through Compare.
Reported per problem: the verdict (OK expected), the end-to-end time (call -> result at the
client) and the job's run time (start -> end), and the engine's median next to the eager
PyTorch median measured the usual way (CUDA events with the L2 flushed, and do_bench) by a
plain script in a separate process, after the service has stopped. A failing problem is
reported, not fatal.

    PYTHONPATH=server:clients/python/src python3 bench/bench_kernelbench.py \
        --kernelbench ../shared/kernelbench --out DIR
    ... --cpu-smoke     # here: a handful of problems with their shapes scaled down

Results: <out>/bench_kernelbench.json and .md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from _baseline import parse_items  # noqa: E402
from kerneleval.kernelbench import job_from_files  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

BASELINE = Path(__file__).resolve().parent / "_baseline.py"
SMOKE_PROBLEMS = ("1_", "19_", "23_", "40_", "100_")
_TOP_SIZE = re.compile(r"^([A-Za-z_]\w*)\s*=\s*([\d\s*+(),]+?)\s*(#.*)?$", re.MULTILINE)


def _cap(value: object, cap: int) -> object:
    if isinstance(value, int):
        return min(value, cap)
    if isinstance(value, tuple):
        return tuple(_cap(v, cap) for v in value)
    return value


def scaled(source: str, cap: int) -> str:
    """Top-level sizes (`N = 2048 * 2`, `shape = (32768,)`) capped at `cap` (CPU smoke)."""

    def sub(m: re.Match[str]) -> str:
        try:
            value = eval(m.group(2), {"__builtins__": {}})  # noqa: S307 - digits and * + ( ) only
        except SyntaxError:
            return m.group(0)
        return f"{m.group(1)} = {_cap(value, cap)!r}"

    return _TOP_SIZE.sub(sub, source)


def problem_key(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else 10**6, path.name)


def options(trials: int, timeout_s: int) -> kernel_pb2.EvalOptions:
    o = kernel_pb2.EvalOptions(correct_trial_count=1, perf_trial_count=trials, warmup_count=3)
    o.timeout.seconds = timeout_s
    return o


def run_all(
    svc: C.Service,
    jobs: list[tuple[str, kernel_pb2.JobSpec, bool]],
    in_flight: int,
    deadline: float,
) -> dict[str, dict[str, Any]]:
    """Runs (name, spec, compare) jobs, `in_flight` at a time, none started after `deadline`
    (time.monotonic()); per-job result rows."""
    out: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    queue = list(jobs)

    def worker() -> None:
        with svc.client(timeout=900) as c:
            while True:
                with lock:
                    if not queue or time.monotonic() > deadline:
                        return
                    name, spec, compare = queue.pop(0)
                t = time.perf_counter()
                row: dict[str, Any] = {}
                try:
                    job = c.compare(spec) if compare else c.evaluate(spec)
                    r = job.result
                    row = {
                        "verdict": job_pb2.Verdict.Name(r.verdict),
                        "run_s": C.ts(job.end_time) - C.ts(job.start_time),
                        "engine_median_ms": r.runtime.median_ms,
                        "reference_median_ms": r.reference_runtime.median_ms,
                        "speedup": r.speedup,
                        "flags": [f.rule_id for f in r.flags],  # integrity flags (issue 13)
                        "notes": [n for n in r.notes if "timed from outside" in n],
                        "message": (r.compilation_error or r.validation_error or r.error.message
                                    or r.fault.description)[:300],
                    }  # fmt: skip
                except Exception as e:  # noqa: BLE001 - reported per problem
                    row = {"verdict": "RPC_ERROR", "message": repr(e)[:300]}
                row["e2e_s"] = time.perf_counter() - t
                with lock:
                    out[name] = row
                print(f"  {name}: {row['verdict']} {row['e2e_s']:.1f} s", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(in_flight)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


_PATH = re.compile(
    r"the path's own cost ([\d.]+) us a call, the kernel's clock within (-?[\d.]+) us of the "
    r"judge's \(tolerance ([\d.]+) us; its calls of no work took ([\d.]+) us, the judge's "
    r"own measure of their work ([\d.]+)"
)


def outside_path(row: dict[str, Any]) -> str:
    """From the outside timing's note: the path's cost, the claims' gap and the tolerance."""
    for note in row.get("notes", []):
        m = _PATH.search(note)
        if m:
            return " / ".join(m.groups()) + (" (capped)" if "took longer" in note else "")
    return "-"


def self_report(
    args: argparse.Namespace, info: dict[str, Any], jobs: list[tuple[str, Any, bool]],
    results: dict[str, dict[str, Any]], eager: dict[str, Any], level_of: dict[str, int],
    service_wall: float,
) -> int:  # fmt: skip
    """--compare-self: per level, the verdicts, speedups and flags of each Model against
    itself, and both of its times over do_bench's (issue 40's fidelity, issue 41's defaults)."""
    rows: list[list[Any]] = []
    per_level: dict[int, dict[str, list[Any]]] = {}
    for name, _spec, _c in jobs:
        if name not in level_of:
            continue
        r = results.get(name, {"verdict": "NOT_RUN (budget)", "e2e_s": 0.0})
        e = eager.get(name, {})
        kernel, ref = r.get("engine_median_ms", 0.0), r.get("reference_median_ms", 0.0)
        db, synced = e.get("do_bench_median_ms", 0.0), e.get("synced_median_ms", 0.0)
        lv = per_level.setdefault(level_of[name], {
            "jobs": [], "ok": [], "flagged": [], "speedup": [], "kernel": [], "ref": [],
            "synced": []})  # fmt: skip
        lv["jobs"].append(name)
        if r["verdict"] == "VERDICT_OK":
            lv["ok"].append(name)
            lv["speedup"].append(r.get("speedup", 0.0))
        if r.get("flags"):
            lv["flagged"].append(f"{name}: {','.join(r['flags'])}")
        if db and kernel:
            lv["kernel"].append(kernel / db)
        if db and ref:
            lv["ref"].append(ref / db)
        if db and synced:
            lv["synced"].append(synced / db)
        rows.append([
            name, r["verdict"].removeprefix("VERDICT_"), r.get("speedup", 0.0), kernel, ref,
            db or "-", C.ratio(kernel, db) if db and kernel else "-",
            C.ratio(ref, db) if db and ref else "-", C.ratio(synced, db) if db and synced else "-",
            ",".join(r.get("flags", [])) or r.get("message", "")[:80], outside_path(r),
        ])  # fmt: skip

    examples = [  # the example pairs (an optimised ModelNew against its Model): flags expected none
        [name, (r := results.get(name, {"verdict": "NOT_RUN"}))["verdict"].removeprefix("VERDICT_"),
         r.get("speedup", 0.0), ",".join(r.get("flags", [])) or r.get("message", "")[:80],
         outside_path(r) if r.get("notes") else "-"]
        for name, _spec, _c in jobs if name not in level_of
    ]  # fmt: skip
    summary = []
    for level, lv in sorted(per_level.items()):
        row: list[Any] = [level, len(lv["jobs"]), len(lv["ok"]), len(lv["flagged"]),
                          C.summary(lv["speedup"])["median"]]  # fmt: skip
        for ratios in (lv["kernel"], lv["ref"], lv["synced"]):
            row += [C.summary(ratios)["median"], C.percentile(ratios, 90)]
        summary.append(row)
    data = {"results": results, "eager": eager, "service_wall_s": service_wall,
            "levels": {str(k): {kk: vv for kk, vv in v.items()} for k, v in per_level.items()}}
    notes = [
        f"Each problem's Model against itself (ModelNew subclasses it, nothing changed), "
        f"through Compare with the service's defaults but {args.trials} timed trials; every "
        f"{args.every} problem(s) of each level; {args.workers_per_device} job processes, "
        f"{args.in_flight} jobs in flight; all jobs took {service_wall:.0f} s.",
        "kernel = the ModelNew's median, timed from outside its process (its judge drives its "
        "calls); reference = the judge's own timing of the Model; do_bench = "
        "triton.testing.do_bench's median of the Model in a plain process after the service "
        "stopped; synced = that process with the L2 flush waited for before each call's start "
        "event (no lead: the launch-bound calls' host pace shows).",
        "flagged: " + ("; ".join(f for lv in per_level.values() for f in lv["flagged"])
                       or "none"),
    ]  # fmt: skip
    C.write_results(
        args.out, "bench_kernelbench_self", "KernelBench: each Model against itself", info, data,
        [("Per level", ["level", "jobs", "OK", "flagged", "speedup median", "kernel/do_bench "
          "median", "p90", "reference/do_bench median", "p90", "synced/do_bench median", "p90"],
          summary),
         ("Per problem", ["problem", "verdict", "speedup", "kernel ms", "reference ms",
                          "do_bench ms", "kernel/do_bench", "reference/do_bench",
                          "synced/do_bench", "flags or message",
                          "path us / gap us / tolerance us / no-work calls us / own us"], rows)]
        + ([("Example pairs", ["pair", "verdict", "speedup", "flags or message",
                               "path us / gap us / tolerance us / no-work calls us / own us"],
             examples)] if examples else []),
        notes,
    )  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--kernelbench", default=str(C.REPO.parent / "shared" / "kernelbench"))
    ap.add_argument("--trials", type=int, default=20, help="timed trials")
    ap.add_argument("--in-flight", type=int, default=2, help="jobs at a time")
    ap.add_argument("--workers-per-device", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="first N level-1 problems (0: all)")
    ap.add_argument("--timeout", type=int, default=120, help="per-job timeout, s")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager baseline")
    ap.add_argument("--no-do-bench", action="store_true", help="eager: CUDA events only")
    ap.add_argument("--budget-s", type=float, default=0, help="start no job after this (0: none)")
    ap.add_argument("--eager-budget-s", type=float, default=600, help="eager baseline limit")
    ap.add_argument("--levels", default="1", help="KernelBench levels, e.g. 1,2,3")
    ap.add_argument("--every", type=int, default=1, help="every Nth problem of each level")
    ap.add_argument("--offset", type=int, default=0, help="with --every: start at this index")
    ap.add_argument(
        "--compare-self", action="store_true",
        help="Compare each problem's Model as its own ModelNew (subclassed, nothing changed): "
        "the verdict (OK expected), the speedup (1.00 expected), flags (none expected), both "
        "times (timed the trusted way: the kernel from outside its process) against do_bench",
    )  # fmt: skip
    ap.add_argument("--no-examples", action="store_true", help="skip the example pairs")
    ap.add_argument(
        "--only", default="", help="comma-separated problem-name prefixes (e.g. 66_,19_ReLU)"
    )
    args = ap.parse_args()
    smoke = args.cpu_smoke
    kb = Path(args.kernelbench)
    if not (kb / "level1").is_dir():
        raise SystemExit(f"no level1/ under {kb}: pass --kernelbench")
    info = C.machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="kerneleval-kb-"))
    levels = [int(x) for x in args.levels.split(",") if x]
    problems = []
    for level in levels:
        found = sorted((kb / f"level{level}").glob("*.py"), key=problem_key)
        if smoke:
            found = [p for p in found if p.name.startswith(SMOKE_PROBLEMS)]
        if args.only:
            found = [p for p in found if p.name.startswith(tuple(args.only.split(",")))]
        found = found[args.offset :: max(1, args.every)]
        if args.limit:
            found = found[: args.limit]
        problems += found
    files: dict[str, Path] = {}
    level_of: dict[str, int] = {}
    jobs: list[tuple[str, kernel_pb2.JobSpec, bool]] = []
    for p in problems:
        level = int(p.parent.name.removeprefix("level"))
        name = p.stem if level == 1 else f"L{level}/{p.stem}"
        (tmp / f"level{level}").mkdir(exist_ok=True)
        f = tmp / f"level{level}" / p.name
        f.write_text(scaled(p.read_text(), 64) if smoke else p.read_text())
        files[name], level_of[name] = f, level
        opts = options(args.trials, args.timeout)
        if args.compare_self:
            new = tmp / f"level{level}" / f"self_{p.name}"
            new.write_text(
                f.read_text() + "\n\nclass ModelNew(Model):  # the reference, unchanged\n"
                "    pass\n"
            )
            spec = job_from_files(new, f, options=opts, client_tag=f"kb-l{level}-self")
        else:
            spec = job_from_files(f, options=opts, client_tag=f"kb-l{level}")
        jobs.append((name, spec, args.compare_self))
    pairs = []
    for new in sorted((kb / "examples").glob("model_new_ex_*.py")):
        stem = new.stem.removeprefix("model_new_ex_")
        ref = kb / "examples" / f"model_ex_{stem}.py"
        if not ref.exists():
            ref = kb / "examples" / f"model_ex_{stem.split('_')[0]}.py"
        if ref.exists():
            pairs.append((new, ref))
    for new, ref in [] if args.no_examples else pairs:
        spec = job_from_files(new, ref, options=options(args.trials, args.timeout),
                              client_tag="kb-examples")  # fmt: skip
        jobs.append((f"example {new.name} vs {ref.name}", spec, True))

    flags = ["--workers-per-device", str(args.workers_per_device)]
    svc = C.Service(flags + ([] if smoke else ["--devices", "0"]),
                    nvml="none" if smoke else "real").start()  # fmt: skip
    t0 = time.perf_counter()
    try:
        svc.wait_workers(args.workers_per_device)
        deadline = time.monotonic() + (args.budget_s or 1e9)
        # Examples first: few, and they are the Compare half of the report.
        ordered = [j for j in jobs if j[2]] + [j for j in jobs if not j[2]]
        results = run_all(svc, ordered, args.in_flight, deadline)
    finally:
        svc.stop()
    service_wall = time.perf_counter() - t0

    eager: dict[str, Any] = {}
    ran = [str(f) for name, f in files.items() if name in results]
    if not args.no_eager and ran:
        cmd = [sys.executable, str(BASELINE), "eager-many", *ran,
               "--trials", str(args.trials)]  # fmt: skip
        if args.no_do_bench:
            cmd.append("--no-do-bench")
        t = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=C.child_env(),
                timeout=args.eager_budget_s,
            )  # fmt: skip
            stdout, stderr = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as late:
            out = late.stdout
            stdout = out.decode() if isinstance(out, bytes) else (out or "")
            stderr = "eager baseline ran out of its budget"
        by_path = {str(f): name for name, f in files.items()}
        eager = {by_path.get(k, Path(k).stem): v for k, v in parse_items(stdout).items()}
        if not eager:
            print("eager baseline failed:", stderr[-1500:], flush=True)
        print(
            f"eager baseline: {len(eager)} problems in {time.perf_counter() - t:.0f} s", flush=True
        )

    if args.compare_self:
        return self_report(args, info, jobs, results, eager, level_of, service_wall)
    rows: list[list[Any]] = []
    for name, _spec, compare in jobs:
        r = results.get(name, {"verdict": "NOT_RUN (budget)", "e2e_s": 0.0})
        e = eager.get(name, {})
        eng = r.get("engine_median_ms", 0.0)
        ev = e.get("events_median_ms", 0.0)
        rows.append([
            name, r["verdict"].removeprefix("VERDICT_"), r["e2e_s"], r.get("run_s", 0.0), eng,
            ev if ev else ("-" if compare else str(e.get("error", "not run"))[:60]),
            e.get("do_bench_median_ms", "-"), C.ratio(eng, ev) if ev else "-",
        ])  # fmt: skip
    l1 = [results.get(p.stem, {}) for p in problems]
    ex = [results.get(n, {}) for n, _s, c in jobs if c]
    l1_ok = sum(1 for r in l1 if r.get("verdict") == "VERDICT_OK")
    l1_ran = sum(1 for r in l1 if r.get("verdict") not in (None, "RPC_ERROR"))
    ex_ok = sum(1 for r in ex if r.get("verdict") == "VERDICT_OK")
    ratios = [
        results[p.stem]["engine_median_ms"] / eager[p.stem]["events_median_ms"]
        for p in problems
        if results.get(p.stem, {}).get("engine_median_ms") and
        eager.get(p.stem, {}).get("events_median_ms")
    ]  # fmt: skip
    med_ratio = C.summary(ratios)["median"]
    data = {"problems": len(problems), "level1_ok": l1_ok, "level1_ran": l1_ran,
            "examples": len(ex), "examples_ok": ex_ok, "service_wall_s": service_wall,
            "results": results, "eager": eager,
            "engine_over_eager_median": med_ratio}  # fmt: skip
    def flagged(rows: list[dict[str, Any]]) -> int:
        return sum(1 for r in rows if r.get("flags"))

    summary_rows = [
        ["level-1 problems (Evaluate)", len(problems), l1_ran, l1_ok, flagged(l1)],
        ["example pairs (Compare)", len(ex), sum(1 for r in ex if r.get("verdict")), ex_ok,
         flagged(ex)],
    ]  # fmt: skip
    notes = [
        f"Service: one GPU, {args.workers_per_device} workers + warm spare, {args.in_flight} jobs "
        f"in flight, {args.trials} timed trials, 3 warm-ups, 1 correctness trial; all jobs "
        f"took {service_wall:.0f} s of wall time.",
        "e2e = Evaluate/Compare call -> result at the client (includes queueing behind the "
        "other job in flight); run = the job's start -> end.",
        "eager = the problem's Model timed by a plain script in a separate process after the "
        "service stopped: CUDA events around each call with the L2 flushed (median of "
        f"{args.trials}), and do_bench median; engine/eager is the median of the ratio: "
        f"{med_ratio:.3f} over {len(ratios)} problems.",
    ]
    if smoke:
        notes.append("CPU smoke run: problems scaled down (top-level ints capped at 64), "
                     "CPU timings; CUDA/Triton examples cannot run on the CPU.")  # fmt: skip
    C.write_results(
        args.out, "bench_kernelbench", "KernelBench level 1 through the service", info, data,
        [("Summary", ["set", "jobs", "ran", "OK", "with integrity flags"], summary_rows),
         ("Per problem", ["problem", "verdict", "e2e s", "run s", "engine ms", "eager ms",
                          "do_bench ms", "engine/eager"], rows)],
        notes,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
