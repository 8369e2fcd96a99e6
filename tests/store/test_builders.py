"""`--role builder` and the shared artifact store (jobs/builds/artifact_store.py,
builder_node.py) on a real PostgreSQL server, in one process: a node's ExtensionBuilds and
SharedArtifacts, builders'
ExtensionBuilds and BuilderNode, one store. The build processes are acted out (a "build" hands
the queued build its library at once), so what is tested is the protocol: who builds, what the
node receives, versions, leases. The service processes' own path (a real builder, a real node,
a real load_inline) is tests/store/test_builder_service.py."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server.fast_build import extension
from kerneleval_server.jobs.builds.artifact_store import SharedArtifacts
from kerneleval_server.jobs.builds.build_cache import BuildCache
from kerneleval_server.jobs.builds.builder_node import BuilderNode
from kerneleval_server.jobs.builds.extension_builds import ExtensionBuilds, Waiter
from kerneleval_server.jobs.store import PostgresStore
from kerneleval_server.jobs.store.base import BUILD_REFUSED
from pg_server import PostgresServer

DEVICE = job_pb2.DeviceInfo(torch_version="2.11.0", cuda_version="13.0")
ARCH = "sm_90"
CALL = {"name": "ext", "cpp_sources": ["int f();"], "functions": ["f"], "extra_cflags": ["-O3"]}
Built = job_channel_pb2.ExtensionBuilt
Answers = list[tuple[Waiter, Built]]


def request(call: dict[str, Any], request_id: int = 1) -> job_channel_pb2.ExtensionRequest:
    return job_channel_pb2.ExtensionRequest(
        job_id="j", request_id=request_id,
        call=job_channel_pb2.ExtensionCall(arguments_json=json.dumps(call)),
    )  # fmt: skip


@pytest.fixture
def store(postgres: PostgresServer) -> Iterator[PostgresStore]:
    s = PostgresStore(postgres.new_database(), shared=True)
    try:
        yield s
    finally:
        s.close()


class Node:
    """A node's load_inline side: what its jobs got, what their logs said."""

    def __init__(self, store: PostgresStore, root: Path, name: str, wait_s: float = 5.0) -> None:
        self.builds = ExtensionBuilds(BuildCache(root / name, 1 << 20))
        self.answers: Answers = []
        self.said: list[str] = []
        self.dispatched = 0
        self.artifacts = SharedArtifacts(
            store, self.builds, name, wait_s=wait_s, keep_s=0,
            answer=self.answers.extend, say=lambda _, text: self.said.append(text),
            dispatch=self._dispatch,
        )  # fmt: skip

    def _dispatch(self) -> None:
        self.dispatched += 1

    def ask(self, job_id: str, call: dict[str, Any] = CALL) -> Built | None:
        return self.builds.request(Waiter(job_id, object(), 1), request(call), DEVICE, ARCH, True)


def builder(
    store: PostgresStore, root: Path, name: str, *, torch_version: str = DEVICE.torch_version,
    lease_s: float = 5.0, builds_now: bool = True, slots: int = 1,
) -> BuilderNode:  # fmt: skip
    """A builder whose one build process answers at once with a library naming the builder
    (builds_now=False: it takes the build and never answers, as a builder that hangs or dies
    mid-build)."""
    builds = ExtensionBuilds(BuildCache(root / name, 1 << 20))
    holder: list[BuilderNode] = []

    def dispatch() -> None:
        build = builds.next_build() if builds_now else None
        if build is None:
            return
        worker = SimpleNamespace(worker_id=f"{name}-build")
        builds.started(build, worker)
        lib = f"lib built by {holder[0].builder_id}".encode()
        out = job_channel_pb2.ExtensionBuilt(library=lib, fast=True)
        out.build_time.FromNanoseconds(1_000_000_000)
        builds.finished(worker, out)

    node = BuilderNode(
        store, builds, url=store.url, lease_s=lease_s, torch_version=torch_version,
        cuda_version=DEVICE.cuda_version, slots=slots, idle=lambda: slots, dispatch=dispatch,
    )  # fmt: skip
    holder.append(node)
    return node


async def until(what: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)
    return got


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 60))


