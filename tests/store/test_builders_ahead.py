"""Jobs built ahead (prebuild.py: Triton and raw CUDA kernels launched from their IOContract)
through the shared artifact store and `--role builder`s (jobs/builds/ahead_builds.py,
artifact_store.py, builder_node.py) on a real PostgreSQL server, in one process: a node's
SharedArtifacts with the job manager's side acted out (`Host`: its queue, and the build answers
JobManager.built_elsewhere would take), builders' ExtensionBuilds and BuilderNode whose build
processes are acted out (a build answers at once with a fake cubin per source naming the
builder). What is tested is the protocol: who builds, what the node's jobs get, keys, versions,
leases, waits. The service processes' own path (a real builder and a real node, nvcc, Triton
compiled for a GPU on a CPU-only builder) is tests/store/test_builder_ahead_service.py."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_pb2
from kerneleval_server.jobs.builds import ahead_builds
from kerneleval_server.jobs.builds.artifact_store import SharedArtifacts
from kerneleval_server.jobs.builds.build_cache import BuildCache
from kerneleval_server.jobs.builds.builder_node import BuilderNode
from kerneleval_server.jobs.builds.compile_cache import CompileCache, as_files, built_key
from kerneleval_server.jobs.builds.extension_builds import ExtensionBuilds
from kerneleval_server.jobs.store import PostgresStore
from kerneleval_server.jobs.store.base import BUILD_REFUSED
from pg_server import PostgresServer

DEVICE = job_pb2.DeviceInfo(torch_version="2.11.0", cuda_version="13.0")
ARCH = "sm_90"
Outcome = job_channel_pb2.BuildOutcome

TRITON = """
import triton
import triton.language as tl

@triton.jit
def add(a, b, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(a + offs, mask=mask) + tl.load(b + offs, mask=mask), mask=mask)
# SALT
"""
CUDA = """
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];  // SALT
}
"""


def spec(kind: str = "triton", salt: str = "", timeout_s: int = 60) -> kernel_pb2.JobSpec:
    """A job built ahead: a Triton or raw CUDA kernel launched from its IOContract (distinct
    code unless `salt` names one); "COMPILE_ERROR" in `salt` makes the acted-out build fail."""
    s = kernel_pb2.JobSpec(client_tag="tenant-a", labels={"run": "r1"})
    k = s.kernel
    k.type = kernel_pb2.KERNEL_TYPE_TRITON if kind == "triton" else kernel_pb2.KERNEL_TYPE_CUDA
    k.source_code = (TRITON if kind == "triton" else CUDA).replace("SALT", salt or uuid.uuid4().hex)
    for name in ("a", "b", "out"):
        arg = k.io.args.add(name=name)
        arg.tensor.shape.append(256)
        arg.tensor.dtype = dtype_pb2.DTYPE_FLOAT32
    k.io.args.add(name="n", int_value=256)
    if kind == "triton":
        k.io.args.add(name="BLOCK", int_value=256, meta=True)
    else:
        k.io.launch.block.x = 256
    k.io.launch.grid.x = 1
    s.options.timeout.seconds = timeout_s
    s.options.perf_trial_count = 7
    return s


class Hub:
    def __init__(self) -> None:
        self.logs: dict[str, list[str]] = {}

    def next_event(self, job_id: str) -> job_pb2.JobEvent:
        return job_pb2.JobEvent(job_id=job_id)

    def publish(self, event: job_pb2.JobEvent, persisted: bool = False) -> None:
        self.logs.setdefault(event.job_id, []).append(event.log.text)

    def log(self, job_id: str, text: str) -> None:
        self.publish(job_pb2.JobEvent(job_id=job_id, log=job_pb2.JobLog(text=text)))


class Host:
    """The job manager's side (ahead_builds.Host): queued jobs, their build answers; `offer`
    is what its dispatch does, `local` what its own build processes may take."""

    def __init__(self, store: Any) -> None:
        self.specs: dict[str, kernel_pb2.JobSpec] = {}
        self.queue: set[str] = set()
        self.store = SimpleNamespace(get=self._get)
        self.hub = Hub()
        hello = job_channel_pb2.Hello(device=DEVICE)
        gpu = SimpleNamespace(hello=hello, device_index=0)
        self.job_processes = SimpleNamespace(by_id={"d0-w0": gpu})
        self.compile_cache = CompileCache(1 << 20)
        self.max_timeout_s = 600.0
        self.built: dict[str, tuple[str, str, Outcome]] = {}  # job -> (arch, by, answer)
        # What the node's build processes could take in the dispatch each answer starts.
        self.local_while_answered: list[list[str]] = []
        self.dispatched = 0
        self.artifacts: SharedArtifacts | None = None

    def _get(self, job_id: str) -> job_pb2.Job | None:
        s = self.specs.get(job_id)
        return job_pb2.Job(job_id=job_id, spec=s) if s is not None else None

    def add(self, job_id: str, s: kernel_pb2.JobSpec) -> None:
        self.specs[job_id] = s
        self.queue.add(job_id)
        self.offer()

    def offer(self) -> None:
        assert self.artifacts is not None
        self.artifacts.offer_ahead([(j, ARCH) for j in sorted(self.queue)])

    def local(self) -> list[str]:
        """Queued jobs the node's own build processes may take now."""
        assert self.artifacts is not None
        return sorted(j for j in self.queue if self.artifacts.builds_here(j))

    def built_elsewhere(self, job_id: str, arch: str, built_by: str, built: Outcome) -> None:
        if job_id in self.queue:
            self.queue.discard(job_id)
            self.built[job_id] = (arch, built_by, built)
            # As JobManager's: the job goes on (_on_built), which dispatches.
            self.offer()
            self.local_while_answered.append(self.local())

    def dispatch(self) -> None:
        self.dispatched += 1
        self.offer()


