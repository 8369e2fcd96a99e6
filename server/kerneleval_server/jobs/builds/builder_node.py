"""`--role builder`: a CPU-only front end that builds what nodes ask of the shared store: their
jobs' `load_inline` calls, and the Triton and raw CUDA kernels of their jobs built ahead.

A builder has no GPU, no job processes and no API but health: its watchdog runs only build
processes (the build pseudo-device, the same sandbox as on a node), and this module feeds
them from the store's build requests (jobs/builds/artifact_store.py says what a node asks and how it
waits; jobs/builds/ahead_builds.py what a job's build request holds and what is kept of it):
- it registers in `builders` with the heartbeat (every third of `--lease-seconds`): its id,
  address, how many builds it runs at once and its **versions** (torch and CUDA as the build
  processes' Python has them, probed at start; triton; the compilers; the recipes);
- it takes requests of exactly its versions with leases (`store.claim_builds`: `SELECT ...
  FOR UPDATE SKIP LOCKED`), as many as it has idle build processes, when NOTIFYed on
  `kerneleval_builds` and every second; the heartbeat renews the leases, so the requests of a
  builder that dies (SIGKILL, a lost machine) go to another builder, or back to the node that
  asked, once they expire;
- for each it computes the key again from the arguments and its own target and refuses a
  request whose key differs (or a call the service does not build, or sources that are not
  kernels launched from their IOContract), so it never writes under a key what that key does
  not build to; its own build cache answers first;
- each build goes to a build process as a node's own would (ExtensionBuilds, JobManager's
  dispatch): a load_inline call (`AssignJob.extension`), or a job's sources for the node's
  architecture (`AssignJob.build_arch`: `engine.build_job`, Triton compiled for that GPU with
  no GPU here); the library or the compile error, the kernels' artifacts or `run_whole`, go
  into `artifacts` (NOTIFYing the nodes); a build that ended a job (its compile error) ends
  the request as failed with that outcome, and one that fails (its process lost, past its
  time) as failed;
- it logs, at each heartbeat, requests that wait for versions other than its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from kerneleval_server.fast_build import extension

from ..shared_queue import beat_forever, claim_forever, listen_forever
from ..store import JobStore
from ..store.base import BUILD_FAILED, BUILD_REFUSED, BUILDS_CHANNEL
from . import ahead_builds
from .extension_builds import Build, ExtensionBuilds

log = logging.getLogger("kerneleval.builder")

TOLD_AGAIN_S = 300.0  # requests waiting for other versions are logged again after this
_PROBE = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda or '']))"


def probe_versions(env: dict[str, str], timeout_s: float = 120.0) -> tuple[str, str]:
    """torch's and CUDA's versions as the build processes' Python (`env`: theirs) has them."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
        timeout=timeout_s, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"cannot read torch's versions: {done.stderr.strip()[-500:]}")
    torch_version, cuda_version = json.loads(done.stdout.strip().splitlines()[-1])
    return str(torch_version), str(cuda_version)