def test_a_builder_builds_and_the_node_only_loads(store: PostgresStore, tmp_path: Path) -> None:
    async def scenario() -> None:
        b = builder(store, tmp_path, "b1")
        b.start()
        node = Node(store, tmp_path, "node-1")
        await until(lambda: b.registered)
        node.artifacts.refresh()
        assert [x.builder_id for x in node.artifacts.builders] == [b.builder_id]

        assert node.ask("job-a") is None  # waits
        assert node.ask("job-b") is None  # joins the same build
        await until(lambda: len(node.answers) == 2)
        libs = {a.library for _, a in node.answers}
        assert libs == {f"lib built by {b.builder_id}".encode()}
        assert sorted(a.job_id for _, a in node.answers) == ["job-a", "job-b"]
        # The node built nothing: no local build, none queued for its build processes.
        assert node.builds.built == 0 and not node.builds.queue and node.dispatched == 0
        assert b.counts["built"] == 1 and node.artifacts.counts["builders"] == 1
        assert node.artifacts.counts["here"] == 0
        assert any(f"built by {b.builder_id}" in t for t in node.said), node.said
        key = extension.call_key(CALL, node.builds._target(DEVICE, ARCH))
        found = store.artifact(key)
        assert found is not None and found[1] == b.builder_id
        lib = job_channel_pb2.ExtensionBuilt.FromString(found[0]).library
        assert lib == f"lib built by {b.builder_id}".encode()
        assert store.build_request(key) is None  # done
        # The next call is the node's own cache; another node finds it in the store, and
        # nobody builds it again.
        again = node.ask("job-c")
        assert again is not None and again.cache_hit and again.library == lib
        other = Node(store, tmp_path, "node-2")
        other.artifacts.refresh()
        assert other.ask("job-d") is None
        await until(lambda: other.answers)
        assert other.answers[0][1].library == lib and b.counts["built"] == 1
        assert any("from the shared artifact store" in t for t in other.said)
        await b.stop()
        assert store.builders() == []

    run(scenario)


