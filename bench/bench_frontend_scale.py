"""The front end under load with no free worker: 10,000 queued jobs and 1,000 Watch streams.

CPU only (no GPU needed). The service runs with one CPU worker and no spare; a first job that
sleeps keeps that worker busy, so every later job stays QUEUED. Then, through real gRPC:
  - 10,000 Submits (32 in flight): latency p50/p99 and the rate;
  - 1,000 concurrent Watch streams on queued jobs (over 10 connections): time from the call
    to the first event (setup latency), held open together, then closed; twice, to show the
    memory comes back;
  - GetJob (random ids) and ListJobs (first page, QUEUED filter, client_tag filter, paging
    through all 10,000 at 1,000 a page) latencies with 10,000 jobs in the store;
  - the front end's RSS (from /proc/<pid>/status) at each step and its peak.

    PYTHONPATH=server:clients/python/src python3 bench/bench_frontend_scale.py --out DIR

Results: <out>/bench_frontend_scale.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import grpc  # noqa: E402
import grpc.aio  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2  # noqa: E402
from kerneleval.v1 import kernel_eval_service_pb2 as pb  # noqa: E402

SLEEPER = """
import time
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        time.sleep(3600)
        return x

def get_inputs():
    return [torch.zeros(4)]

def get_init_inputs():
    return []
"""

TINY = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2

def get_inputs():
    return [torch.randn(16)]

def get_init_inputs():
    return []
"""