class BuilderNode:
    """A builder's side of the shared artifact store (ExtensionBuilds.remote)."""

    def __init__(
        self,
        store: JobStore,
        builds: ExtensionBuilds,
        *,
        url: str,
        lease_s: float,
        torch_version: str,
        cuda_version: str,
        slots: int,
        idle: Callable[[], int],
        dispatch: Callable[[], None],
        address: str = "",
    ) -> None:
        self.store = store
        self.builds = builds
        builds.remote = self
        self.url = url  # "" (tests): no LISTEN, the claim loop polls
        self.lease_s = lease_s
        self.torch_version, self.cuda_version = torch_version, cuda_version
        self.versions = builds.versions_of(torch_version, cuda_version)
        self.slots = slots  # build processes (--build-processes)
        self.idle = idle  # build processes free now
        self.dispatch = dispatch
        self.address = address
        self.builder_id = f"{socket.gethostname()}-builder-{uuid.uuid4().hex[:8]}"
        self.held: dict[str, Build] = {}  # requests taken, by key, until their end is written
        # Requests ended: load_inline calls and jobs built ahead alike; ahead_counts: the latter.
        self.counts = {"built": 0, "failed": 0, "refused": 0, "cached": 0}
        self.ahead_counts = {"built": 0, "failed": 0, "refused": 0, "cached": 0}
        self.registered = False
        self.warm = False  # a build process has been free (come up) since the start
        self.on_beat: Callable[[], None] = lambda: None  # health (main)
        self._claim = asyncio.Event()
        self._told: dict[str, float] = {}  # other versions -> when their requests were logged
        self._tasks: list[asyncio.Task[Any]] = []
        self._writes: set[asyncio.Task[Any]] = set()

    # ---- life -----------------------------------------------------------------------------

    def start(self) -> None:
        log.info("builder %s builds with %s", self.builder_id, self.versions)
        loop = asyncio.get_running_loop()
        if self.url:
            self._tasks.append(loop.create_task(listen_forever(
                self.url, {BUILDS_CHANNEL: self._notified}, self._claim.set
            )))  # fmt: skip
        self._tasks.append(loop.create_task(beat_forever(max(0.2, self.lease_s / 3), self.beat)))
        self._tasks.append(loop.create_task(self._claim_loop()))

    async def stop(self) -> None:
        """Gives back the requests taken and not started (another builder takes them at once)
        and leaves `builders`; builds under way keep their leases until they expire."""
        for task in self._tasks:
            task.cancel()
        for task in [*self._tasks, *self._writes]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        queued = [b.key for b in self.builds.queue if b.requested and b.key in self.held]
        try:
            self.store.release_builds(self.builder_id, queued)
            self.store.forget_builder(self.builder_id)
        except Exception as exc:  # noqa: BLE001 - stopping anyway: the leases expire
            log.warning("could not give back build requests: %s", exc)

    def serving(self) -> bool:
        """Registered in the store, and its build processes have come up."""
        return self.registered and self.warm

    # ---- heartbeat ----------------------------------------------------------------------------

    def beat(self) -> None:
        self.store.register_builder(
            self.builder_id, self.address, self.versions, self.slots, self.lease_s
        )
        self.registered = True
        self.warm = self.warm or self.idle() > 0
        still = self.store.renew_builds(self.builder_id, self.lease_s)
        for key in [k for k in self.held if k not in still]:
            log.warning("lease of build %s lost (another builder may build it)", key[:16])
        now = time.monotonic()
        for versions, count in self.store.waiting_builds():
            if versions != self.versions and now - self._told.get(versions, -1e9) > TOLD_AGAIN_S:
                self._told[versions] = now
                log.warning(
                    "%d build requests wait for versions %r; this builder's are %r: it does "
                    "not take them", count, versions, self.versions,
                )  # fmt: skip
        self._claim.set()
        self.on_beat()

    # ---- taking requests ------------------------------------------------------------------

    def _notified(self, versions: str) -> None:
        if versions in ("", self.versions):
            self._claim.set()

    async def _claim_loop(self) -> None:
        await claim_forever(self._claim, self.claim, "claim builds")

    def claim(self) -> int:
        room = self.idle() - len(self.builds.queue)
        rows = self.store.claim_builds(self.builder_id, self.versions, room, self.lease_s)
        for key, arch, arguments in rows:
            self._take(key, arch, arguments)
        if rows:
            self.dispatch()
        return len(rows)

    def _take(self, key: str, arch: str, arguments: str) -> None:
        try:
            call = json.loads(arguments)
        except ValueError:
            call = None
        if ahead_builds.is_request(call):
            assert isinstance(call, dict)
            spec, why = ahead_builds.parse_request(call)
            self._take_ahead(key, arch, spec, why)
            return
        why = extension.refusal(call) if isinstance(call, dict) else "not a load_inline call"
        if why or not isinstance(call, dict):
            self._refuse(key, f"builder {self.builder_id} does not build it: {why}")
            return
        target = self.builds.target(self.torch_version, self.cuda_version, arch)
        if extension.call_key(call, target) != key:
            self._refuse(
                key,
                f"builder {self.builder_id} does not build it: the key is not what the "
                f"arguments build to with its versions ({self.versions}, {arch or 'no arch'})",
            )
            return
        cached = self.builds.cache.get(key)
        if cached is not None:  # built here before (the store dropped it since)
            self.counts["cached"] += 1
            self.store.put_artifact(key, cached, self.versions, self.builder_id)
            return
        build = self.builds.add_requested(key, call, arguments, arch, target)
        if build is not None:
            self.held[key] = build
            log.info("building %s (%r, %s) for the shared store", key[:16], build.name, arch)

    def _take_ahead(self, key: str, arch: str, spec: kernel_pb2.JobSpec | None, why: str) -> None:
        """A node's job built ahead: its sources, built for the node's architecture."""
        if spec is not None:
            why = ahead_builds.refusal(spec, arch)
            if not why and ahead_builds.key(spec, arch, self.versions) != key:
                why = (
                    f"the key is not what the sources build to with its versions "
                    f"({self.versions}, {arch})"
                )
        if spec is None or why:
            self.ahead_counts["refused"] += 1
            self._refuse(key, f"builder {self.builder_id} does not build it: {why}")
            return
        cached = self.builds.cache.get(key)
        if cached is not None:  # built here before (the store dropped it since)
            self.counts["cached"] += 1
            self.ahead_counts["cached"] += 1
            self.store.put_artifact(key, cached, self.versions, self.builder_id)
            return
        build = self.builds.add_requested_ahead(key, spec, arch)
        if build is not None:
            self.held[key] = build
            log.info("building %s (%s, %s) for the shared store", key[:16], build.name, arch)

    def _refuse(self, key: str, why: str) -> None:
        self.counts["refused"] += 1
        log.warning("build request %s refused: %s", key[:16], why)
        self.store.end_build(key, self.builder_id, BUILD_REFUSED, why)

    # ---- ExtensionBuilds.remote -----------------------------------------------------------

    def can_build(self, versions: str) -> bool:
        return False  # a builder has no jobs of its own asking

    def resolve(self, build: Build, local: bool) -> None:
        self.builds.build_here(build)

    def kept(self, build: Build, data: bytes) -> None:
        if self.held.pop(build.key, None) is None:
            return
        self.counts["built"] += 1
        self.ahead_counts["built"] += build.spec is not None
        self._write(self.store.put_artifact, build.key, data, self.versions, self.builder_id)

    def failed_ahead(self, build: Build, built: job_channel_pb2.BuildOutcome) -> None:
        """The build ended the node's job (a compile error): the request ends as failed with
        the outcome, which the node gives its jobs; nothing is kept."""
        if self.held.pop(build.key, None) is None:
            return
        self.counts["failed"] += 1
        self.ahead_counts["failed"] += 1
        error = ahead_builds.failure(self.builder_id, built)
        self._write(self.store.end_build, build.key, self.builder_id, BUILD_FAILED, error)

    def offer_ahead(self, jobs: list[tuple[str, str]]) -> None:
        """A builder has no jobs of its own."""

    def builds_here(self, job_id: str) -> bool:
        return True

    def ahead_ended(self, job_id: str) -> bool:
        return True

    def kept_ahead(
        self, job_id: str, spec: kernel_pb2.JobSpec, arch: str, built: job_channel_pb2.BuildOutcome
    ) -> None:
        """A builder has no jobs of its own."""

    def failed(self, build: Build, error: str) -> None:
        if self.held.pop(build.key, None) is None:
            return
        self.counts["failed"] += 1
        self._write(self.store.end_build, build.key, self.builder_id, BUILD_FAILED, error)

    def _write(self, fn: Callable[..., None], *args: Any) -> None:
        async def write() -> None:
            try:
                await asyncio.to_thread(fn, *args)
            except Exception as exc:  # noqa: BLE001 - the lease expires; the node builds it
                log.warning("build %s not written to the store: %s", str(args[0])[:16], exc)
            self._claim.set()

        task = asyncio.get_running_loop().create_task(write())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
