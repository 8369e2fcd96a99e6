"""`--role builder` as a service, on a real PostgreSQL server: a builder (build processes only,
no GPU) and a node (the real engine on the CPU device, a build process of its own) share one
store; a job's load_inline call is built by the builder and the node only loads it; with the
builder killed mid-build, the node builds the next call itself. The CPU build of torch builds
C++ extensions only: the call is the light pybind11 one of tests/frontend/test_extension_builds.py
(seconds to build). Also: what --role builder needs."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import psycopg
import pytest
from builder_services import TOKEN, common_args
from ke_service import ServiceProcess, real_watchdog_available
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import (
    job_pb2,
    kernel_eval_service_pb2_grpc,
    kernel_pb2,
    operations_service_pb2_grpc,
)
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval_server.jobs.store import open_store

REFERENCE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1
def get_inputs():
    return [torch.randn(256)]
def get_init_inputs():
    return []
"""

LIGHT = """
import torch
from torch.utils.cpp_extension import load_inline
cpp = '''
#include <pybind11/pybind11.h>
// SALT
float one() { return 1.0f; }
'''
ext = load_inline(name="NAME", cpp_sources=[cpp], functions=["one"], no_implicit_headers=True,
                  with_pytorch_error_handling=False, extra_cflags=['-O2'])
class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x * 2 + ext.one()
"""


def spec() -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec(client_tag="builders")
    s.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH_CUDA
    s.kernel.source_code = LIGHT.replace("SALT", uuid.uuid4().hex).replace(
        "NAME", f"light_{uuid.uuid4().hex[:8]}"
    )
    s.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    s.reference.source_code = REFERENCE
    s.options.timeout.seconds = 300
    s.options.perf_trial_count = 0
    return s


@pytest.mark.skipif(not real_watchdog_available(), reason="needs the watchdog")
def test_the_builder_builds_and_the_node_loads(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    url, started = services
    builder = ServiceProcess(tmp_path / "builder", ["--role", "builder", *common_args(url)])
    started.append(builder)
    builder.start()  # SERVING: registered in the store, its build process up
    with psycopg.connect(url) as conn:
        ((builder_id, versions, slots),) = conn.execute(  # fmt: skip
            "SELECT builder_id, versions, slots FROM builders"
        ).fetchall()
    assert "-builder-" in builder_id and versions.startswith("torch ") and slots == 1
    node = ServiceProcess(
        tmp_path / "node",
        ["--role", "node", "--nvml", "none", "--builder-wait-s", "1", *common_args(url)],
    )
    started.append(node)
    node.start()
    with node.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        events = [r.event for r in stub.Run(pb.RunRequest(spec=spec()), timeout=300)]
        job = stub.GetJob(pb.GetJobRequest(job_id=events[0].job_id), timeout=30).job
    logs = [e.log.text for e in events if e.WhichOneof("kind") == "log"]
    assert job.result.verdict == job_pb2.VERDICT_OK, (job.result, logs)
    assert "kerneleval: load_inline asked of the builders (1 live)" in logs, logs
    assert f"kerneleval: load_inline from the shared artifact store (built by {builder_id})" in (
        logs
    ), logs
    # The node built nothing: its build process never got it (the line a local build logs).
    assert not any(t.startswith("kerneleval: building ") for t in logs), logs
    assert "for the shared store" in builder.log_path.read_text()
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT data, built_by, versions FROM artifacts").fetchall()
        assert conn.execute("SELECT COUNT(*) FROM build_requests").fetchone() == (0,)
    assert [(r[1], r[2]) for r in rows] == [(builder_id, versions)]
    built = job_channel_pb2.ExtensionBuilt.FromString(bytes(rows[0][0]))
    assert built.library.startswith(b"\x7fELF") and not built.error

    # The builder is killed (SIGKILL) while it builds another call: once its lease expires and
    # no builder holds the request for --builder-wait-s, the node builds it itself.
    with node.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        job_id = stub.Submit(pb.SubmitRequest(spec=spec()), timeout=30).job.job_id
        deadline = time.monotonic() + 60
        with psycopg.connect(url, autocommit=True) as conn:
            while not conn.execute(
                "SELECT 1 FROM build_requests WHERE lease_builder = %s", (builder_id,)
            ).fetchall():
                assert time.monotonic() < deadline, "the builder never took the build"
                time.sleep(0.02)
        builder.kill()
        events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job_id), timeout=120)]
    logs = [e.log.text for e in events if e.WhichOneof("kind") == "log"]
    assert events[-1].finished.result.verdict == job_pb2.VERDICT_OK, logs
    assert any("no builder held it for 1 s" in t for t in logs), logs
    assert any(t.startswith("kerneleval: building ") for t in logs), logs  # here, this time
    with psycopg.connect(url) as conn:
        owners = conn.execute("SELECT built_by FROM artifacts ORDER BY created").fetchall()
        assert conn.execute("SELECT COUNT(*) FROM build_requests").fetchone() == (0,)
    assert len(owners) == 2 and owners[0][0] == builder_id and "-builder-" not in owners[1][0]


