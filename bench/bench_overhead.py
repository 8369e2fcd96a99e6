"""End-to-end latency of Evaluate on a tiny kernel, against a process per evaluation.

A Triton `a + b` is compared with its eager reference, through the real service (sequential
Evaluate calls over gRPC, one GPU, one job at a time), in two forms: launched from its
IOContract (`triton_io`) and as a `ModelNew` (`modelnew`); and launched from its IOContract
compared with a raw CUDA reference (`triton_io_built`: no host code, so built ahead once and
run by a reused launch process), with perf_trial_count=0 (the
service's overhead alone) and with a small timing run (perf_trial_count=20). Every job runs in
a job process of its own that exits after it; calls are paced (--pace-s) so that a warm job
process is waiting when each call arrives, and one back-to-back series shows what the pool's
refill costs when it is not. Baselines, in the same run, do the same evaluation (import,
build, check, optionally time):
  (a) a fresh Python process per evaluation (import torch, CUDA context, run): what isolation
      fixes do today;
  (b) a child forked per evaluation from a parent that has imported torch (no CUDA in it).

    PYTHONPATH=server:clients/python/src python3 bench/bench_overhead.py --out DIR
    ... --cpu-smoke       # here: CPU, Triton interpreter, few samples

Results: <out>/bench_overhead.json and .md.
"""

from __future__ import annotations

import argparse
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
import _segments as S  # noqa: E402
from _baseline import parse_output  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402

BASELINE = Path(__file__).resolve().parent / "_baseline.py"


SPECS = {
    "triton_io": K.triton_add_io_spec,
    "triton_io_built": K.triton_add_io_built_spec,
    "modelnew": K.triton_add_spec,
}


def breakdown(c: Any, job: job_pb2.Job, client_done: float) -> dict[str, float]:
    """Seconds of each segment of one job, from its persisted events' timestamps."""
    return S.breakdown(c.watch(job.job_id), C.ts(job.create_time), client_done)


SENT = "client sent -> accepted"  # create_time less the client's clock at the send


def service_latencies(
    svc: C.Service, kind: str, n: int, count: int, perf: int, warmup_calls: int, pace_s: float
) -> tuple[list[float], int, list[dict[str, float]]]:
    """Wall seconds per Evaluate, how many came back OK, and where each call's time went
    (its segments, `SENT`, and "wall")."""
    spec = SPECS[kind](n)
    spec.options.CopyFrom(K.options(correct=1, perf=perf, warmup=3 if perf else 0))
    walls: list[float] = []
    ok = 0
    timed: list[tuple[job_pb2.Job, float, float, float]] = []
    with svc.client() as c:
        for i in range(warmup_calls + count):
            time.sleep(pace_s)  # the pool refills: a warm job process waits for this call
            sent = time.time()
            t = time.perf_counter()
            job = c.evaluate(spec)
            wall = time.perf_counter() - t
            if i < warmup_calls:
                continue
            walls.append(wall)
            timed.append((job, sent, time.time(), wall))
            ok += job.result.verdict == job_pb2.VERDICT_OK
            if job.result.verdict != job_pb2.VERDICT_OK and ok == 0 and len(walls) == 1:
                print("first Evaluate not OK:", job.result, flush=True)
        calls = []
        for job, sent, done, wall in timed:  # after the calls: reading events does not slow them
            parts = breakdown(c, job, done)
            parts[SENT] = C.ts(job.create_time) - sent
            calls.append({"wall": wall, **parts})
    return walls, ok, calls


def transport_floor(svc: C.Service, job_id: str, n: int, pace_s: float) -> list[float]:
    """Wall seconds of GetJob (a finished job: one store read, no job process), paced like the
    Evaluate calls: what gRPC and the front end's loop cost a call that waits for nothing.
    After an idle pause it is far slower than back to back (the host's threads wake)."""
    walls: list[float] = []
    with svc.client() as c:
        for i in range(n + 3):
            time.sleep(pace_s)
            t = time.perf_counter()
            c.get_job(job_id)
            if i >= 3:
                walls.append(time.perf_counter() - t)
    return walls


def slowest(calls: list[dict[str, float]], k: int = 3) -> list[dict[str, Any]]:
    """The k slowest calls: each one's wall and the segments longest past their medians."""
    medians = {
        name: statistics.median([c[name] for c in calls if name in c])
        for name in {name for c in calls for name in c}
    }
    out = []
    for call in sorted(calls, key=lambda c: -c["wall"])[:k]:
        over = sorted(
            ((name, call[name] - medians[name]) for name in call if name != "wall"),
            key=lambda item: -item[1],
        )
        out.append({"wall": call["wall"], "over_median": dict(over[:3])})
    return out


