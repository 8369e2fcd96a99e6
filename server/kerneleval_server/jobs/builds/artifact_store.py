"""The shared, content-addressed artifact store of a `--role node`: load_inline builds and the
kernels of jobs built ahead, found in PostgreSQL, or asked of `--role builder`s, before this
node builds them itself.

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

A queued job built ahead (prebuild.py: every source a Triton or raw CUDA kernel launched from
its IOContract) takes the same three steps before a build process of this node compiles it
(jobs/builds/ahead_builds.py says what is asked, under which key, and what is kept): JobManager's
dispatch offers each such job (`offer_ahead`) and gives its own build processes only those
this module let go (`builds_here`). A job whose build this node's compile cache holds goes
there at once; for the others, by key (jobs with the same code share one lookup): the store,
then the builders of this node's versions; what comes back (artifacts, or run_whole, or the
result of a build that ended the job) is the job's build answer, as if a build process here had
given it (`JobManager.built_elsewhere`), and the job stays QUEUED until then (a cancel takes it
out of the queue as any queued job). No builder of these versions, none that held it for
`--builder-wait-s`, a refusal, a lost build process, or a wait longer than the job's timeout:
built here. What this node builds itself goes into the store (`kept_ahead`).

Versions are never assumed: a builder registers the versions it builds with (probed from the
build processes' own Python: torch, CUDA; triton; the compilers; the recipes) and takes only
requests of exactly those; it also computes the key again from the arguments and its own target
and refuses a request whose key differs. A node logs each live builder whose versions are not
its own (and says so in the job's log when it builds a call or a job itself for that reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from ..deadline import timeout_of
from ..store import JobStore
from ..store.base import BUILD_FAILED, BUILD_REFUSED, Builder
from . import ahead_builds
from .compile_cache import built_key
from .extension_builds import BUILD_TIMEOUT_S, Build, ExtensionBuilds, Waiter

log = logging.getLogger("kerneleval.artifacts")

POLL_S = 0.5  # a waiting node reads its build request this often besides the NOTIFYs
FORGET_EVERY_S = 600.0  # how often a node drops artifacts unused for the retention time

Answers = list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]


@dataclass
class Asked:
    """How a request to the builders ended: "artifact" (`data`, `built_by`; b"" when the
    request went without one), "failed" (`error`), "here" (build it here) or "gone" (nobody
    wants it any more)."""

    end: str
    data: bytes = b""
    built_by: str = ""
    error: str = ""


@dataclass
class AheadBuild:
    """The build of queued jobs with the same code (one key), asked of the store and builders."""

    key: str
    spec: kernel_pb2.JobSpec
    arch: str
    versions: str
    timeout_s: float
    job_ids: list[str] = field(default_factory=list)


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
        host: ahead_builds.Host | None = None,
    ) -> None:
        self.store = store
        self.builds = builds
        builds.remote = self
        self.host = host  # the job manager: jobs built ahead (None: load_inline only)
        self.node_id = node_id
        self.wait_s = wait_s  # --builder-wait-s
        self.keep_s = keep_s  # artifacts unused this long are dropped (--retention-hours)
        self.answer = answer  # sends each waiting job its answer (JobManager)
        self.say = say  # a line in the waiting jobs' logs
        self.dispatch = dispatch
        self.builders: list[Builder] = []
        self.versions_here: set[str] = set()  # the versions this node's jobs asked with
        self.counts = {"store": 0, "builders": 0, "here": 0, "published": 0}
        # Jobs built ahead: found in the store, built by builders, built here, published.
        self.ahead_counts = {"store": 0, "builders": 0, "here": 0, "published": 0}
        self._ahead: dict[str, AheadBuild] = {}  # by key: asked of the store and builders
        self._ahead_of: dict[str, str] = {}  # queued job -> its build's key ("": built here)
        self._ahead_versions = ""  # this node's versions for jobs built ahead, once known
        self._delivering = ""  # the job whose build answer is being handed over
        self._told: dict[str, str] = {}  # builder id -> the versions logged as not this node's
        self._wake: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._forgot = time.monotonic()

    # ---- the heartbeat and the LISTEN connection (SharedQueue.on_beat, on_note) -------------

    def refresh(self) -> None:
        """Live builders, as they registered; a builder whose versions are not this node's is
        logged once (it never takes this node's requests)."""
        self.builders = self.store.builders()
        self._tell_others()
        if self.keep_s > 0 and time.monotonic() - self._forgot > FORGET_EVERY_S:
            self._forgot = time.monotonic()
            dropped = self.store.forget_artifacts_before(time.time() - self.keep_s)
            if dropped:
                log.info("dropped %d artifacts of the shared store unused for long", dropped)

    def _tell_others(self) -> None:
        """Logs (once per builder) each live builder whose versions are not this node's."""
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

    def wake(self, key: str) -> None:
        """The store NOTIFYed: an artifact written, or a build request ended."""
        event = self._wake.get(key)
        if event is not None:
            event.set()

    # ---- ExtensionBuilds.remote ---------------------------------------------------------------

    def can_build(self, versions: str) -> bool:
        if versions not in self.versions_here:  # first asked with these: say it at once
            self.versions_here.add(versions)
            self._tell_others()
        return any(b.versions == versions for b in self.builders)

    def resolve(self, build: Build, local: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._resolve(build, local))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def kept(self, build: Build, data: bytes) -> None:
        """Built here: into the shared store for the other nodes."""
        task = asyncio.get_running_loop().create_task(
            self._publish(build.key, data, build.versions, self.counts)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def failed(self, build: Build, error: str) -> None:
        """Built here and nothing kept: nothing to share."""

    def failed_ahead(self, build: Build, built: job_channel_pb2.BuildOutcome) -> None:
        """A builder's only: a node builds its jobs ahead in JobManager, not as Builds."""

    # ---- jobs built ahead (JobManager.dispatch; ahead_builds.py) ------------------------------

    def offer_ahead(self, jobs: list[tuple[str, str]]) -> None:
        """The queued jobs JobManager builds ahead, (job id, architecture), at each dispatch:
        a job seen for the first time is looked for in the store and asked of the builders
        (or let go at once: `builds_here`); one no longer queued is forgotten."""
        host = self.host
        if host is None:
            return
        offered = set()
        for job_id, arch in jobs:
            offered.add(job_id)
            key = self._ahead_of.get(job_id)
            ahead = self._ahead.get(key) if key else None
            if ahead is not None and ahead.arch != arch:  # its GPUs changed: asked again
                self._forget_ahead(job_id)
                key = None
            if key is None:
                self._take_ahead(host, job_id, arch)
        for job_id in [j for j in self._ahead_of if j not in offered]:
            self._forget_ahead(job_id)

    def builds_here(self, job_id: str) -> bool:
        """This node's build processes may take the queued job: no lookup or request for it
        is under way (none was made, or it ended without the job's build)."""
        key = self._ahead_of.get(job_id, "")
        return not key or key not in self._ahead

    def ahead_ended(self, job_id: str) -> bool:
        """The job was offered (offer_ahead) and its lookup and request are over without its
        build, or none will ever be made (no host)."""
        return self.host is None or (job_id in self._ahead_of and self.builds_here(job_id))

    def kept_ahead(
        self, job_id: str, spec: kernel_pb2.JobSpec, arch: str, built: job_channel_pb2.BuildOutcome
    ) -> None:
        """A build process of this node built the job (artifacts, or run_whole): into the
        shared store for the other nodes (not a build that came from there)."""
        if self.host is None or job_id == self._delivering:
            return
        versions = self._job_versions(self.host)
        data = ahead_builds.kept(spec, arch, built)
        if not versions or data is None:
            return
        key = ahead_builds.key(spec, arch, versions)
        task = asyncio.get_running_loop().create_task(
            self._publish(key, data, versions, self.ahead_counts)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take_ahead(self, host: ahead_builds.Host, job_id: str, arch: str) -> None:
        self._ahead_of[job_id] = ""  # built here, unless asked below
        if not arch:
            return  # no one architecture to build for: nothing a builder would take
        job = host.store.get(job_id)
        if job is None or host.compile_cache.holds(job.spec, built_key(arch)):
            return  # built here before: a build process of this node finds it (built_earlier)
        versions = self._job_versions(host)
        if not versions:
            return  # no job process has said what this node's Python is yet
        key = ahead_builds.key(job.spec, arch, versions)
        self._ahead_of[job_id] = key
        ahead = self._ahead.get(key)
        if ahead is not None:  # a job with the same code is asked for already
            ahead.job_ids.append(job_id)
            return
        spec = ahead_builds.build_spec(job.spec)
        limit_s = timeout_of(job.spec, host.max_timeout_s)
        ahead = self._ahead[key] = AheadBuild(key, spec, arch, versions, limit_s, [job_id])
        task = asyncio.get_running_loop().create_task(self._resolve_ahead(host, ahead))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forget_ahead(self, job_id: str) -> None:
        key = self._ahead_of.pop(job_id, "")
        ahead = self._ahead.get(key) if key else None
        if ahead is not None and job_id in ahead.job_ids:
            ahead.job_ids.remove(job_id)

    def _job_versions(self, host: ahead_builds.Host) -> str:
        """This node's versions (versions_of), as its GPUs' job processes said them in their
        Hello: those of the Python its build processes run too. "" until one has."""
        found = self.builds.versions_of_job_processes(list(host.job_processes.by_id.values()))
        if len(found) == 1:
            self._ahead_versions = found.pop()
        return self._ahead_versions

    async def _resolve_ahead(self, host: ahead_builds.Host, ahead: AheadBuild) -> None:
        """The store, then the builders; the jobs are answered (`_answer_ahead`), or else
        built here (`_here_ahead`)."""
        what = "built ahead"
        try:
            found = await asyncio.to_thread(self.store.artifact, ahead.key)
            if found is not None and self._deliver_ahead(host, ahead, *found):
                return
            if self.can_build(ahead.versions):
                asked = await self._ask(
                    ahead.key, ahead.versions, ahead.arch,
                    ahead_builds.request_arguments(ahead.spec), what,
                    wanted=lambda: self._wanted(host, ahead),
                    say=lambda text: self._say_ahead(host, ahead, text),
                    limit_s=ahead.timeout_s, held_too=True,
                )  # fmt: skip
                if asked.end == "gone":
                    return
                if asked.end == "artifact" and asked.data:
                    if self._deliver_ahead(host, ahead, asked.data, asked.built_by):
                        return
                if asked.end == "failed":
                    ended = ahead_builds.read_failure(asked.error)
                    if ended is not None:  # the build ended the job, as it would have here
                        built_by, built = ended
                        text = f"kerneleval: {what} by {built_by}: the build ended the job"
                        self._answer_ahead(host, ahead, built_by, built, text, "builders")
                        return
                    self._say_ahead(
                        host, ahead,
                        f"kerneleval: {what}: the builder's build failed "
                        f"({asked.error.splitlines()[0] if asked.error else 'no reason'}): "
                        "built here",
                    )  # fmt: skip
            elif self.builders:
                self._say_ahead(
                    host, ahead,
                    f"kerneleval: {what}: no live builder has this node's versions "
                    f"({ahead.versions}): built here",
                )  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is away: built here as before
            log.warning("shared artifact store: %s; building %s here", exc, ahead.key[:16])
        finally:
            if self._ahead.get(ahead.key) is ahead:  # not answered: built here
                self._here_ahead(host, ahead)

    def _wanted(self, host: ahead_builds.Host, ahead: AheadBuild) -> bool:
        return any(j in host.queue and self._ahead_of.get(j) == ahead.key for j in ahead.job_ids)

    def _waiting(self, host: ahead_builds.Host, ahead: AheadBuild) -> list[str]:
        """Its jobs still queued and still waiting for it."""
        return [j for j in ahead.job_ids if j in host.queue and self._ahead_of.get(j) == ahead.key]

    def _say_ahead(self, host: ahead_builds.Host, ahead: AheadBuild, text: str) -> None:
        for job_id in self._waiting(host, ahead):
            host.hub.log(job_id, text)

    def _deliver_ahead(
        self, host: ahead_builds.Host, ahead: AheadBuild, data: bytes, built_by: str
    ) -> bool:
        built = ahead_builds.read_kept(ahead.spec, ahead.arch, data)
        if built is None:
            log.warning("shared artifact %s unreadable: built again", ahead.key[:16])
            return False
        counted = "builders" if any(b.builder_id == built_by for b in self.builders) else "store"
        text = f"kerneleval: built ahead: from the shared artifact store (built by {built_by})"
        self._answer_ahead(host, ahead, built_by, built, text, counted)
        return True

    def _answer_ahead(
        self, host: ahead_builds.Host, ahead: AheadBuild, built_by: str,
        built: job_channel_pb2.BuildOutcome, text: str, counted: str,
    ) -> None:  # fmt: skip
        """Each job still waiting gets `built` as its build answer (JobManager.built_elsewhere:
        it starts and goes on as after a build here). The key stays taken while the answers
        are handed over: the dispatch each answer starts gives none of the others to this
        node's build processes, and a job with the same code it queues is answered too. A job
        with the same code that comes later asks again (the store then has it, unless it
        ended the job)."""
        try:
            while waiting := self._waiting(host, ahead):
                job_id = waiting[0]
                self._ahead_of.pop(job_id, None)
                host.hub.log(job_id, text)
                answer = job_channel_pb2.BuildOutcome()
                answer.CopyFrom(built)
                self.ahead_counts[counted] += 1
                self._delivering = job_id
                try:
                    host.built_elsewhere(job_id, ahead.arch, built_by, answer)
                finally:
                    self._delivering = ""
        finally:
            if self._ahead.get(ahead.key) is ahead:
                del self._ahead[ahead.key]

    def _here_ahead(self, host: ahead_builds.Host, ahead: AheadBuild) -> None:
        """Built by this node after all: its build processes take the jobs."""
        waiting = self._waiting(host, ahead)
        if self._ahead.get(ahead.key) is ahead:
            del self._ahead[ahead.key]
        for job_id in waiting:
            self._ahead_of[job_id] = ""
            self.ahead_counts["here"] += 1
        if waiting:
            host.dispatch()

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
        asked = await self._ask(
            build.key, build.versions, build.arch, build.arguments_json, "load_inline",
            wanted=lambda: bool(build.waiters), say=lambda text: self.say(build.waiters, text),
            limit_s=BUILD_TIMEOUT_S,
        )  # fmt: skip
        if asked.end == "gone":  # every job that wanted it ended
            self.builds.ended(build, job_channel_pb2.ExtensionBuilt())
            return True
        if asked.end == "artifact":
            return bool(asked.data) and self._deliver(build, asked.data, asked.built_by)
        if asked.end == "failed":
            failed = job_channel_pb2.ExtensionBuilt(error=asked.error)
            self.answer(self.builds.ended(build, failed))
            return True
        return False

    async def _ask(
        self, key: str, versions: str, arch: str, arguments: str, what: str, *,
        wanted: Callable[[], bool], say: Callable[[str], None], limit_s: float,
        held_too: bool = False,
    ) -> Asked:  # fmt: skip
        """Writes the build request of `key` (one per key: nodes asking for one key share it)
        and waits until a builder wrote its artifact or ended it, until nobody `wanted` it, or
        until no live builder held it for --builder-wait-s; or, past `limit_s` and
        --builder-wait-s, until no live builder holds it (`held_too`: at once). The request
        goes unless a live builder holds it."""
        await asyncio.to_thread(
            self.store.request_build, key, versions, arch, arguments, self.node_id
        )
        able = sum(1 for b in self.builders if b.versions == versions)
        say(f"kerneleval: {what} asked of the builders ({able} live)")
        wake = self._wake.setdefault(key, asyncio.Event())
        alive = time.monotonic()  # when a live builder last held it (or when it was asked)
        end = alive + limit_s + self.wait_s
        try:
            while True:
                wake.clear()
                if not wanted():
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return Asked("gone")
                request = await asyncio.to_thread(self.store.build_request, key)
                now = time.monotonic()
                if request is None:  # done: the artifact is there (or another dropped it)
                    found = await asyncio.to_thread(self.store.artifact, key)
                    if found is None:
                        return Asked("artifact")
                    return Asked("artifact", found[0], found[1])
                if request.state == BUILD_FAILED:
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return Asked("failed", error=request.error)
                if request.state == BUILD_REFUSED:
                    log.warning("build %s refused: %s; built here", key[:16], request.error)
                    say(f"kerneleval: {what}: {request.error}")
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return Asked("here")
                held = request.held(time.time())
                if held:
                    alive = now
                if not held and (now - alive > self.wait_s or now > end):
                    say(
                        f"kerneleval: {what}: no builder held it for {self.wait_s:g} s "
                        "(none free, or the one that took it was lost): built here"
                    )
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return Asked("here")
                if held and held_too and now > end:
                    say(f"kerneleval: {what}: the builder did not build it within "
                        f"{limit_s + self.wait_s:g} s: built here")  # fmt: skip
                    await asyncio.to_thread(self.store.drop_build_request, key)
                    return Asked("here")
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

    async def _publish(self, key: str, data: bytes, versions: str, counts: dict[str, int]) -> None:
        try:
            await asyncio.to_thread(self.store.put_artifact, key, data, versions, self.node_id)
            counts["published"] += 1
        except Exception as exc:  # noqa: BLE001 - kept locally; others build it themselves
            log.warning("artifact %s not shared: %s", key[:16], exc)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
