"""A job that names a GPU model runs only on a GPU of that model (EvalOptions.device_model):
two fake GPUs of different models behind one service, the fake engine on both."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import fe_kernels as k
import grpc
import pytest
from fe_service import fake_engine_service
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval_server.jobs.scheduler import FairQueue, QueuedJob
from kerneleval_server.spec import placement


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    service = fake_engine_service(
        tmp_path_factory.mktemp("placement"),
        "--workers-per-device",
        "1",
        # (the fake's names have no spaces)
        nvml="device 0 name=NVIDIA-H100-80GB-HBM3 uuid=GPU-fake-0 memory_total=1000000\n"
        "device 1 name=NVIDIA-H200 uuid=GPU-fake-1 memory_total=1000000\n",
    )
    try:
        service.start()
        yield service
    finally:
        service.stop()


@pytest.fixture
def stub(svc: ServiceProcess) -> kernel_eval_service_pb2_grpc.KernelEvalServiceStub:
    return kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())


def _spec(model: str = "", index: int | None = None) -> kernel_pb2.JobSpec:
    s = k.spec(json.dumps({"do": "time", "seconds": 0.2}))
    s.options.bypass_cache = True
    s.options.device_model = model
    if index is not None:
        s.options.device_index = index
    return s


def _finished(stub, job_id: str) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 120
    while True:
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id)).job
        if job.state in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_FAILED):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def test_jobs_that_name_a_model_run_only_on_its_gpus(stub) -> None:  # type: ignore[no-untyped-def]
    """Six at once: the H200 jobs queue for GPU 1 while GPU 0 is free; "h100" (any case) goes
    to GPU 0; jobs with no model use both."""
    jobs = [("H200", stub.Submit(pb.SubmitRequest(spec=_spec("H200"))).job) for _ in range(4)]
    jobs.append(("h100", stub.Submit(pb.SubmitRequest(spec=_spec("h100"))).job))
    jobs.append(("", stub.Submit(pb.SubmitRequest(spec=_spec())).job))
    for model, job in jobs:
        done = _finished(stub, job.job_id)
        assert done.state == job_pb2.JOB_STATE_DONE, done
        assert done.result.verdict == job_pb2.VERDICT_OK, done.result
        if model:
            assert done.device_index == (1 if model == "H200" else 0), (model, done)


@pytest.mark.parametrize(
    ("model", "index", "says"),
    [
        (
            "A100",
            None,
            "no GPU here is a 'A100' (devices: 0: NVIDIA-H100-80GB-HBM3, 1: NVIDIA-H200)",
        ),
        ("H200", 0, "GPU 0 here is not a 'H200'"),
        ("H100%", None, "letters, digits, spaces, '.' and '-'"),
        ("x" * 65, None, "at most 64 characters"),
    ],
)
def test_a_model_no_gpu_here_has_is_refused_naming_the_field(  # type: ignore[no-untyped-def]
    stub, model: str, index: int | None, says: str
) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stub.Submit(pb.SubmitRequest(spec=_spec(model, index)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.options.device_model" in e.value.details() and says in e.value.details()


def test_the_queue_gives_a_device_only_jobs_that_fit_it() -> None:
    q = FairQueue()
    q.push(QueuedJob("h200", "a", None, model="h200"))
    q.push(QueuedJob("pinned", "b", 1))
    q.push(QueuedJob("any", "c", None))
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert q.pop_for(0, device_name=h100).job_id == "any"  # type: ignore[union-attr]
    assert q.pop_for(0, device_name=h100) is None
    assert q.pop_for(1, device_name=h200).job_id == "h200"  # type: ignore[union-attr]
    assert q.pop_for(1, device_name=h200).job_id == "pinned"  # type: ignore[union-attr]


def test_a_job_may_run_where_the_index_and_the_model_both_fit() -> None:
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200", 2: "NVIDIA H100 NVL"}

    def allowed(s: kernel_pb2.JobSpec) -> list[int]:
        return [i for i, n in names.items() if placement.may_run_on(s, i, n)]

    s = kernel_pb2.JobSpec()
    assert allowed(s) == [0, 1, 2]
    s.options.device_model = " h100 "
    assert allowed(s) == [0, 2]
    s.options.device_index = 2
    assert allowed(s) == [2]
    s.options.device_index = 1
    assert allowed(s) == []


def test_a_gateway_refuses_only_a_model_no_node_has() -> None:
    """A gateway lists every node's GPUs: one index for several nodes, of different models."""
    nodes = [(0, "NVIDIA H100 80GB HBM3"), (0, "NVIDIA H200"), (1, "NVIDIA H200")]
    s = kernel_pb2.JobSpec()
    s.options.device_model = "H100"
    assert placement.refusal(s, nodes) == ""
    s.options.device_index = 1
    assert placement.refusal(s, nodes) == (
        "GPU 1 here is not a 'H100' (devices: 0: NVIDIA H100 80GB HBM3, 0: NVIDIA H200, "
        "1: NVIDIA H200)"
    )
    assert placement.refusal(s, []) == ""  # no node registered yet: nothing to refuse on