def fresh_latencies(kernel: Path, ref: Path, count: int, perf: int) -> tuple[list[float], int]:
    walls: list[float] = []
    ok = 0
    for _ in range(count):
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(BASELINE), "eval", str(kernel), str(ref), "--perf", str(perf)],
            capture_output=True, text=True, env=C.child_env(), timeout=300,
        )  # fmt: skip
        walls.append(time.perf_counter() - t)
        try:
            ok += bool(parse_output(proc.stdout)["ok"])
        except ValueError:
            print("fresh baseline failed:", proc.stderr[-1500:], flush=True)
    return walls, ok


def forked_latencies(kernel: Path, ref: Path, count: int, perf: int) -> tuple[list[float], int]:
    cmd = [sys.executable, str(BASELINE), "fork-server", str(count), str(kernel), str(ref)]
    proc = subprocess.run(
        [*cmd, "--perf", str(perf)],
        capture_output=True, text=True, env=C.child_env(), timeout=600,
    )  # fmt: skip
    try:
        res = parse_output(proc.stdout)
    except ValueError:
        print("fork baseline failed:", proc.stderr[-1500:], flush=True)
        return [], 0
    return list(res["walls_s"]), int(res["ok_count"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--requests", type=int, default=None, help="Evaluate calls per mode (60)")
    ap.add_argument("--pace-s", type=float, default=None, help="pause before a call (0.8)")
    ap.add_argument("--fresh-count", type=int, default=None, help="fresh processes (12)")
    ap.add_argument("--fork-count", type=int, default=None, help="forked children (20)")
    ap.add_argument("--elements", type=int, default=None, help="tensor size (4096)")
    ap.add_argument("--device", default="0", help="GPU index the service uses")
    ap.add_argument(
        "--service-only", action="store_true",
        help="no fresh or forked baselines (comparing two trees of the service)",
    )  # fmt: skip
    ap.add_argument(
        "--perf", default="0,20",
        help="the perf_trial_count settings to measure (0,20; e.g. 0 for the overhead alone)",
    )  # fmt: skip
    C.add_service_flags(ap)
    args = ap.parse_args()
    perfs = [int(p) for p in args.perf.split(",")]
    smoke = args.cpu_smoke
    requests = args.requests or (10 if smoke else 60)
    pace = args.pace_s if args.pace_s is not None else (0.3 if smoke else 0.8)
    fresh = args.fresh_count or (3 if smoke else 12)
    forks = args.fork_count or (5 if smoke else 20)
    n = args.elements or 4096
    info = C.machine_info()

    tmp = Path(tempfile.mkdtemp(prefix="kerneleval-overhead-"))
    kernel, ref = tmp / "kernel.py", tmp / "reference.py"
    kernel.write_text(K.triton_add())
    ref.write_text(K.torch_ref(n))

    flags = [] if smoke else ["--devices", args.device]
    flags += C.service_flags(args)
    svc = C.Service(flags, root=tmp / "svc", nvml="none" if smoke else "real").start()
    rows: list[list[Any]] = []
    data: dict[str, Any] = {"elements": n, "modes": {}, "breakdown": {}, "slowest": {}}
    try:
        svc.wait_workers(1)
        for kind in SPECS:
            for perf in perfs:
                walls, ok, calls = service_latencies(svc, kind, n, requests, perf, 3, pace)
                mode = f"{kind}_perf{perf}"
                data["modes"][mode] = {"ok": ok, **C.summary(walls)}
                data["breakdown"][mode] = {
                    name: C.summary([c[name] for c in calls if name in c])
                    for name in [*S.SEGMENTS, SENT]
                    if any(name in c for c in calls)
                }
                data["slowest"][mode] = slowest(calls)
                print(f"{kind} perf={perf}: {ok}/{len(walls)} OK", flush=True)
        walls, ok, _ = service_latencies(svc, "triton_io", n, requests, 0, 0, 0.0)
        data["modes"]["triton_io_back_to_back"] = {"ok": ok, **C.summary(walls)}
        print(f"back to back: {ok}/{len(walls)} OK", flush=True)
        with svc.client() as c:
            finished = c.list_jobs_page(page_size=1).jobs[0].job_id
        for key, gap in (("floor_paced", pace), ("floor_back_to_back", 0.0)):
            walls = transport_floor(svc, finished, requests, gap)
            data["modes"][key] = {"ok": len(walls), **C.summary(walls)}
    finally:
        svc.stop()
    timed_fresh = max(3, fresh // 4)
    baselines = () if args.service_only else ((0, fresh), (20, timed_fresh))
    for perf, count in baselines:
        walls, ok = fresh_latencies(kernel, ref, count, perf)
        data["modes"][f"fresh_process_perf{perf}"] = {"ok": ok, **C.summary(walls)}
        print(f"fresh perf={perf}: {ok}/{len(walls)} OK", flush=True)
    for perf in () if args.service_only else (0, 20):
        walls, ok = forked_latencies(kernel, ref, forks, perf)
        data["modes"][f"forked_perf{perf}"] = {"ok": ok, **C.summary(walls)}
        print(f"forked perf={perf}: {ok}/{len(walls)} OK", flush=True)

    labels = {
        "triton_io_perf0": "service, Triton from its IOContract, perf_trial_count=0",
        "triton_io_perf20": "service, Triton from its IOContract, perf_trial_count=20",
        "triton_io_built_perf0": "service, built ahead (CUDA reference), perf_trial_count=0",
        "triton_io_built_perf20": "service, built ahead (CUDA reference), perf_trial_count=20",
        "modelnew_perf0": "service, Triton ModelNew, perf_trial_count=0",
        "modelnew_perf20": "service, Triton ModelNew, perf_trial_count=20",
        "triton_io_back_to_back": "service, IOContract, back to back (no pause: pool-bound)",
        "floor_paced": "gRPC floor: GetJob of a finished job, paced as above",
        "floor_back_to_back": "gRPC floor: GetJob of a finished job, back to back",
        "fresh_process_perf0": "(a) fresh process, no timing",
        "fresh_process_perf20": "(a) fresh process, 20 timed runs",
        "forked_perf0": "(b) forked from torch parent, no timing",
        "forked_perf20": "(b) forked from torch parent, 20 timed runs",
    }
    base = data["modes"].get("modelnew_perf0", {}).get("median", 0.0)
    base20 = data["modes"].get("modelnew_perf20", {}).get("median", 0.0)
    for key, label in labels.items():
        if key not in data["modes"]:  # --service-only
            continue
        m = data["modes"][key]
        ref_median = base20 if key.endswith("perf20") else base
        rows.append(
            [label, m["n"], m["ok"], m["median"] * 1e3, m["p99"] * 1e3,
             C.ratio(m["median"], ref_median)]
        )  # fmt: skip
    notes = [
        f"Tiny kernel: Triton a+b over {n} float32 elements, checked against eager a+b "
        "(1 correctness trial); sequential calls, one job at a time on GPU "
        f"{'cpu' if smoke else args.device}, each in a fresh job process from the warm pool; "
        f"{pace} s pause before each call so that a warm process waits for it.",
        "x service = this median / the service's ModelNew median with the same timing setting.",
        "gRPC floor: a call that runs no job, through the same client and front end; paced, it "
        "pays what waking an idle host costs (gRPC's threads, the front end's loop), which "
        "every paced Evaluate above pays too.",
    ]
    if not args.service_only:
        notes.append(
            f"Baselines have fewer samples (fresh processes are slow): {fresh} fresh processes "
            f"without timing, {timed_fresh} with, {forks} forked children per setting."
        )
    if smoke:
        notes.append("CPU smoke run: no GPU, Triton under its interpreter; not a benchmark.")
    modes = list(data["breakdown"])
    parts_rows = [
        [name, *(data["breakdown"][m].get(name, {}).get("median", 0.0) * 1e3 for m in modes)]
        for name in [SENT, *S.SEGMENTS]
    ]
    slow_rows = [
        [mode, f"{call['wall'] * 1e3:.2f}",
         ", ".join(f"{name} +{extra * 1e3:.2f}" for name, extra in call["over_median"].items())]
        for mode, calls in data["slowest"].items()
        for call in calls
    ]  # fmt: skip
    notes.append(
        "Where the time goes: medians of each segment of the service's jobs, from the jobs' "
        "own event timestamps (the rest of the wall time is gRPC and the client)."
    )
    C.write_results(
        args.out, "bench_overhead", "Evaluate overhead vs a process per evaluation", info,
        data,
        [("Latency per evaluation (ms)",
          ["mode", "n", "OK", "median ms", "p99 ms", "x service"], rows),
         ("Where an Evaluate's time goes (median ms)", ["segment", *modes], parts_rows),
         ("The slowest calls: the segments longest past their medians (ms)",
          ["mode", "wall ms", "segments over their median"], slow_rows)],
        notes,
    )  # fmt: skip
    ok_all = all(m["ok"] == m["n"] for m in data["modes"].values())
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
