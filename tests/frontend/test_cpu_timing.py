"""CPU timings that don't cry wolf (issue 41), through the real service on a host without a GPU.

Two fake-NVML devices whose job processes see no GPU time on the same cores: their timing
windows take turns on the host (one GPU gate for both, jobs/scheduler.py `share_host`), and an
identical ModelNew against its Model is not flagged suspicious; the result says its times
are the host's wall clock.
"""

from __future__ import annotations

import calendar
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fe_kernels as k
import pytest
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb

pytestmark = [
    pytest.mark.skipif(
        os.path.exists("/dev/nvidiactl"), reason="CPU timings: a host without a GPU"
    ),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux only"),
    pytest.mark.timeout(240),
]

TWO_FAKE_GPUS = (
    "device 0 name=FakeGPU uuid=GPU-fake-0 memory_total=80000000000\n"
    "device 1 name=FakeGPU uuid=GPU-fake-1 memory_total=80000000000\n"
)
MODEL = k.GOOD.replace("torch.randn(64)", "torch.randn(128, 128)").replace("x * 2.0 + 1.0", "x @ x")
MODEL_NEW = MODEL.replace("class Model(", "class ModelNew(")


def windows_in_log(log: Path) -> dict[int, list[tuple[float, float]]]:
    """Per device, its timing windows as (opened, closed) from the service log: a window
    opened again for its judge's drive of the kernel is the same window until it closes."""
    spans: dict[int, list[tuple[float, float]]] = {}
    opened: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if "timing window" not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        # The log's times are UTC: seconds since the epoch, as time.time() says them.
        when = calendar.timegm(time.strptime(entry["time"][:19], "%Y-%m-%dT%H:%M:%S"))
        when += float("0." + entry["time"][20:23])
        device = int(entry["device_index"])
        if entry["message"] == "timing window opened":
            opened.setdefault(device, when)
        elif entry["message"] == "timing window closed" and device in opened:
            spans.setdefault(device, []).append((opened.pop(device), when))
    return spans


def test_two_timed_jobs_on_the_cpu_never_time_at_once_and_none_cries_wolf(
    tmp_path: Path,
) -> None:
    (tmp_path / "fake_nvml").write_text(TWO_FAKE_GPUS)
    svc = ServiceProcess(
        tmp_path / "state",
        ["--nvml", "fake", "--fake-nvml-path", str(tmp_path / "fake_nvml"), "--log-level", "INFO"],
    )
    svc.start()
    try:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())

        def compare(device: int) -> job_pb2.Job:
            spec = k.spec(MODEL_NEW + f"\n# on {device}\n", reference=MODEL, perf_trials=40)
            spec.options.device_index = device
            return stub.Compare(pb.CompareRequest(spec=spec), timeout=180).job

        with ThreadPoolExecutor(2) as pool:
            jobs = list(pool.map(compare, (0, 1)))
    finally:
        svc.stop()
    for job in jobs:
        r = job.result
        assert r.verdict == job_pb2.VERDICT_OK, r
        # Identical code: whatever the wall clock read, it is not flagged, and it says why.
        assert not r.speedup_suspicious, r
        assert r.runtime.source in (
            job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK,
            job_pb2.TIMING_SOURCE_OUTSIDE_BOUND,
        ), r.runtime
        assert r.reference_runtime.source == job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK, r
        assert any("host wall-clock" in n for n in r.notes), r.notes
    assert sorted(j.device_index for j in jobs) == [0, 1]
    spans = windows_in_log(svc.log_path)
    assert sorted(spans) == [0, 1], spans  # both timed, each on its device
    every = sorted(s for device in spans.values() for s in device)
    overlaps = [(a, b) for a, b in zip(every, every[1:], strict=False) if b[0] < a[1]]
    assert not overlaps, (every, svc.log_tail())