class Node:
    def __init__(self, store: PostgresStore, root: Path, name: str, wait_s: float = 5.0) -> None:
        self.builds = ExtensionBuilds(BuildCache(root / name, 1 << 20))
        self.host = Host(store)
        self.artifacts = SharedArtifacts(
            store, self.builds, name, wait_s=wait_s, keep_s=0, answer=lambda _: None,
            say=lambda *_: None, dispatch=lambda: None, host=self.host,
        )  # fmt: skip
        self.host.artifacts = self.artifacts
        self.versions = self.builds.versions_of(DEVICE.torch_version, DEVICE.cuda_version)

    def key(self, s: kernel_pb2.JobSpec) -> str:
        return ahead_builds.key(s, ARCH, self.versions)

    def logs(self, job_id: str) -> list[str]:
        return self.host.hub.logs.get(job_id, [])


def fake_build(s: kernel_pb2.JobSpec, arch: str, by: str) -> Outcome:
    out = Outcome()
    if "COMPILE_ERROR" in s.kernel.source_code:
        out.result.verdict = job_pb2.VERDICT_COMPILE_ERROR
        out.result.compilation_error = f"error: built by {by}"
        return out
    for role in ["kernel", *(["reference"] if s.HasField("reference") else [])]:
        out.artifacts.add(role=role, cubin=f"\x7fELF by {by}".encode(), function="add", arch=arch)
    return out


def builder(
    store: PostgresStore, root: Path, name: str, *, torch_version: str = DEVICE.torch_version,
    lease_s: float = 5.0, builds_now: bool = True, slots: int = 1,
) -> BuilderNode:  # fmt: skip
    """A builder whose build processes answer at once (builds_now=False: take the build and
    never answer, as a builder that hangs or dies mid-build)."""
    builds = ExtensionBuilds(BuildCache(root / name, 1 << 20))
    holder: list[BuilderNode] = []

    def dispatch() -> None:
        while builds_now and (build := builds.next_build()) is not None:
            worker = SimpleNamespace(worker_id=f"{name}-build-{build.key[:6]}")
            builds.started(build, worker)
            given, call = builds.assignment(build)  # what the build process is sent
            assert call is None and build.arch == ARCH and given == build.spec
            builds.finished_build(worker, fake_build(given, build.arch, holder[0].builder_id))

    node = BuilderNode(
        store, builds, url=store.url, lease_s=lease_s, torch_version=torch_version,
        cuda_version=DEVICE.cuda_version, slots=slots, idle=lambda: slots, dispatch=dispatch,
    )  # fmt: skip
    holder.append(node)
    return node


@pytest.fixture
def store(postgres: PostgresServer) -> Iterator[PostgresStore]:
    s = PostgresStore(postgres.new_database(), shared=True)
    try:
        yield s
    finally:
        s.close()


async def until(what: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
    return got


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 60))


