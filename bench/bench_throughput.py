"""Throughput of many small candidates through RunBatch, against one Evaluate at a time.

--count candidates (default 250; each a distinct source, so each compiles) of one --kind:
`io` (half Triton launched from its IOContract with an eager PyTorch reference, half raw CUDA
with a raw CUDA reference), `built` (the same, every reference raw CUDA: no source with host
code, so every job is built ahead by a build process and run by a reused launch process) or
`modelnew` (Triton ModelNews: candidate host code, one job process each) are compared with
a reference (2 correctness trials, 20 timed trials); or, timing-bound, `timed`: one Triton
IOContract kernel against the raw CUDA reference, built once (the compile cache serves every
later job, launched by reused launch processes), 100 timed trials each. They go through one
RunBatch stream with --in-flight jobs outstanding, on one GPU with --workers-per-device
workers (compiles and checks overlap; a timing window has the GPU alone).
Reports evaluations per second and the fraction of wall time each GPU's timing window was
held (grant to release, the service's own count in GetStats.device_occupancy; at most 1).
Baseline in the same run: the first --baseline-count candidates as sequential Evaluate calls
(one job in flight) through the same service. On two GPUs (where present) the batch runs
again with --devices 0,1. --compare-unfrozen runs the one-GPU batch again on a service with
--freeze-during-timing false (other job processes not frozen during a timing window; a switch
for this comparison only) and reports the ratio frozen / not frozen; --compare-warming runs it
again with --freeze-warming false (job processes still warming up run through windows) and
reports that ratio, the pool's start rate and the windows' OpenWindow. Every batch's table
includes the judges' timed phases by part (their results' notes).

    PYTHONPATH=server:clients/python/src python3 bench/bench_throughput.py --out DIR
    ... --cpu-smoke       # here: 20 Triton candidates under the interpreter

Results: <out>/bench_throughput_<kind>_<workers per device>wpd.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
import _segments as S  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402


def candidates(
    count: int, n: int, cuda: bool, kind: str, offset: int = 0
) -> list[kernel_pb2.JobSpec]:
    out = []
    for i in range(offset, offset + count):
        if kind == "timed":  # the same source each time: built once, then launched
            spec = K.triton_add_io_built_spec(n)
            spec.options.CopyFrom(K.options(correct=1, perf=100, warmup=3))
            out.append(spec)
            continue
        if kind in ("io", "built") and cuda and i % 2 == 1:
            spec = K.cuda_add_spec(n, variant=i)
        elif kind == "built":
            spec = K.triton_add_io_built_spec(n, variant=i)
        elif kind == "io":
            spec = K.triton_add_io_spec(n, variant=i)
        else:
            spec = K.triton_add_spec(n, block=[128, 256, 512, 1024][i % 4], variant=i)
        spec.options.CopyFrom(K.options(correct=2, perf=20, warmup=3))
        out.append(spec)
    return out


def timing_windows(svc: C.Service) -> dict[int, tuple[float, float]]:
    """Per device, seconds the service has held timing windows and seconds one was held or
    asked for (GetStats.device_occupancy)."""
    with svc.client() as c:
        stats = c.get_stats()
    return {
        o.device_index: (
            o.timing_window.ToNanoseconds() / 1e9,
            o.timing_wanted.ToNanoseconds() / 1e9,
        )
        for o in stats.device_occupancy
    }


def window_fraction(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], wall: float
) -> dict[str, float]:
    """The share of the wall time each device's timing window was held: at most 1."""
    return {
        str(d): (s[0] - before.get(d, (0.0, 0.0))[0]) / wall
        for d, s in sorted(after.items())
        if wall
    }


def held_of_wanted(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]]
) -> dict[str, float]:
    """The share of the time timed work was ready (a window held or asked for) that a window
    was held: how little the GPU idled at the gate while timing could go on."""
    out = {}
    for d, (held, wanted) in sorted(after.items()):
        b_held, b_wanted = before.get(d, (0.0, 0.0))
        if wanted - b_wanted > 0:
            out[str(d)] = (held - b_held) / (wanted - b_wanted)
    return out


