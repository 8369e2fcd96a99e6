"""The shared, content-addressed artifact store of a `--role node`: load_inline builds found in
PostgreSQL, or asked of `--role builder`s, before this node builds them itself.

The store keeps what a load_inline call builds to (the serialized ExtensionBuilt that the local
build cache keeps: the library, or the compile error) in `artifacts`, by the same content key
(`extension.call_key`: the call's arguments and the target: torch, CUDA, the architecture, the
compilers, the builder's recipe). For a call its local cache does not hold
(`ExtensionBuilds.request`, which hands the build here: `resolve`), a node:
1. reads `artifacts` for the key: another node or a builder built it (a hit is kept in the
   local cache too);
2. else, when a live builder registered exactly this node's versions (`builders`, refreshed
   with each heartbeat), writes a build request (key, versions, architecture, arguments) and
   waits: a builder takes it with a lease (`SELECT ... FOR UPDATE SKIP LOCKED`, builder_node.py)
   and writes the artifact, which NOTIFYs `kerneleval_artifacts`; the node also reads the
   request every POLL_S. A build that fails on the builder (its build process lost, past its
   time) answers the jobs with that failure, as a local one does;
3. else, and when no builder holds the request for `--builder-wait-s` (none free, or the one
   that took it was lost: its lease expired), or the builder refused it, builds it here as
   before: its own build processes, or the job's own process (`build_here`) where it has none.
What the node builds itself goes into the store too, for the other nodes.

Versions are never assumed: a builder registers the versions it builds with (probed from the
build processes' own Python: torch, CUDA; the compilers; the recipe) and takes only requests
of exactly those; it also computes the key again from the arguments and its own target and
refuses a request whose key differs. A node logs each live builder whose versions are not its
own (and says so in the job's log when it builds a call itself for that reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2

from .extension_builds import BUILD_TIMEOUT_S, Build, ExtensionBuilds, Waiter
from .store import JobStore
from .store.base import BUILD_FAILED, BUILD_REFUSED, Builder

log = logging.getLogger("kerneleval.artifacts")

POLL_S = 0.5  # a waiting node reads its build request this often besides the NOTIFYs
FORGET_EVERY_S = 600.0  # how often a node drops artifacts unused for the retention time

Answers = list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]


class SharedArtifacts:
    """A node's side of the shared artifact store (ExtensionBuilds.remote)."""

    def __init__(
        self,
        store: JobStore,
        builds: ExtensionBuilds,
        node_id: str,
        *,
        wait_s: float,
        keep_s: float,
        answer: Callable[[Answers], None],
        say: Callable[[list[Waiter], str], None],
        dispatch: Callable[[], None],
    ) -> None:
        self.store = store
        self.builds = builds
        builds.remote = self
        self.node_id = node_id
        self.wait_s = wait_s  # --builder-wait-s
        self.keep_s = keep_s  # artifacts unused this long are dropped (--retention-hours)
        self.answer = answer  # sends each waiting job its answer (JobManager)
        self.say = say  # a line in the waiting jobs' logs
        self.dispatch = dispatch
        self.builders: list[Builder] = []
        self.versions_here: set[str] = set()  # the versions this node's jobs asked with
        self.counts = {"store": 0, "builders": 0, "here": 0, "published": 0}
        self._told: dict[str, str] = {}  # builder id -> the versions logged as not this node's
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._forgot = time.monotonic()

    # ---- the heartbeat and the LISTEN connection (SharedQueue.on_beat, on_note) -------------

    def refresh(self) -> None:
        """Live builders, as they registered; a builder whose versions are not this node's is
        logged once (it never takes this node's requests)."""
        self.builders = self.store.builders()
        for b in self.builders:
            if not self.versions_here or b.versions in self.versions_here:
                continue
            if self._told.get(b.builder_id) != b.versions:
                self._told[b.builder_id] = b.versions
                log.warning(
                    "builder %s does not build for this node: its versions %r are not this "
                    "node's %s",
                    b.builder_id, b.versions, sorted(self.versions_here),
                )  # fmt: skip
        if self.keep_s > 0 and time.monotonic() - self._forgot > FORGET_EVERY_S:
            self._forgot = time.monotonic()
            dropped = self.store.forget_artifacts_before(time.time() - self.keep_s)
            if dropped:
                log.info("dropped %d artifacts of the shared store unused for long", dropped)

    def wake(self, key: str) -> None:
        """The store NOTIFYed: an artifact written, or a build request ended."""
        event = self._wake.get(key)
        if event is not None:
            event.set()

    # ---- ExtensionBuilds.remote ---------------------------------------------------------------

    def can_build(self, versions: str) -> bool:
        self.versions_here.add(versions)
        return any(b.versions == versions for b in self.builders)

    def resolve(self, build: Build, local: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._resolve(build, local))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def kept(self, build: Build, data: bytes) -> None:
        """Built here: into the shared store for the other nodes."""
        task = asyncio.get_running_loop().create_task(self._publish(build, data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def failed(self, build: Build, error: str) -> None:
        """Built here and nothing kept: nothing to share."""

    # ---- one build ----------------------------------------------------------------------------

    async def _resolve(self, build: Build, local: bool) -> None:
        try:
            found = await asyncio.to_thread(self.store.artifact, build.key)
            if found is not None and self._deliver(build, *found):
                return
            if self.can_build(build.versions):
                if await self._ask_builders(build):
                    return
            elif self.builders and build.waiters:
                self.say(
                    build.waiters,
                    f"kerneleval: load_inline: no live builder has this node's versions "
                    f"({build.versions}): built here",
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is away: built here as before
            log.warning("shared artifact store: %s; building %s here", exc, build.key[:16])
        self._here(build, local)

    def _deliver(self, build: Build, data: bytes, built_by: str) -> bool:
        answers = self.builds.delivered(build, data)
        if answers is None:
            log.warning("shared artifact %s unreadable: built again", build.key[:16])
            return False
        by_builder = any(b.builder_id == built_by for b in self.builders)
        self.counts["builders" if by_builder else "store"] += 1
        self.say(
            build.waiters,
            f"kerneleval: load_inline from the shared artifact store (built by {built_by})",
        )
        self.answer(answers)
        return True

    async def _ask_builders(self, build: Build) -> bool:
        """Asks the builders; True once the build's waiters are answered (or gone), False when
        it is to be built here."""
        key = build.key
        await asyncio.to_thread(
            self.store.request_build, key, build.versions, build.arch, build.arguments_json,
            self.node_id,
        )  # fmt: skip
        able = sum(1 for b in self.builders if b.versions == build.versions)
        self.say(build.waiters, f"kerneleval: load_inline asked of the builders ({able} live)")
        wake = self._wake.setdefault(key, asyncio.Event())
        alive = time.monotonic()  # when a live builder last held it (or when it was asked)
        end = alive + BUILD_TIMEOUT_S + self.wait_s
        try:
            while True:
                wake.clear()
                if not build.waiters:  # every job that wanted it ended
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    self.builds.ended(build, job_channel_pb2.ExtensionBuilt())
                    return True
                request = await asyncio.to_thread(self.store.build_request, key)
                now = time.monotonic()
                if request is None:  # done: the artifact is there (or another dropped it)
                    found = await asyncio.to_thread(self.store.artifact, key)
                    return found is not None and self._deliver(build, *found)
                if request.state == BUILD_FAILED:
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    failed = job_channel_pb2.ExtensionBuilt(error=request.error)
                    self.answer(self.builds.ended(build, failed))
                    return True
                if request.state == BUILD_REFUSED:
                    log.warning("build %s refused: %s; built here", key[:16], request.error)
                    self.say(build.waiters, f"kerneleval: load_inline: {request.error}")
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return False
                if request.held(time.time()):
                    alive = now
                elif now - alive > self.wait_s or now > end:
                    self.say(
                        build.waiters,
                        f"kerneleval: load_inline: no builder held it for {self.wait_s:g} s "
                        "(none free, or the one that took it was lost): built here",
                    )
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return False
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wake.wait(), POLL_S)
        finally:
            self._wake.pop(key, None)

    def _here(self, build: Build, local: bool) -> None:
        """Built by this node after all: its build processes, else the job's own process."""
        self.counts["here"] += 1
        if not build.waiters:
            self.builds.ended(build, job_channel_pb2.ExtensionBuilt())
        elif local:
            self.builds.build_here(build)
            self.say(build.waiters, "kerneleval: load_inline queued for a build process")
            self.dispatch()
        else:
            self.answer(self.builds.ended(build, job_channel_pb2.ExtensionBuilt(build_here=True)))

    async def _publish(self, build: Build, data: bytes) -> None:
        try:
            await asyncio.to_thread(
                self.store.put_artifact, build.key, data, build.versions, self.node_id
            )
            self.counts["published"] += 1
        except Exception as exc:  # noqa: BLE001 - kept locally; others build it themselves
            log.warning("artifact %s not shared: %s", build.key[:16], exc)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