def test_builders_build_triton_and_cuda_jobs_and_nodes_only_launch(
    store: PostgresStore, tmp_path: Path
) -> None:
    async def scenario() -> None:
        b = builder(store, tmp_path, "b1", slots=2)
        b.start()
        await until(lambda: b.registered)
        node = Node(store, tmp_path, "node-1")
        node.artifacts.refresh()
        triton, cuda = spec("triton"), spec("cuda")
        node.host.add("tri-1", triton)
        node.host.add("tri-2", triton)  # the same code: joins the first one's request
        node.host.add("cuda-1", cuda)
        # While the builders are asked, the node's own build processes take none of them.
        assert node.host.local() == []
        await until(lambda: len(node.host.built) == 3)
        assert node.host.local() == [] and node.host.dispatched == 0
        # While one job's answer is handed over (its dispatch), the other job with that code
        # is not given to the node's build processes: it gets the builder's answer too.
        assert node.host.local_while_answered == [[], [], []]
        for job_id in ("tri-1", "tri-2", "cuda-1"):
            arch, by, answer = node.host.built[job_id]
            assert (arch, by) == (ARCH, b.builder_id)
            assert [a.cubin for a in answer.artifacts] == [f"\x7fELF by {by}".encode()]
            assert not answer.HasField("result") and not answer.run_whole
            logs = node.logs(job_id)
            assert f"kerneleval: built ahead: from the shared artifact store (built by {by})" in (
                logs
            ), logs
        assert "kerneleval: built ahead asked of the builders (1 live)" in node.logs("tri-1")
        assert b.ahead_counts["built"] == 2 and b.counts["built"] == 2  # two keys, two builds
        assert node.artifacts.ahead_counts == {"store": 0, "builders": 3, "here": 0,
                                               "published": 0}  # fmt: skip
        for s in (triton, cuda):
            found = store.artifact(node.key(s))
            assert found is not None and found[1] == b.builder_id
            assert store.build_request(node.key(s)) is None  # done
            kept = Outcome.FromString(found[0])  # what a local build process answers
            assert [a.role for a in kept.artifacts] == ["kernel"] and not kept.job_id
        # The key is the code, the architecture and the versions: the tenant, labels and
        # options are not part of it; a request carries the sources only.
        other = spec("triton", salt=triton.kernel.source_code.split("# ")[-1].strip())
        other.client_tag, other.options.perf_trial_count = "tenant-b", 1
        assert node.key(other) == node.key(triton) != ahead_builds.key(triton, "sm_80", "x")
        request = ahead_builds.request_arguments(triton)
        assert "tenant-a" not in request and "r1" not in request

        # Another node: an identical job comes from the store at once; nobody builds again.
        again = Node(store, tmp_path, "node-2")
        again.artifacts.refresh()
        again.host.add("tri-3", other)
        await until(lambda: again.host.built)
        assert again.host.built["tri-3"][1] == b.builder_id
        assert not any("asked of the builders" in t for t in again.logs("tri-3"))
        assert b.ahead_counts["built"] == 2 and store.waiting_builds() == []

        # A builder computes the key itself: a request whose key is not what its sources build
        # to, or sources that are not built ahead, are refused and never built.
        store.request_build(
            "f" * 64, node.versions, ARCH, ahead_builds.request_arguments(spec("cuda")), "n"
        )  # fmt: skip
        whole = spec("cuda")
        whole.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
        store.request_build(
            "e" * 64, node.versions, ARCH, ahead_builds.request_arguments(whole), "n"
        )  # fmt: skip
        forged = await until(lambda: store.build_request("f" * 64).state == BUILD_REFUSED)
        assert forged
        refused = store.build_request("f" * 64)
        assert refused is not None and "the key is not what the sources build to" in refused.error
        await until(lambda: store.build_request("e" * 64).state == BUILD_REFUSED)
        assert store.artifact("f" * 64) is None and store.artifact("e" * 64) is None
        assert b.ahead_counts["refused"] == 2 and b.ahead_counts["built"] == 2
        await b.stop()

    run(scenario)


def test_a_build_that_ends_the_job_answers_it_and_keeps_nothing(
    store: PostgresStore, tmp_path: Path
) -> None:
    """A compile error is the job's answer, as from a build process of its node; as there,
    nothing is kept: the next job with that code is built again."""

    async def scenario() -> None:
        b = builder(store, tmp_path, "b1")
        b.start()
        await until(lambda: b.registered)
        node = Node(store, tmp_path, "node-1")
        node.artifacts.refresh()
        bad = spec("cuda", salt="COMPILE_ERROR")
        node.host.add("bad-1", bad)
        await until(lambda: node.host.built)
        arch, by, answer = node.host.built["bad-1"]
        assert by == b.builder_id and not answer.artifacts
        assert answer.result.verdict == job_pb2.VERDICT_COMPILE_ERROR
        assert answer.result.compilation_error == f"error: built by {b.builder_id}"
        assert store.artifact(node.key(bad)) is None and store.build_request(node.key(bad)) is None
        assert b.ahead_counts["failed"] == 1 and node.host.dispatched == 0
        node.host.add("bad-2", bad)
        await until(lambda: "bad-2" in node.host.built)
        assert b.ahead_counts["failed"] == 2
        await b.stop()

    run(scenario)


