"""The result cache, identical jobs in flight, Submit's idempotency key, labels and the retry
hint of a full queue, through a real service (the fake engine on a fake GPU)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from fe_service import fake_engine_service
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb

CACHE = job_pb2.RESULT_ORIGIN_CACHE
SHARED = job_pb2.RESULT_ORIGIN_SHARED_RUN
RUN = job_pb2.RESULT_ORIGIN_RUN


def start_service(root: Path, *extra: str) -> ServiceProcess:
    service = fake_engine_service(
        root,
        "--workers-per-device", "2",
        "--result-cache-hours", "24",  # on, as by default (tests/conftest.py turns it off)
        *extra,
    )  # fmt: skip
    service.start()
    return service


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = start_service(tmp_path_factory.mktemp("result-cache"))
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def stub(svc: ServiceProcess) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


def spec(cmd: dict[str, object], **labels: str) -> kernel_pb2.JobSpec:
    """A job of the fake engine; the same `cmd` (with its own "id") is the same job."""
    s = kernel_pb2.JobSpec(client_tag="cache-test")
    s.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    s.kernel.source_code = json.dumps(cmd, sort_keys=True)
    s.options.timeout.seconds = 60
    s.labels.update(labels)
    return s


def evaluate(stub, s: kernel_pb2.JobSpec) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    return stub.Evaluate(pb.EvaluateRequest(spec=s), timeout=120).job


def test_an_identical_job_takes_the_earlier_result(stub) -> None:  # type: ignore[no-untyped-def]
    cmd = {"do": "time", "seconds": 0.2, "id": uuid.uuid4().hex}
    first = evaluate(stub, spec(cmd))
    assert first.result.verdict == job_pb2.VERDICT_OK and first.result_origin == RUN
    again = spec(cmd, problem="7")  # who asks and why is not part of the key
    again.client_tag = "someone-else"
    second = evaluate(stub, again)
    assert second.job_id != first.job_id and second.state == job_pb2.JOB_STATE_DONE
    assert (second.result_origin, second.result_job_id) == (CACHE, first.job_id)
    assert second.result.verdict == job_pb2.VERDICT_OK
    assert list(second.result.notes) == list(first.result.notes)
    assert not second.HasField("start_time") and not second.worker_id
    # A result taken from a cached job still names the job that computed it.
    third = evaluate(stub, spec(cmd))
    assert (third.result_origin, third.result_job_id) == (CACHE, first.job_id)
    # bypass_cache runs, and an option that differs is another job.
    bypass = spec(cmd)
    bypass.options.bypass_cache = True
    assert evaluate(stub, bypass).result_origin == RUN
    other = spec(cmd)
    other.options.seed = 7
    assert evaluate(stub, other).result_origin == RUN


def test_identical_jobs_in_flight_share_one_run(stub) -> None:  # type: ignore[no-untyped-def]
    cmd = {"do": "time", "seconds": 1.0, "id": uuid.uuid4().hex}
    leader = stub.Submit(pb.SubmitRequest(spec=spec(cmd)), timeout=10).job
    with ThreadPoolExecutor(3) as pool:
        jobs = list(pool.map(lambda _: evaluate(stub, spec(cmd)), range(3)))
    for job in jobs:
        assert (job.result_origin, job.result_job_id) == (SHARED, leader.job_id), job
        assert job.result.verdict == job_pb2.VERDICT_OK
    # A waiting job's events: queued, then finished (it never started), with its labels.
    waiting = stub.Submit(pb.SubmitRequest(spec=spec(cmd, step="3")), timeout=10).job
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=waiting.job_id), timeout=30)]
    assert [e.WhichOneof("kind") for e in events] == ["queued", "finished"]
    assert all(dict(e.labels) == {"step": "3"} for e in events)


def test_faults_are_never_cached(stub) -> None:  # type: ignore[no-untyped-def]
    cmd = {"do": "segfault", "id": uuid.uuid4().hex}
    first = evaluate(stub, spec(cmd))
    second = evaluate(stub, spec(cmd))
    for job in (first, second):
        assert job.result.verdict == job_pb2.VERDICT_CRASHED and job.result_origin == RUN


def test_a_cancelled_leader_leaves_its_waiting_jobs_to_run(stub) -> None:  # type: ignore[no-untyped-def]
    cmd = {"do": "time", "seconds": 1.0, "id": uuid.uuid4().hex}
    leader = stub.Submit(pb.SubmitRequest(spec=spec(cmd)), timeout=10).job
    follower = stub.Submit(pb.SubmitRequest(spec=spec(cmd)), timeout=10).job
    quitter = stub.Submit(pb.SubmitRequest(spec=spec(cmd)), timeout=10).job
    t0 = time.monotonic()
    cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=quitter.job_id), timeout=10).job
    assert cancelled.state == job_pb2.JOB_STATE_CANCELLED and time.monotonic() - t0 < 2
    stub.CancelJob(pb.CancelJobRequest(job_id=leader.job_id), timeout=30)
    events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=follower.job_id), timeout=60)]
    done = events[-1].finished
    assert done.result.verdict == job_pb2.VERDICT_OK and done.result_origin == RUN
    assert "started" in [e.WhichOneof("kind") for e in events]


def test_submit_with_an_idempotency_key_makes_one_job(stub) -> None:  # type: ignore[no-untyped-def]
    key = uuid.uuid4().hex
    s = spec({"do": "time", "seconds": 0.1, "id": key})
    s.options.bypass_cache = True
    first = stub.Submit(pb.SubmitRequest(spec=s, idempotency_key=key), timeout=10).job
    again = stub.Submit(pb.SubmitRequest(spec=s, idempotency_key=key), timeout=10).job
    assert again.job_id == first.job_id
    other_tenant = pb.SubmitRequest(spec=s, idempotency_key=key)
    other_tenant.spec.client_tag = "another-tag"
    assert stub.Submit(other_tenant, timeout=10).job.job_id != first.job_id
    changed = pb.SubmitRequest(spec=s, idempotency_key=key)
    changed.spec.options.seed = 99
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(changed, timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert first.job_id in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(pb.SubmitRequest(spec=s, idempotency_key="k" * 129), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "idempotency_key" in (err.value.details() or "")


def test_labels_filter_list_jobs_and_bad_ones_are_named(stub) -> None:  # type: ignore[no-untyped-def]
    run = uuid.uuid4().hex[:12]
    for step in ("1", "2"):
        s = spec({"do": "time", "seconds": 0, "id": run + step}, run=run, step=step)
        stub.Submit(pb.SubmitRequest(spec=s), timeout=10)
    listed = stub.ListJobs(pb.ListJobsRequest(labels={"run": run, "step": "2"}), timeout=10).jobs
    assert len(listed) == 1
    assert len(stub.ListJobs(pb.ListJobsRequest(labels={"run": run}), timeout=10).jobs) == 2
    for labels, field in [
        ({"Bad Key": "x"}, "spec.labels['Bad Key']"),
        ({"ok": "v" * 257}, "spec.labels['ok']"),
        ({f"k{i}": "v" for i in range(17)}, "spec.labels"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Submit(pb.SubmitRequest(spec=spec({"do": "time"}, **labels)), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or ""), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.ListJobs(pb.ListJobsRequest(labels={"NO": "x"}), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_cache_survives_a_restart(tmp_path: Path) -> None:
    service = start_service(tmp_path)
    cmd = {"do": "time", "seconds": 0, "id": uuid.uuid4().hex}
    try:
        with service.channel() as ch:
            first = evaluate(kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch), spec(cmd))
        service.kill()
        service.start()
        with service.channel() as ch:
            again = evaluate(kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch), spec(cmd))
        assert (again.result_origin, again.result_job_id) == (CACHE, first.job_id)
    finally:
        service.stop()


def test_a_full_queue_says_when_to_retry(tmp_path: Path) -> None:
    service = start_service(tmp_path, "--max-queue", "1", "--workers-per-device", "1")
    try:
        with service.channel() as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            for i in range(2):  # one runs, one waits in the queue
                s = spec({"do": "time", "seconds": 3, "id": f"{i}{uuid.uuid4().hex}"})
                stub.Submit(pb.SubmitRequest(spec=s), timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                stub.Submit(pb.SubmitRequest(spec=spec({"do": "time", "n": 3})), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            status = rpc_status.from_call(err.value)
            assert status is not None
            infos = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
            assert len(infos) == 1
            info = error_details_pb2.RetryInfo()
            infos[0].Unpack(info)
            assert 1.0 <= info.retry_delay.ToNanoseconds() / 1e9 <= 60.0
    finally:
        service.stop()