class RssSampler:
    """Samples one process's RSS every 50 ms; keeps the peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, C.rss_kib(self.pid))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _spec(source: str, tag: str, timeout_s: int = 600) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag=tag)
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = source
    spec.options.correct_trial_count = 1
    spec.options.perf_trial_count = 0
    spec.options.timeout.seconds = timeout_s
    return spec


async def submit_all(address: str, count: int, in_flight: int) -> tuple[list[str], list[float]]:
    ids: list[str] = [""] * count
    lat: list[float] = [0.0] * count
    next_index = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)

        async def worker() -> None:
            nonlocal next_index
            while next_index < count:
                i = next_index
                next_index += 1
                spec = _spec(TINY, f"scale-{i % 10}")
                t = time.perf_counter()
                resp = await stub.Submit(pb.SubmitRequest(spec=spec), timeout=60)
                lat[i] = time.perf_counter() - t
                ids[i] = resp.job.job_id

        await asyncio.gather(*(worker() for _ in range(in_flight)))
    return ids, lat


async def watch_round(
    address: str, job_ids: list[str], pid: int, connections: int
) -> dict[str, Any]:
    """Open one Watch per job, all at once; wait for each first event; hold; close all."""
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)
    ]
    stubs = [kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch) for ch in channels]
    setup: list[float] = [0.0] * len(job_ids)
    calls: list[Any] = []
    opened = asyncio.Event()
    first_events = 0

    async def one(i: int, job_id: str) -> None:
        nonlocal first_events
        call = stubs[i % connections].Watch(pb.WatchRequest(job_id=job_id))
        calls.append(call)
        t = time.perf_counter()
        try:
            async for _resp in call:
                setup[i] = time.perf_counter() - t
                first_events += 1
                if first_events == len(job_ids):
                    opened.set()
                await opened.wait()
                return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(i, j)) for i, j in enumerate(job_ids)]
    await asyncio.wait_for(opened.wait(), timeout=120)
    all_open_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    rss_open = C.rss_kib(pid)
    for call in calls:
        call.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for ch in channels:
        await ch.close(grace=None)
    await asyncio.sleep(2.0)
    return {
        "streams": len(job_ids),
        "setup_s": C.summary(setup),
        "all_open_s": all_open_s,
        "rss_open_kib": rss_open,
        "rss_after_close_kib": C.rss_kib(pid),
    }


def timed(fn: Any, count: int) -> dict[str, float]:
    lat = []
    for _ in range(count):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return C.summary(lat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap, smoke=False)
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--streams", type=int, default=1_000)
    ap.add_argument("--in-flight", type=int, default=32, help="concurrent Submits")
    ap.add_argument("--connections", type=int, default=10, help="connections for the streams")
    args = ap.parse_args()
    info = C.machine_info()
    flags = [
        "--workers-per-device", "1", "--warm-spare", "false",
        "--max-queue", str(args.jobs + 100), "--shutdown-grace-s", "1", "--log-level", "WARNING",
    ]  # fmt: skip
    svc = C.Service(flags, nvml="none").start()
    data: dict[str, Any] = {"jobs": args.jobs, "streams": args.streams}
    try:
        svc.wait_workers(1)
        pid = svc.pid
        data["rss_start_kib"] = C.rss_kib(pid)
        sampler = RssSampler(pid)
        ch = svc.channel()
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        blocker = stub.Submit(pb.SubmitRequest(spec=_spec(SLEEPER, "scale-blocker"))).job.job_id
        deadline = time.monotonic() + 60
        while stub.GetJob(pb.GetJobRequest(job_id=blocker)).job.state != job_pb2.JOB_STATE_RUNNING:
            if time.monotonic() > deadline:
                raise SystemExit("the blocking job never started")
            time.sleep(0.1)
        data["rss_idle_kib"] = C.rss_kib(pid)
        print(f"worker busy; front end RSS {data['rss_idle_kib']} KiB; submitting...", flush=True)

        t = time.perf_counter()
        ids, lat = asyncio.run(submit_all(svc.address, args.jobs, args.in_flight))
        submit_wall = time.perf_counter() - t
        data["submit_s"] = C.summary(lat)
        data["submit_rate_per_s"] = args.jobs / submit_wall
        data["rss_after_submit_kib"] = C.rss_kib(pid)
        print(f"{args.jobs} submitted in {submit_wall:.1f} s", flush=True)

        rounds = []
        for r in range(2):
            sample = random.Random(r).sample(ids, min(args.streams, len(ids)))
            rounds.append(asyncio.run(watch_round(svc.address, sample, pid, args.connections)))
            print(f"watch round {r + 1}: {rounds[-1]['all_open_s']:.1f} s to open", flush=True)
        data["watch_rounds"] = rounds

        rng = random.Random(7)
        data["getjob_s"] = timed(
            lambda: stub.GetJob(pb.GetJobRequest(job_id=rng.choice(ids))), 1000
        )
        data["listjobs_first_page_s"] = timed(
            lambda: stub.ListJobs(pb.ListJobsRequest(page_size=50)), 200
        )
        data["listjobs_queued_s"] = timed(
            lambda: stub.ListJobs(pb.ListJobsRequest(page_size=50, state=job_pb2.JOB_STATE_QUEUED)),
            200,
        )
        data["listjobs_tag_s"] = timed(
            lambda: stub.ListJobs(pb.ListJobsRequest(page_size=50, client_tag="scale-3")), 200
        )
        pages: list[float] = []
        listed = 0
        req = pb.ListJobsRequest(page_size=1000)
        while True:
            t = time.perf_counter()
            page = stub.ListJobs(req)
            pages.append(time.perf_counter() - t)
            listed += len(page.jobs)
            if not page.next_page_token:
                break
            req.page_token = page.next_page_token
        data["listjobs_page1000_s"] = C.summary(pages)
        data["listed_jobs"] = listed
        queued = stub.ListJobs(pb.ListJobsRequest(page_size=1, state=job_pb2.JOB_STATE_QUEUED))
        data["queued_still"] = bool(queued.jobs)
        sampler.stop()
        data["rss_peak_kib"] = sampler.peak_kib
        data["rss_end_kib"] = C.rss_kib(pid)
        data["service_alive"] = svc.alive()
        ch.close()
    finally:
        svc.stop(timeout=20)

    ms = 1e3
    lat_rows = [
        ["Submit (32 in flight)", data["submit_s"]["n"], data["submit_s"]["median"] * ms,
         data["submit_s"]["p99"] * ms],
        *[[f"Watch setup to first event, round {i + 1} ({r['streams']} concurrent)",
           r["setup_s"]["n"], r["setup_s"]["median"] * ms, r["setup_s"]["p99"] * ms]
          for i, r in enumerate(data["watch_rounds"])],
        ["GetJob (random id)", data["getjob_s"]["n"], data["getjob_s"]["median"] * ms,
         data["getjob_s"]["p99"] * ms],
        ["ListJobs first page (50)", data["listjobs_first_page_s"]["n"],
         data["listjobs_first_page_s"]["median"] * ms, data["listjobs_first_page_s"]["p99"] * ms],
        ["ListJobs state=QUEUED (50)", data["listjobs_queued_s"]["n"],
         data["listjobs_queued_s"]["median"] * ms, data["listjobs_queued_s"]["p99"] * ms],
        ["ListJobs client_tag filter (50)", data["listjobs_tag_s"]["n"],
         data["listjobs_tag_s"]["median"] * ms, data["listjobs_tag_s"]["p99"] * ms],
        ["ListJobs paging all at 1000/page", data["listjobs_page1000_s"]["n"],
         data["listjobs_page1000_s"]["median"] * ms, data["listjobs_page1000_s"]["p99"] * ms],
    ]  # fmt: skip
    mib = 1 / 1024
    r1, r2 = data["watch_rounds"]
    mem_rows = [
        ["started, worker busy", data["rss_idle_kib"] * mib],
        [f"after {args.jobs} queued jobs", data["rss_after_submit_kib"] * mib],
        [f"{r1['streams']} streams open (round 1)", r1["rss_open_kib"] * mib],
        ["streams closed (round 1)", r1["rss_after_close_kib"] * mib],
        [f"{r2['streams']} streams open (round 2)", r2["rss_open_kib"] * mib],
        ["streams closed (round 2)", r2["rss_after_close_kib"] * mib],
        ["end", data["rss_end_kib"] * mib],
        ["peak (sampled every 50 ms)", data["rss_peak_kib"] * mib],
    ]
    per_job = (data["rss_after_submit_kib"] - data["rss_idle_kib"]) / max(1, args.jobs)
    per_stream = (r1["rss_open_kib"] - data["rss_after_submit_kib"]) / max(1, r1["streams"])
    notes = [
        f"Submit rate: {data['submit_rate_per_s']:.0f} jobs/s; RSS per queued job "
        f"{per_job:.2f} KiB, per open Watch stream {per_stream:.2f} KiB.",
        f"Streams opened over {args.connections} connections; all {r1['streams']} open after "
        f"{r1['all_open_s']:.2f} s (round 1), {r2['all_open_s']:.2f} s (round 2).",
        f"ListJobs paged through {data['listed_jobs']} jobs; jobs still QUEUED at the end: "
        f"{data['queued_still']}; service alive: {data['service_alive']}.",
        "The benchmark client shares the machine's CPUs with the service.",
    ]
    C.write_results(
        args.out, "bench_frontend_scale",
        f"Front end at scale: {args.jobs} queued jobs, {args.streams} Watch streams", info, data,
        [("Latency (ms)", ["call", "n", "p50 ms", "p99 ms"], lat_rows),
         ("Front-end RSS (MiB)", ["point", "RSS MiB"], mem_rows)],
        notes,
    )  # fmt: skip
    ok = data["service_alive"] and data["listed_jobs"] >= args.jobs
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