def window_costs(svc: C.Service) -> dict[str, float]:
    """Medians over the service's timing windows so far, from its log: the OpenWindow and
    CloseWindow round trips (freeze and thaw, GPU conditions read) and the time held; with
    how many were held and for how long in all (a batch's windows are its bound)."""
    values: dict[str, list[float]] = {"open_ms": [], "close_ms": [], "held_ms": []}
    for rec in C.log_records(svc.log):
        if str(rec.get("message", "")).startswith("timing window "):
            for key, got in values.items():
                if key in rec:
                    got.append(float(rec[key]))
    out = {k: statistics.median(v) for k, v in values.items() if v}
    out["count"] = len(values["held_ms"])
    out["held_total_s"] = sum(values["held_ms"]) / 1e3
    return out


def run_batch(svc: C.Service, specs: list[kernel_pb2.JobSpec], in_flight: int) -> dict[str, Any]:
    events: dict[str, list[job_pb2.JobEvent]] = {}
    results: dict[str, job_pb2.Job] = {}
    refused = 0
    windows = timing_windows(svc)
    t0 = time.perf_counter()
    with svc.client() as c:
        for be in c.run_batch(specs, max_in_flight=in_flight):
            if be.error is not None:
                refused += 1
                print("refused:", be.error.message, flush=True)
            elif be.event is not None:
                events.setdefault(be.request_tag, []).append(be.event)
                if be.event.HasField("finished"):
                    results[be.request_tag] = be.event.finished
            if len(results) + refused >= len(specs):
                break
    wall = time.perf_counter() - t0
    after = timing_windows(svc)
    ok = sum(1 for j in results.values() if j.result.verdict == job_pb2.VERDICT_OK)
    return {
        "jobs": len(specs), "finished": len(results), "ok": ok, "refused": refused,
        "wall_s": wall, "evals_per_s": len(results) / wall,
        "timing_window_fraction": window_fraction(windows, after, wall),
        "window_held_of_wanted": held_of_wanted(windows, after),
        "verdicts": _verdicts(results.values()),
        "failures": _failures(results.values()),
        # Where a job's time went under the batch, from the events it streamed.
        "segments_ms": S.medians_ms(
            S.breakdown(events[tag], C.ts(job.create_time)) for tag, job in results.items()
        ),
        # The judges' timed phases by part (their results' notes).
        "window_parts": [S.window_parts(job.result.notes) for job in results.values()],
    }  # fmt: skip


def _failures(jobs: Any, limit: int = 5) -> list[str]:
    """Up to `limit` distinct reasons of jobs that did not end OK, with their devices."""
    seen: dict[str, None] = {}
    for j in jobs:
        r = j.result
        if r.verdict == job_pb2.VERDICT_OK:
            continue
        why = r.error.message or r.fault.description or r.validation_error or j.state_reason
        seen.setdefault(f"GPU {j.device_index}: {why[:300]}", None)
        if len(seen) >= limit:
            break
    return list(seen)


def _verdicts(jobs: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for j in jobs:
        name = job_pb2.Verdict.Name(j.result.verdict)
        out[name] = out.get(name, 0) + 1
    return out


class StartCounter:
    """Counts job processes started (WorkerStartedEvent on WatchEvents) in a thread."""

    def __init__(self, svc: C.Service) -> None:
        self.count = 0
        self._client = svc.client()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for ev in self._client.watch_events():
                if ev.HasField("worker_started"):
                    self.count += 1
        except Exception:  # noqa: BLE001 - closed at the end of the bench
            pass

    def close(self) -> None:
        self._client.close()


def pool_now(svc: C.Service) -> dict[str, float]:
    """The service's job processes alive (warm ones waiting, standing judges, busy ones) and
    the GPUs' memory in use."""
    with svc.client() as c:
        devices = c.list_devices()
    used = sum(d.memory_used_bytes for d in devices)
    return {"processes": sum(1 for d in devices for w in d.workers if w.pid),
            "memory_used_mib": used / 2**20}  # fmt: skip


def pool_memory(svc: C.Service, processes: int, timeout: float = 120.0) -> dict[str, Any]:
    """Device memory in use once `processes` job processes are up (all idle, warm)."""
    deadline = time.monotonic() + timeout
    while pool_now(svc)["processes"] < processes and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2.0)  # the last ones finish their warm-up
    pool = pool_now(svc)
    return pool | {"per_process_mib": pool["memory_used_mib"] / max(pool["processes"], 1)}