def test_versions_that_differ_are_refused(
    store: PostgresStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        odd = builder(store, tmp_path, "odd", torch_version="2.99.0")
        odd.start()
        await until(lambda: odd.registered)
        node = Node(store, tmp_path, "node-1")
        node.artifacts.refresh()
        # The node sees the builder, knows it is not for its versions, and builds the call
        # itself without asking (its build processes), saying why.
        assert node.ask("job-a") is None
        await until(lambda: node.builds.queue)
        key = extension.call_key(CALL, node.builds._target(DEVICE, ARCH))
        assert store.build_request(key) is None and node.dispatched == 1
        assert any("no live builder has this node's versions" in t for t in node.said)
        node.artifacts.refresh()
        assert "does not build for this node" in caplog.text and odd.builder_id in caplog.text
        # A request of the node's versions is never taken by that builder, which says so.
        versions = node.builds.versions_of(DEVICE.torch_version, DEVICE.cuda_version)
        store.request_build(key, versions, ARCH, json.dumps(CALL), "node-1")
        assert odd.claim() == 0 and odd.counts["built"] == 0
        odd.beat()
        assert f"wait for versions {versions!r}" in caplog.text
        # A builder whose versions string matches still computes the key itself: a request
        # whose key is not what its arguments build to is refused, never built.
        same = builder(store, tmp_path, "same", slots=2)
        store.request_build("f" * 64, versions, ARCH, json.dumps(CALL), "node-1")
        assert same.claim() == 2  # the real one and the forged one
        forged = store.build_request("f" * 64)
        assert forged is not None and forged.state == BUILD_REFUSED
        assert "the key is not what the arguments build to" in forged.error
        assert store.artifact("f" * 64) is None
        assert same.counts == {"built": 1, "failed": 0, "refused": 1, "cached": 0}
        await until(lambda: store.artifact(key) is not None)
        await odd.stop()

    run(scenario)


async def builder_dies_holding_the_build(
    store: PostgresStore, tmp_path: Path, wait_s: float
) -> tuple[Node, BuilderNode, float]:
    """A node (`--builder-wait-s` wait_s) asks for job-a's build; the one builder takes it and
    dies (SIGKILL: nothing given back). The node, the dead builder, when the node asked."""
    dying = builder(store, tmp_path, "dying", lease_s=0.6, builds_now=False)
    dying.start()
    await until(lambda: dying.registered)
    node = Node(store, tmp_path, "node-1", wait_s=wait_s)
    node.artifacts.refresh()
    began = time.monotonic()
    assert node.ask("job-a") is None
    await until(lambda: dying.held)
    for task in dying._tasks:
        task.cancel()
    return node, dying, began


def test_a_builder_lost_mid_build_has_its_request_taken_again(
    store: PostgresStore, tmp_path: Path
) -> None:
    async def scenario() -> None:
        node, dying, _ = await builder_dies_holding_the_build(store, tmp_path, wait_s=3.0)
        key = extension.call_key(CALL, node.builds._target(DEVICE, ARCH))
        held = store.build_request(key)
        assert held is not None and held.lease_builder == dying.builder_id
        # Another builder starts; once the dead one's lease expires it takes the request.
        rescuer = builder(store, tmp_path, "rescuer", lease_s=0.6)
        rescuer.start()
        await until(lambda: node.answers)
        assert node.answers[0][1].library == f"lib built by {rescuer.builder_id}".encode()
        found = store.artifact(key)
        assert found is not None and found[1] == rescuer.builder_id
        assert node.builds.built == 0 and not node.builds.queue
        await rescuer.stop()

    run(scenario)


def test_with_no_builder_left_the_node_builds_it_itself(
    store: PostgresStore, tmp_path: Path
) -> None:
    async def scenario() -> None:
        node, _, began = await builder_dies_holding_the_build(store, tmp_path, wait_s=0.5)
        # The lease expires (0.6 s) and nobody holds it for --builder-wait-s (0.5 s): the
        # node's own build processes get it.
        build = await until(lambda: node.builds.next_build(), timeout=10)
        took = time.monotonic() - began
        assert build.waiters and build.waiters[0].job_id == "job-a"
        assert 1.0 < took < 5.0, took
        assert node.dispatched == 1 and not node.answers
        assert any("no builder held it" in t for t in node.said), node.said
        # Built here, it goes to the store for the others.
        worker = SimpleNamespace(worker_id="node-build")
        node.builds.started(build, worker)
        answers = node.builds.finished(worker, job_channel_pb2.ExtensionBuilt(library=b"mine"))
        assert [a.library for _, a in answers] == [b"mine"]
        data, built_by = await until(lambda: store.artifact(build.key))
        assert built_by == "node-1"
        assert job_channel_pb2.ExtensionBuilt.FromString(data).library == b"mine"

    run(scenario)


def test_a_failed_build_answers_the_jobs_with_its_error(
    store: PostgresStore, tmp_path: Path
) -> None:
    async def scenario() -> None:
        b = builder(store, tmp_path, "b1", builds_now=False)
        b.start()
        await until(lambda: b.registered)
        node = Node(store, tmp_path, "node-1")
        node.artifacts.refresh()
        assert node.ask("job-a") is None
        await until(lambda: b.held)
        build = b.builds.next_build()
        assert build is not None
        worker = SimpleNamespace(worker_id="b1-build")
        b.builds.started(build, worker)
        b.builds.lost(worker, "exited (killed)")  # its build process died
        (_, answer), = await until(lambda: node.answers)  # fmt: skip
        assert "the build process exited (killed)" in answer.error and not answer.library
        assert node.builds.built == 0 and not node.builds.queue
        assert store.artifact(build.key) is None  # nothing kept
        await b.stop()

    run(scenario)


def test_without_builders_nothing_changes_but_the_store_is_read_first(
    store: PostgresStore, tmp_path: Path
) -> None:
    """No builder: the node's build processes get the build at once (no request, no wait);
    without build processes either, the job builds it itself (build_here), as before. With a
    builder, a node without build processes has it built there."""

    async def scenario() -> None:
        node = Node(store, tmp_path, "node-1")
        node.artifacts.refresh()
        began = time.monotonic()
        assert node.ask("job-a") is None
        build = await until(lambda: node.builds.next_build())
        assert time.monotonic() - began < 0.5 and node.dispatched == 1
        assert store.build_request(build.key) is None and store.waiting_builds() == []
        here = node.builds.request(Waiter("job-b", object(), 1), request({**CALL, "name": "e2"}),
                                   DEVICE, ARCH, builders=False)  # fmt: skip
        assert here is not None and here.build_here
        b = builder(store, tmp_path, "b1")
        b.start()
        await until(lambda: b.registered)
        node.artifacts.refresh()
        waits = node.builds.request(Waiter("job-c", object(), 1), request({**CALL, "name": "e3"}),
                                    DEVICE, ARCH, builders=False)  # fmt: skip
        assert waits is None
        (_, answer), = await until(lambda: node.answers)  # fmt: skip
        assert answer.library == f"lib built by {b.builder_id}".encode() and not answer.build_here
        await b.stop()

    run(scenario)
