"""On a GPU: a Triton kernel from its IOContract compared with an eager PyTorch reference is
built by a build process, launched by a launch process that never imports the reference, and
judged by a process the kernel never ran in (prebuild.py: reference_judged; the CPU side is
test_judged_launch.py). Honest kernels are OK with both times, launched by one launch process
job after job; a wrong one is INCORRECT by the judge; a kernel that stores past its buffer
faults, and the next tenant's job is OK."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ke_service import ServiceProcess, gpu_service_marks
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _kernels as K  # noqa: E402

pytestmark = gpu_service_marks()
N = 1 << 20
GPU = int(os.environ.get("KERNELEVAL_TEST_GPU", "0"))
OOB_STORE = "tl.store(out_ptr + offs + (1 << 40), "  # 4 TiB past the output


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    args = ["--devices", str(GPU), "--build-processes", "2", "--workers-per-device", "4"]
    args += ["--judge-launches", "true"]
    svc = ServiceProcess(tmp_path_factory.mktemp("judged-launch-gpu"), [
        *args, "--build-pch", "false", "--result-cache-hours", "0",
    ])  # fmt: skip
    svc.start(timeout=180)
    try:
        yield svc
    finally:
        svc.stop(timeout=30)


def _run(node: ServiceProcess, spec: kernel_pb2.JobSpec) -> tuple[job_pb2.Job, list[str], str]:
    """The job, the worker ids of its `started` events, and the log line naming its judge."""
    spec.options.CopyFrom(K.options(correct=2, perf=20, timeout_s=120))
    with node.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        events = [r.event for r in stub.Run(pb.RunRequest(spec=spec), timeout=300)]
        job = stub.GetJob(pb.GetJobRequest(job_id=events[0].job_id), timeout=30).job
    started = [e.started.worker_id for e in events if e.HasField("started")]
    judged = next((e.log.text for e in events if "judged by" in e.log.text), "")
    return job, started, judged


def test_launched_alone_and_judged_with_the_eager_reference(node: ServiceProcess) -> None:
    launchers = set()
    for variant in (1, 2, 3):
        job, started, judged = _run(node, K.triton_add_io_spec(N, variant=variant))
        r = job.result
        assert r.verdict == job_pb2.VERDICT_OK, r
        assert r.correctness_status == job_pb2.CORRECTNESS_PASSED, r
        assert r.runtime.median_ms > 0 and r.reference_runtime.median_ms > 0 and r.speedup > 0
        # Built by a build process, then launched by a GPU process; judged by another.
        assert len(started) == 2 and started[0].startswith("build-"), started
        assert started[1].startswith(f"d{GPU}-w"), started
        assert judged and started[1] not in judged, judged
        launchers.add(started[1])
    assert len(launchers) == 1, launchers

    wrong, _, judged = _run(node, K.triton_add_io_spec(N, scale=2.0, variant=4))
    assert wrong.result.verdict == job_pb2.VERDICT_INCORRECT, wrong.result
    assert wrong.result.failed_side == job_pb2.SIDE_KERNEL and judged

    bad = K.triton_add_io_spec(N, variant=5)
    bad.kernel.source_code = bad.kernel.source_code.replace("tl.store(out_ptr + offs, ", OOB_STORE)
    assert OOB_STORE in bad.kernel.source_code
    faulted, _, _ = _run(node, bad)
    assert faulted.result.verdict == job_pb2.VERDICT_DEVICE_FAULT, faulted.result

    nxt, started, judged = _run(node, K.triton_add_io_spec(N, variant=6))
    assert nxt.result.verdict == job_pb2.VERDICT_OK and judged, nxt.result