def test_a_builder_of_other_versions_is_not_used_and_the_node_builds_it(
    store: PostgresStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        odd = builder(store, tmp_path, "odd", torch_version="2.99.0")
        odd.start()
        await until(lambda: odd.registered)
        node = Node(store, tmp_path, "node-1")
        node.artifacts.refresh()
        s = spec("triton")
        node.host.add("tri-1", s)
        # Not asked: the node's own build processes get it, and its log says why.
        assert await until(lambda: node.host.local() == ["tri-1"])
        assert node.host.dispatched == 1 and not node.host.built
        assert store.build_request(node.key(s)) is None and odd.counts["built"] == 0
        assert any("no live builder has this node's versions" in t for t in node.logs("tri-1"))
        node.artifacts.refresh()
        assert "does not build for this node" in caplog.text
        # A request of the node's versions is never taken by that builder.
        store.request_build(node.key(s), node.versions, ARCH, ahead_builds.request_arguments(s),
                            "node-1")  # fmt: skip
        assert odd.claim() == 0
        store.drop_build_request(node.key(s))
        # Built here (the manager's _on_built): into the store for the other nodes.
        node.host.queue.discard("tri-1")
        built = fake_build(s, ARCH, "node-1")
        node.artifacts.kept_ahead("tri-1", s, ARCH, built)
        found = await until(lambda: store.artifact(node.key(s)))
        assert found[1] == "node-1" and Outcome.FromString(found[0]) == built
        assert node.artifacts.ahead_counts["here"] == 1
        assert node.artifacts.ahead_counts["published"] == 1
        # A job whose build this node's compile cache holds is not looked for elsewhere.
        node.host.compile_cache.store(s, built_key(ARCH), [], as_files(list(built.artifacts)))
        node.host.add("tri-2", s)
        assert node.host.local() == ["tri-2"]
        await odd.stop()

    run(scenario)


async def builder_dies_holding_the_build(
    store: PostgresStore, tmp_path: Path, wait_s: float
) -> tuple[Node, BuilderNode, float, kernel_pb2.JobSpec]:
    dying = builder(store, tmp_path, "dying", lease_s=0.6, builds_now=False)
    dying.start()
    await until(lambda: dying.registered)
    node = Node(store, tmp_path, "node-1", wait_s=wait_s)
    node.artifacts.refresh()
    s = spec("cuda")
    began = time.monotonic()
    node.host.add("cuda-1", s)
    await until(lambda: dying.held)
    for task in dying._tasks:  # SIGKILL: no lease renewed, nothing given back
        task.cancel()
    return node, dying, began, s


def test_a_builder_lost_mid_build_has_the_job_built_by_another(
    store: PostgresStore, tmp_path: Path
) -> None:
    async def scenario() -> None:
        node, dying, _, s = await builder_dies_holding_the_build(store, tmp_path, wait_s=3.0)
        held = store.build_request(node.key(s))
        assert held is not None and held.lease_builder == dying.builder_id
        rescuer = builder(store, tmp_path, "rescuer", lease_s=0.6)
        rescuer.start()
        await until(lambda: node.host.built)
        assert node.host.built["cuda-1"][1] == rescuer.builder_id
        assert node.host.local() == [] and node.host.dispatched == 0
        found = store.artifact(node.key(s))
        assert found is not None and found[1] == rescuer.builder_id
        await rescuer.stop()

    run(scenario)


def test_with_no_builder_left_the_node_builds_the_job_itself(
    store: PostgresStore, tmp_path: Path
) -> None:
    async def scenario() -> None:
        node, _, began, s = await builder_dies_holding_the_build(store, tmp_path, wait_s=0.5)
        # The lease expires (0.6 s) and nobody holds it for --builder-wait-s (0.5 s).
        await until(lambda: node.host.local() == ["cuda-1"])
        took = time.monotonic() - began
        assert 1.0 < took < 5.0, took
        assert node.host.dispatched == 1 and not node.host.built
        assert any("no builder held it for 0.5 s" in t for t in node.logs("cuda-1"))
        assert store.build_request(node.key(s)) is None

    run(scenario)


def test_a_builder_that_holds_a_build_past_the_jobs_timeout_is_not_waited_for(
    store: PostgresStore, tmp_path: Path
) -> None:
    """A build that would have timed out here is built here after the job's timeout (its
    own build then ends the job as a build here does); a cancelled job is no longer asked."""

    async def scenario() -> None:
        hanging = builder(store, tmp_path, "hanging", lease_s=0.6, builds_now=False, slots=2)
        hanging.start()
        await until(lambda: hanging.registered)
        node = Node(store, tmp_path, "node-1", wait_s=0.5)
        node.artifacts.refresh()
        node.host.add("slow-1", spec("cuda", timeout_s=1))
        await until(lambda: hanging.held)
        began = time.monotonic()
        await until(lambda: node.host.local() == ["slow-1"])
        assert time.monotonic() - began < 3.0
        assert any("did not build it within 1.5 s" in t for t in node.logs("slow-1"))
        # A job taken out of the queue (cancelled) while the builders are asked: forgotten.
        node.host.add("gone-1", spec("cuda"))
        await until(lambda: len(hanging.held) == 2)
        node.host.queue.discard("gone-1")
        node.host.offer()
        assert node.artifacts.builds_here("gone-1") and "gone-1" not in node.host.built
        await hanging.stop()

    run(scenario)


def test_a_store_that_cannot_be_reached_means_built_here(
    store: PostgresStore, postgres: PostgresServer, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The node's connection to the shared store is gone (its pool closed): a job built ahead
    goes to the node's own build processes, and what they build is kept locally only."""

    async def scenario() -> None:
        b = builder(store, tmp_path, "b1")
        b.start()
        await until(lambda: b.registered)
        lost = PostgresStore(store.url, shared=True)
        node = Node(lost, tmp_path, "node-1")
        node.artifacts.refresh()  # a live builder of this node's versions: it would be asked
        assert node.artifacts.can_build(node.versions)
        lost.close()
        s = spec("triton")
        node.host.add("tri-1", s)
        await until(lambda: node.host.local() == ["tri-1"])
        assert node.host.dispatched == 1 and not node.host.built
        assert node.artifacts.ahead_counts["here"] == 1
        assert "shared artifact store:" in caplog.text
        node.host.queue.discard("tri-1")
        node.artifacts.kept_ahead("tri-1", s, ARCH, fake_build(s, ARCH, "node-1"))
        await until(lambda: "not shared" in caplog.text)
        assert store.artifact(node.key(s)) is None and store.waiting_builds() == []
        assert b.counts["built"] == 0
        await b.stop()

    run(scenario)


def test_only_artifacts_of_the_jobs_shape_and_architecture_are_kept_or_read(
    store: PostgresStore, tmp_path: Path
) -> None:
    """What the shared store holds under a job's key is used only if it is one cubin per
    source for the node's architecture; otherwise the job is built (here: by the builder, and
    its answer read back from the request's end, then the node's own if that is unusable)."""
    s = spec("cuda")
    s.reference.CopyFrom(s.kernel)
    good = fake_build(s, ARCH, "x")
    assert ahead_builds.kept(s, ARCH, good) is not None
    assert ahead_builds.read_kept(s, ARCH, ahead_builds.kept(s, ARCH, good) or b"") == good
    wrong_arch = fake_build(s, "sm_80", "x")
    kernel_only = fake_build(spec("cuda"), ARCH, "x")
    not_a_cubin = fake_build(s, ARCH, "x")
    not_a_cubin.artifacts[1].cubin = b"#!/bin/sh"
    with_job = fake_build(s, ARCH, "x")
    with_job.job_id = "another-job"
    for bad in (wrong_arch, kernel_only, not_a_cubin):
        assert ahead_builds.kept(s, ARCH, bad) is None
        assert ahead_builds.read_kept(s, ARCH, bad.SerializeToString()) is None
    assert ahead_builds.read_kept(s, ARCH, with_job.SerializeToString()) is None
    assert ahead_builds.read_kept(s, ARCH, b"\xff not a message") is None
    whole = Outcome(run_whole="autotuned")
    assert ahead_builds.read_kept(s, ARCH, ahead_builds.kept(s, ARCH, whole) or b"") == whole

    async def scenario() -> None:
        node = Node(store, tmp_path, "node-1")
        store.put_artifact(node.key(s), wrong_arch.SerializeToString(), node.versions, "evil")
        node.artifacts.refresh()  # no builder: the node builds it
        node.host.add("cuda-1", s)
        await until(lambda: node.host.local() == ["cuda-1"])
        assert not node.host.built and node.artifacts.ahead_counts["here"] == 1

    run(scenario)