def sequential(svc: C.Service, specs: list[kernel_pb2.JobSpec]) -> dict[str, Any]:
    jobs = []
    windows = timing_windows(svc)
    t0 = time.perf_counter()
    with svc.client() as c:
        for spec in specs:
            jobs.append(c.evaluate(spec))
    wall = time.perf_counter() - t0
    ok = sum(1 for j in jobs if j.result.verdict == job_pb2.VERDICT_OK)
    return {"jobs": len(specs), "finished": len(jobs), "ok": ok, "wall_s": wall,
            "evals_per_s": len(jobs) / wall,
            "timing_window_fraction": window_fraction(windows, timing_windows(svc), wall),
            "verdicts": _verdicts(jobs)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--count", type=int, default=None, help="candidates (250; 20 smoke)")
    ap.add_argument("--kind", choices=("io", "built", "modelnew", "timed"), default="io")
    ap.add_argument(
        "--build-processes", type=int, default=None, help="the service's (default: its auto)"
    )
    ap.add_argument(
        "--compare-unfrozen", action="store_true", help="also run with --freeze-during-timing false"
    )
    ap.add_argument(
        "--compare-warming", action="store_true",
        help="also run with --freeze-warming false (warming job processes run through windows)",
    )  # fmt: skip
    ap.add_argument("--spare-count", type=int, default=None, help="warm job processes (wpd)")
    ap.add_argument("--baseline-count", type=int, default=None, help="sequential (60; 6 smoke)")
    ap.add_argument("--in-flight", type=int, default=64)
    C.add_service_flags(ap)
    ap.add_argument("--workers-per-device", type=int, default=None, help="4 (1 smoke)")
    ap.add_argument("--elements", type=int, default=None, help="1M (4096 smoke)")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    count = args.count or (20 if smoke else 250)
    base_count = args.baseline_count or (6 if smoke else 60)
    wpd = args.workers_per_device or (1 if smoke else 4)
    n = args.elements or (4096 if smoke else 1 << 20)
    info = C.machine_info()
    cuda = not smoke
    spares = args.spare_count if args.spare_count is not None else wpd
    wflags = ["--workers-per-device", str(wpd), "--spare-count", str(spares)]
    if args.build_processes is not None:
        wflags += ["--build-processes", str(args.build_processes)]
    wflags += C.service_flags(args)
    data: dict[str, Any] = {
        "count": count, "kind": args.kind, "workers_per_device": wpd, "spare_count": spares,
        "elements": n, "judge_launches": not args.run_whole,
        "reference_time_reuse_s": args.reference_time_reuse_s, "service_args": args.service_arg,
    }  # fmt: skip

    svc = C.Service(wflags + ([] if smoke else ["--devices", "0"]),
                    nvml="none" if smoke else "real").start()  # fmt: skip
    try:
        svc.wait_workers(wpd)
        data["pool"] = pool_memory(svc, wpd + spares)
        # Sequential first, on candidates of their own (no compile cache shared with the batch).
        seq_specs = candidates(base_count, n, cuda, args.kind, offset=100_000)
        data["sequential"] = sequential(svc, seq_specs)
        print(f"sequential: {data['sequential']['evals_per_s']:.2f}/s", flush=True)
        counter = StartCounter(svc)
        t_pool = time.perf_counter()
        data["batch_1gpu"] = run_batch(svc, candidates(count, n, cuda, args.kind), args.in_flight)
        data["pool"]["started_per_s"] = counter.count / (time.perf_counter() - t_pool)
        counter.close()
        data["windows"] = window_costs(svc)
        print(f"batch on one GPU: {data['batch_1gpu']['evals_per_s']:.2f}/s", flush=True)
    finally:
        svc.stop()
    variants = [  # the one-GPU batch again, on a service with these flags
        ("batch_1gpu_unfrozen", ["--freeze-during-timing", "false"], 300_000, "not frozen")
    ] * args.compare_unfrozen + [
        ("batch_1gpu_warming", ["--freeze-warming", "false"], 400_000, "warming not frozen")
    ] * args.compare_warming  # fmt: skip
    for key, extra, offset, label in variants:
        svc = C.Service(
            wflags + extra + ([] if smoke else ["--devices", "0"]), nvml="none" if smoke else "real"
        ).start()
        try:
            svc.wait_workers(wpd)
            counter = StartCounter(svc)
            t_pool = time.perf_counter()
            data[key] = run_batch(
                svc, candidates(count, n, cuda, args.kind, offset=offset), args.in_flight
            )
            data[key]["started_per_s"] = counter.count / (time.perf_counter() - t_pool)
            counter.close()
            data[key]["windows"] = window_costs(svc)
            print(f"{label}: {data[key]['evals_per_s']:.2f}/s", flush=True)
        finally:
            svc.stop()
    two = info["gpu_count"] >= 2 and not smoke
    if two:
        svc = C.Service(wflags + ["--devices", "0,1"], nvml="real").start()
        try:
            svc.wait_workers(2 * wpd)
            data["batch_2gpu"] = run_batch(
                svc, candidates(count, n, cuda, args.kind, offset=200_000), args.in_flight
            )
        finally:
            svc.stop()

    seq = data["sequential"]
    b1 = data["batch_1gpu"]
    rows: list[list[Any]] = [
        [f"sequential Evaluate, one at a time ({base_count})", seq["finished"], seq["ok"],
         seq["wall_s"], seq["evals_per_s"],
         ", ".join(f"GPU {d}: {f:.2f}" for d, f in seq["timing_window_fraction"].items()), "",
         1.0],
    ]  # fmt: skip
    for key, label in (
        ("batch_1gpu", "RunBatch, one GPU"),
        ("batch_1gpu_unfrozen", "RunBatch, one GPU, others not frozen in a window"),
        ("batch_1gpu_warming", "RunBatch, one GPU, warming job processes not frozen"),
        ("batch_2gpu", "RunBatch, two GPUs"),
    ):
        b = data.get(key)
        if b is None and key in ("batch_1gpu_unfrozen", "batch_1gpu_warming"):
            continue
        if b is None:
            rows.append([label, "not run: one GPU", "", "", "", "", "", ""])
            continue
        fracs = sorted(b["timing_window_fraction"].items())
        frac = ", ".join(f"GPU {d}: {f:.2f}" for d, f in fracs)
        of_wanted = ", ".join(
            f"GPU {d}: {f:.2f}" for d, f in sorted(b["window_held_of_wanted"].items())
        )
        rows.append([f"{label} ({count}, {args.in_flight} in flight)", b["finished"], b["ok"],
                     b["wall_s"], b["evals_per_s"], frac, of_wanted,
                     C.ratio(b["evals_per_s"], seq["evals_per_s"])])  # fmt: skip
    what = {
        "modelnew": "Triton ModelNews",
        "timed": "one Triton kernel from its IOContract (raw CUDA reference: built once)",
        "io": "Triton from the IOContract"
        if smoke
        else "alternating Triton (IOContract, eager PyTorch reference: "
        + ("runs whole" if args.run_whole else "built ahead, launched alone, judged")
        + ") and raw CUDA (raw CUDA reference: built ahead)",
        "built": "alternating Triton (IOContract) and raw CUDA, each with a raw CUDA reference "
        "(no host code: built ahead by build processes, run by reused launch processes)",
    }[args.kind]
    trials = (
        "the same source each time (compiled once), 1 correctness trial, 3 warm-ups, "
        "100 timed trials"
        if args.kind == "timed"
        else "each a distinct source (compiled), 2 correctness trials, 3 warm-ups, 20 timed trials"
    )
    notes = [
        f"Candidates ({args.kind}): {what} `a*1+b` over {n} float32 elements, compared with a "
        f"reference; {trials}.",
        f"Service: {wpd} jobs at once per GPU and {spares} warm job processes waiting; every "
        "job runs in a job process of its own. Pool: job processes started per second during "
        f"the batch {data['pool'].get('started_per_s', 0.0):.2f}; device memory with the pool "
        f"full {data['pool']['memory_used_mib']:.0f} MiB for {data['pool']['processes']} "
        "processes. A timing window has the GPU alone. The baseline is sequential Evaluate "
        f"calls through the same service (fewer candidates: {base_count}); x = evaluations/s "
        "over the baseline's.",
        "Timing window held = the time a job had the GPU to itself (the service's GPU gate, "
        "grant to release, GetStats.device_occupancy) over wall time; at most 1. Held while "
        "wanted = that time over the time a window was held or asked for (timing_wanted): the "
        "share of the time timed work was ready that the GPU spent timing.",
        f"Verdicts: batch {data['batch_1gpu']['verdicts']}, sequential {seq['verdicts']}.",
    ]
    if data.get("windows"):
        w = data["windows"]
        notes.append(
            "Timing windows (medians, from the service's log, both runs): OpenWindow "
            f"{w.get('open_ms', 0):.1f} ms, CloseWindow {w.get('close_ms', 0):.1f} ms, held "
            f"{w.get('held_ms', 0):.1f} ms (grant to release: drain, warm-ups, timed trials); "
            f"{w.get('count', 0)} windows held {w.get('held_total_s', 0):.2f} s in all."
        )
    unfrozen = data.get("batch_1gpu_unfrozen")
    if unfrozen:
        data["frozen_over_unfrozen"] = C.ratio(b1["evals_per_s"], unfrozen["evals_per_s"])
        notes.append(
            "Freezing the GPU's other job processes during each timing window (the default) "
            f"vs not: {data['frozen_over_unfrozen']:.2f}x the evaluations per second (issue 14's "
            "target: >= 0.9)."
        )
    warming = data.get("batch_1gpu_warming")
    if warming:
        w = warming["windows"]
        data["warming_over_frozen"] = C.ratio(warming["evals_per_s"], b1["evals_per_s"])
        notes.append(
            f"Warming job processes left running in windows (--freeze-warming false) vs frozen: "
            f"{data['warming_over_frozen']:.2f}x the evaluations per second; job processes "
            f"started {warming['started_per_s']:.2f}/s against {data['pool']['started_per_s']:.2f}"
            f"; OpenWindow {w.get('open_ms', 0):.1f} ms, held {w.get('held_ms', 0):.1f} ms."
        )
    if smoke:
        notes.append("CPU smoke run: no GPU, Triton under its interpreter; not a benchmark.")
    parts = b1.get("segments_ms", {})
    part_rows = [
        [name, parts[name]["n"], parts[name]["median"], parts[name]["p99"]]
        for name in S.SEGMENTS
        if name in parts
    ]
    notes.append(
        "Where a batch job's time went: each segment from the job's own events (medians and "
        "p99 over the jobs that had it); a launch's check and timing are both in its window."
    )
    C.write_results(
        args.out, f"bench_throughput_{args.kind}_{wpd}wpd",
        f"Throughput of small {args.kind} candidates", info, data,
        [("Throughput", ["mode", "finished", "OK", "wall s", "evals/s", "timing window held",
                         "held while wanted", "x sequential"], rows),
         ("Where a batch job's time went, one GPU (ms)", ["segment", "jobs", "median", "p99"],
          part_rows),
         ("The judges' timed phases, one GPU (ms per timed job; in windows: less the waits)",
          ["part", "jobs", "median", "max"], S.window_rows(b1.get("window_parts", [])))],
        notes,
    )  # fmt: skip
    return 0 if b1["ok"] == count and seq["ok"] == base_count else 1


if __name__ == "__main__":
    sys.exit(main())
