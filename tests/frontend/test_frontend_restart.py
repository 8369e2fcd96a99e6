"""A service on the CPU pseudo-device, killed and restarted on the same state folder."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import fe_kernels as k
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc

TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = ServiceProcess(
        tmp_path_factory.mktemp("restart") / "state",
        ["--nvml", "none", "--max-queue", "20", "--shutdown-grace-s", "3"],
    )
    service.start()
    yield service
    service.stop()


def stub_of(svc: ServiceProcess) -> kernel_eval_service_pb2_grpc.KernelEvalServiceStub:
    return kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())


def wait_all_terminal(
    stub: kernel_eval_service_pb2_grpc.KernelEvalServiceStub, ids: list[str], timeout: float
) -> dict[str, job_pb2.Job]:
    deadline = time.monotonic() + timeout
    jobs: dict[str, job_pb2.Job] = {}
    while time.monotonic() < deadline:
        jobs = {i: stub.GetJob(pb.GetJobRequest(job_id=i)).job for i in ids}
        if all(j.state in TERMINAL for j in jobs.values()):
            break
        time.sleep(0.2)
    return jobs


def test_cpu_pseudo_device_listed(svc: ServiceProcess) -> None:
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
    assert [d.index for d in devices] == [-1]
    assert devices[0].name == "cpu"
    assert any(not w.spare for w in devices[0].workers)
    with pytest.raises(grpc.RpcError) as info:
        opstub.ResetGpu(ops.ResetGpuRequest(device_index=-1), metadata=svc.auth())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_second_front_end_on_the_same_state_is_refused(svc: ServiceProcess) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kerneleval_server", "serve", "--port", "0",
         "--state-dir", str(svc.state_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "another kerneleval front end uses" in proc.stderr


def test_sigkill_with_20_queued_jobs_then_restart(svc: ServiceProcess) -> None:
    stub = stub_of(svc)
    hang = stub.Submit(pb.SubmitRequest(spec=k.spec(k.HANG, timeout_s=3))).job
    deadline = time.monotonic() + 30
    while stub.GetJob(pb.GetJobRequest(job_id=hang.job_id)).job.state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ids = [stub.Submit(pb.SubmitRequest(spec=k.spec(perf_trials=1))).job.job_id for _ in range(20)]
    # Back-pressure: the queue holds 20.
    with pytest.raises(grpc.RpcError) as info:
        stub.Submit(pb.SubmitRequest(spec=k.spec()))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    svc.kill()
    svc.start()
    stub = stub_of(svc)
    jobs = wait_all_terminal(stub, [hang.job_id, *ids], timeout=120)
    states = {i: job_pb2.JobState.Name(j.state) for i, j in jobs.items()}
    assert all(j.state in TERMINAL for j in jobs.values()), states
    assert all(jobs[i].result.verdict == job_pb2.VERDICT_OK for i in ids)
    # The job that was running when the front end died ran again, and timed out again.
    assert jobs[hang.job_id].attempt_count == 2
    assert jobs[hang.job_id].result.verdict == job_pb2.VERDICT_TIMEOUT
    # Its event log runs on across the restart, without gaps or repeats.
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=hang.job_id))]
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert [e.started.attempt for e in events if e.HasField("started")] == [1, 2]


def test_sigterm_keeps_queued_jobs(svc: ServiceProcess) -> None:
    stub = stub_of(svc)
    before = stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), timeout=120).job
    hang = stub.Submit(pb.SubmitRequest(spec=k.spec(k.HANG, timeout_s=3))).job
    queued = stub.Submit(pb.SubmitRequest(spec=k.spec())).job
    deadline = time.monotonic() + 30
    while stub.GetJob(pb.GetJobRequest(job_id=hang.job_id)).job.state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert svc.proc is not None
    svc.proc.send_signal(signal.SIGTERM)
    # Draining: health flips first, new jobs are refused, the running one gets its grace.
    health = health_pb2_grpc.HealthStub(svc.channel())
    deadline = time.monotonic() + 2
    while health.Check(health_pb2.HealthCheckRequest()).status != 2:  # NOT_SERVING
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as info:
        stub.Submit(pb.SubmitRequest(spec=k.spec()))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert svc.stop(timeout=60) == 0
    svc.start()
    stub = stub_of(svc)
    jobs = wait_all_terminal(stub, [hang.job_id, queued.job_id], timeout=120)
    assert jobs[queued.job_id].result.verdict == job_pb2.VERDICT_OK
    assert jobs[hang.job_id].state in TERMINAL
    # Results from before the restart stay readable.
    assert stub.GetJob(pb.GetJobRequest(job_id=before.job_id)).job == before


def test_watchdog_killed_is_restarted_and_its_job_rerun(svc: ServiceProcess) -> None:
    import os
    import signal

    assert svc.proc is not None
    stub = stub_of(svc)
    hang = stub.Submit(pb.SubmitRequest(spec=k.spec(k.HANG, timeout_s=3))).job
    deadline = time.monotonic() + 30
    while stub.GetJob(pb.GetJobRequest(job_id=hang.job_id)).job.state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    children = Path(f"/proc/{svc.proc.pid}/task/{svc.proc.pid}/children").read_text().split()
    watchdogs = [
        int(c) for c in children if "kerneleval-watchdog" in Path(f"/proc/{c}/cmdline").read_text()
    ]
    assert len(watchdogs) == 1
    os.kill(watchdogs[0], signal.SIGKILL)
    job = wait_all_terminal(stub, [hang.job_id], timeout=90)[hang.job_id]
    assert job.attempt_count == 2, job
    assert job.result.verdict == job_pb2.VERDICT_TIMEOUT
    svc.wait_serving(60)
    done = stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), timeout=120).job
    assert done.result.verdict == job_pb2.VERDICT_OK


def test_tls_listener(tmp_path: Path) -> None:
    import shutil
    import subprocess

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    service = ServiceProcess(
        tmp_path / "state",
        ["--nvml", "none", "--warm-spare", "false",
         "--tls-cert", str(cert), "--tls-key", str(key)],
    )  # fmt: skip
    service.tls_root = cert.read_bytes()
    try:
        service.start(wait_serving=False)
        with service.channel() as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True
            )
            assert resp.status in (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            )
        with grpc.insecure_channel(service.address) as plain:
            with pytest.raises(grpc.RpcError):
                kernel_eval_service_pb2_grpc.KernelEvalServiceStub(plain).GetJob(
                    pb.GetJobRequest(job_id="x"), timeout=5
                )
    finally:
        service.stop()
