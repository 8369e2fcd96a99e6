"""The front end end to end (gRPC, main.py, watchdog.py, job_processes.py, jobs.py) with a
stand-in watchdog (fe_fake_watchdog.py) whose job processes pass their channels as
descriptors: no C++ build, no zygote, no sandbox needed."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fe_kernels as k
import pytest
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("fake-watchdog")
    binary = root / "fake-watchdog"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fe_fake_watchdog.py"} "$@"\n')
    binary.chmod(0o755)
    service = ServiceProcess(
        root / "state",
        ["--nvml", "none", "--watchdog", str(binary), "--workers-per-device", "2"],
        env={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
    )
    try:
        service.start()
        yield service
    finally:
        service.stop()


def test_jobs_run_one_a_process(svc: ServiceProcess) -> None:
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    jobs = [stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), timeout=30).job for _ in range(6)]
    assert all(j.result.verdict == job_pb2.VERDICT_OK for j in jobs), jobs
    assert len({j.worker_id for j in jobs}) == 6
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    stats = opstub.GetStats(ops.GetStatsRequest(), metadata=svc.auth())
    assert stats.worker_restart_count == 0  # a process leaving after its job is no restart
    deadline = time.monotonic() + 10
    while True:
        (cpu,) = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
        shape = (len([w for w in cpu.workers if not w.spare]), len(cpu.workers))
        if shape == (2, 5) or time.monotonic() > deadline:  # 2 take jobs, 3 spares
            break
        time.sleep(0.05)
    assert shape == (2, 5), cpu


def test_garbage_on_the_channel_and_a_timeout(svc: ServiceProcess) -> None:
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())
    bad = stub.Evaluate(pb.EvaluateRequest(spec=k.spec("FE_GARBAGE")), timeout=30).job
    assert bad.result.verdict == job_pb2.VERDICT_RUNTIME_ERROR, bad.result
    assert bad.result.error.exception_type == "ProtocolViolation"
    assert "4294967295" in bad.result.error.message and bad.attempt_count == 1
    hang = stub.Evaluate(pb.EvaluateRequest(spec=k.spec("FE_HANG", timeout_s=1)), timeout=30).job
    assert hang.result.verdict == job_pb2.VERDICT_TIMEOUT, hang.result
    ok = stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), timeout=30).job
    assert ok.result.verdict == job_pb2.VERDICT_OK
    assert "pid_namespace" in svc.log_path.read_text()  # the watchdog's warning is logged