@pytest.mark.skipif(not real_watchdog_available(), reason="needs the watchdog")
def test_list_builders_through_a_gateway(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    """A real builder in the store, seen through a gateway's ListBuilders (admin only): its
    address, slots, versions (the gateway's own, probed from the same Python: they match) and
    requests; killed, it is listed as expired."""
    url, started = services
    builder = ServiceProcess(tmp_path / "builder", ["--role", "builder", *common_args(url)])
    gateway = ServiceProcess(tmp_path / "gateway", ["--role", "gateway", *common_args(url)])
    started += [builder, gateway]
    builder.start()
    gateway.start()
    # Another builder of other versions, as one of another image would register; it holds a
    # request of its versions.
    other = "torch 0.0.1|cuda 99.0|g++ 1|nvcc 1|recipe 0"
    store = open_store(url, shared=True)
    try:
        store.register_builder("odd-builder-1", "10.9.9.9:50051", other, 4, 60.0)
        store.request_build("k-other", other, "sm_90", "{}", "node-x")
        assert store.claim_builds("odd-builder-1", other, 1, 60.0)
    finally:
        store.close()
    auth = [("authorization", f"Bearer {TOKEN}")]
    with gateway.channel() as ch:
        stub = operations_service_pb2_grpc.OperationsServiceStub(ch)
        for md in (None, [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListBuilders(ops.ListBuildersRequest(), metadata=md, timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Its 3 s lease (--lease-seconds) may lapse between heartbeats on a loaded host: the
        # listing is asked again until the builder has beaten (a flake seen under load).
        deadline = time.monotonic() + 30
        while True:
            resp = stub.ListBuilders(ops.ListBuildersRequest(), metadata=auth, timeout=120)
            listed = {b.builder_id: b for b in resp.builders}
            odd = listed.pop("odd-builder-1")
            (real,) = listed.values()
            if not real.expired or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "-builder-" in real.builder_id and real.address == builder.address
        assert real.build_slots == 1 and real.versions.startswith("torch ")
        assert real.versions_match and list(resp.versions) == [real.versions]
        assert not real.expired and real.leased_request_count == 0
        beat = real.last_heartbeat_time.ToNanoseconds() / 1e9
        assert time.time() - 5 < beat <= time.time()
        assert beat < real.expire_time.ToNanoseconds() / 1e9
        assert (odd.address, odd.build_slots, odd.versions) == ("10.9.9.9:50051", 4, other)
        assert not odd.versions_match and not odd.expired  # no job here could use it
        assert (odd.leased_request_count, odd.waiting_request_count) == (1, 0)

        # SIGKILL: nothing given back, nothing forgotten; once its registration runs out
        # (--lease-seconds 3) it is listed as expired, and a request of its versions waits.
        builder.kill()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO build_requests (key, versions, arch, arguments, requested_by,"
                " created) VALUES ('k-waits', %s, 'sm_90', '{}', 'node-x', 0)",
                (real.versions,),
            )
        deadline = time.monotonic() + 30
        while True:
            resp = stub.ListBuilders(ops.ListBuildersRequest(), metadata=auth, timeout=30)
            (lost,) = [b for b in resp.builders if b.builder_id == real.builder_id]
            if lost.expired:
                break
            assert time.monotonic() < deadline, "the killed builder never expired"
            time.sleep(0.2)
        assert lost.expire_time.ToNanoseconds() / 1e9 < time.time()
        assert lost.waiting_request_count == 1 and lost.leased_request_count == 0
        assert lost.last_heartbeat_time.ToNanoseconds() >= real.last_heartbeat_time.ToNanoseconds()


def test_role_builder_needs_a_postgresql_store_and_build_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kerneleval_server import config, main

    with pytest.raises(SystemExit) as stop:
        main.main(["serve", "--role", "builder", "--state-dir", "/nonexistent"])
    assert stop.value.code == 2
    assert "--role builder needs --store postgresql://" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main(["serve", "--role", "builder", "--store", "postgresql://x@/db",
                   "--build-processes", "0"])  # fmt: skip
    assert "--role builder needs build processes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main(["serve", "--role", "compiler"])
    assert "one of all, gateway, node, builder" in capsys.readouterr().err
    # Auto build processes on a builder, GPU or not; its watchdog runs nothing else.
    cfg = config.Config(role="builder", store="postgresql://x@/db")
    assert cfg.problems() == [] and cfg.effective_build_processes() >= 2
    configure = main.build_configure(cfg, Path("/nonexistent"))
    assert list(configure.device_indices) == [-3] and configure.build_processes >= 2
