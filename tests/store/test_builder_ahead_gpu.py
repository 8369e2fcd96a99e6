"""On a GPU: what a `--role builder` built is what the node's GPU runs (issue 18).

A builder (no GPU of its own: `--nvml none`, `CUDA_VISIBLE_DEVICES` empty) and a node owning
GPU 0 (or $KERNELEVAL_TEST_GPU), both real `kerneleval serve` processes on a real PostgreSQL
(Debian's, else the pgserver wheel's, which travels to a GPU machine). The node waits for
builders up to 60 s and has one build process of its own (with none it would run such jobs
whole), which the builder's answer leaves idle. Each job below is built by the builder
(its first `started` names the builder) and launched on the GPU by the node's launch process:
- a Triton kernel from its IOContract against a raw CUDA reference, and a raw CUDA kernel
  against the same reference: OK, with a kernel time;
- a raw CUDA kernel that computes the wrong thing: INCORRECT;
- a raw CUDA kernel that stores 4 TiB past its buffer: DEVICE_FAULT;
- the next tenant's job after the fault, built by the builder: OK.
The CPU side of the same path (a builder's Triton build for sm_90, forged requests, a builder
killed mid-build) is test_builder_ahead_service.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from ke_service import ServiceProcess, gpu_service_marks
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from pg_server import PostgresServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _kernels as K  # noqa: E402

pytestmark = gpu_service_marks()
N = 1 << 20
GPU = int(os.environ.get("KERNELEVAL_TEST_GPU", "0"))  # the node's GPU (nvidia-smi's index)


def _common(url: str) -> list[str]:
    return ["--store", url, "--build-pch", "false", "--lease-seconds", "5",
            "--admin-token", "ket_builder-gpu-test-token", "--result-cache-hours", "0"]  # fmt: skip


@pytest.fixture
def pair(postgres: PostgresServer, tmp_path: Path) -> Iterator[tuple[str, ServiceProcess]]:
    url = postgres.new_database()
    builder = ServiceProcess(
        tmp_path / "builder",
        ["--role", "builder", "--nvml", "none", "--build-processes", "2", *_common(url)],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    # One build process of its own: a node builds ahead only with some (else it runs such jobs
    # whole); the builders' 60 s leave it nothing to build here.
    node_args = ["--role", "node", "--devices", str(GPU), "--builder-wait-s", "60"]
    node_args += ["--build-processes", "1", *_common(url)]
    node = ServiceProcess(tmp_path / "node", node_args)
    try:
        builder.start()
        node.start(timeout=180)
        yield url, node
    finally:
        node.stop(timeout=30)
        builder.stop(timeout=30)


def _run(node: ServiceProcess, spec: kernel_pb2.JobSpec) -> tuple[job_pb2.Job, list[str]]:
    """The job's record and the worker ids of its `started` events, in order."""
    spec.options.CopyFrom(K.options(correct=2, perf=20, timeout_s=120))
    with node.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        events = [r.event for r in stub.Run(pb.RunRequest(spec=spec), timeout=300)]
        job = stub.GetJob(pb.GetJobRequest(job_id=events[0].job_id), timeout=30).job
    return job, [e.started.worker_id for e in events if e.HasField("started")]


def _builder_id(url: str) -> str:
    with psycopg.connect(url) as conn:
        (row,) = conn.execute("SELECT builder_id FROM builders").fetchall()
    return str(row[0])


def test_what_a_builder_built_runs_on_the_nodes_gpu(pair: tuple[str, ServiceProcess]) -> None:
    url, node = pair
    builder_id = _builder_id(url)
    cases = [
        ("triton from its IOContract", K.triton_add_io_built_spec(N, variant=1),
         job_pb2.VERDICT_OK),
        ("raw CUDA", K.cuda_add_spec(N, variant=2), job_pb2.VERDICT_OK),
        ("raw CUDA, wrong", K.cuda_add_spec(N, scale=2.0, variant=3), job_pb2.VERDICT_INCORRECT),
        ("raw CUDA, illegal address", K.cuda_bad_spec(K.CUDA_OOB, "builder-gpu-oob"),
         job_pb2.VERDICT_DEVICE_FAULT),
        ("the next tenant", K.cuda_add_spec(N, variant=4), job_pb2.VERDICT_OK),
    ]  # fmt: skip
    for name, spec, verdict in cases:
        job, started = _run(node, spec)
        assert job.result.verdict == verdict, (name, job.result)
        # Built by the builder, then launched by one of the node's GPU processes.
        assert len(started) == 2 and started[0] == builder_id, (name, started)
        assert started[1].startswith(f"d{GPU}-w"), (name, started)
        if verdict == job_pb2.VERDICT_OK:
            assert job.result.compiled and job.result.runtime.median_ms > 0, (name, job)
    with psycopg.connect(url) as conn:
        built = conn.execute("SELECT built_by FROM artifacts").fetchall()
    assert built and {r[0] for r in built} == {builder_id}, built
