"""load_inline calls of running jobs, built by build processes: the queue, the waiters and the
build cache in front of them.

A job process whose code calls load_inline sends the call (ExtensionRequest) and waits. The
front end answers at once from the build cache (build_cache.py), or joins the call to a build
of the same key already under way, or queues a build: the next free build process (no GPU,
sandboxed, one build and it exits) gets it as AssignJob.extension and answers a BuildOutcome
with the library or the compile error, which every job waiting on that key receives and the
cache keeps. Builds never run on a GPU's job process, so they never hold a GPU or its timing
window, and as many run at once as there are build processes (--build-processes).

The service builds only calls the builder takes (extension.refusal: plain code generation
flags); for any other call, and where there are no build processes, the answer is
`build_here`: load_inline runs in the job's own process, as torch would.

On a shared PostgreSQL store (`--role node` with `--role builder`s, jobs/builds/artifact_store.py) a
`remote` stands between the local cache and the local build processes: a build not in the
local cache is first looked for in the shared artifact store, then asked of the builders whose
versions are this node's, and built here (or in the job, `build_here`) only when none answers
in time. What this node builds itself goes into the shared store too. On a builder the builds
come from the store's requests (`add_requested`) and their results go back there; a builder
also builds the kernels of nodes' jobs built ahead (`add_requested_ahead`, ahead_builds.py:
a Build with the job's sources in `spec`, which its build process compiles with
`engine.build_job` as a node's build process would).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.fast_build import extension
from kerneleval_server.fleet.job_processes import JobProcess
from kerneleval_server.jobproc import BUILD_DEVICE

from . import ahead_builds, prebuild
from .build_cache import BuildCache

MAX_CALLS_PER_JOB = 16
MAX_CALL_BYTES = 4 << 20
BUILD_TIMEOUT_S = 600.0


@dataclass
class Waiter:
    job_id: str
    proc: JobProcess  # the job process whose load_inline call it is
    request_id: int


@dataclass
class Build:
    key: str
    main_key: str  # its main.o's (extension.main_key)
    name: str
    arguments_json: str
    arch: str
    waiters: list[Waiter] = field(default_factory=list)
    proc: JobProcess | None = None  # the build process, once started
    started: float = 0.0
    versions: str = ""  # the target without the architecture (versions_of)
    # A builder's: asked through the shared store, built with nobody waiting here.
    requested: bool = False
    # A builder's build of a node's job built ahead (ahead_builds.py): the job's sources,
    # which its build process compiles for `arch` (no load_inline call).
    spec: kernel_pb2.JobSpec | None = None

    @property
    def build_id(self) -> str:
        return f"build-{self.key[:20]}"


def _answer(
    waiter: Waiter, built: job_channel_pb2.ExtensionBuilt
) -> job_channel_pb2.ExtensionBuilt:
    out = job_channel_pb2.ExtensionBuilt()
    out.CopyFrom(built)
    out.job_id, out.request_id = waiter.job_id, waiter.request_id
    return out


class Remote(Protocol):
    """The shared artifact store's side of the builds (jobs/builds/artifact_store.py): a node's
    (`SharedArtifacts`) or a builder's (`BuilderNode`)."""

    def can_build(self, versions: str) -> bool:
        """A live builder builds for these versions."""
        ...

    def resolve(self, build: Build, local: bool) -> None:
        """Find or have built `build` (not in the local cache); `local`: this front end has
        build processes of its own to fall back on."""
        ...

    def kept(self, build: Build, data: bytes) -> None:
        """A build here ended with what the cache keeps (`data`, a serialized ExtensionBuilt)."""
        ...

    def failed(self, build: Build, error: str) -> None:
        """A build here ended with nothing kept (its process was lost; the builder refused)."""
        ...

    def failed_ahead(self, build: Build, built: job_channel_pb2.BuildOutcome) -> None:
        """A build of a job built ahead (a builder's) ended the job: `built` has its result."""
        ...

    def offer_ahead(self, jobs: list[tuple[str, str]]) -> None:
        """The queued jobs a node builds ahead, (job id, architecture): a node looks for each
        in the shared store and asks the builders first."""
        ...

    def builds_here(self, job_id: str) -> bool:
        """The node's own build processes may build this queued job now."""
        ...

    def ahead_ended(self, job_id: str) -> bool:
        """The queued job was offered and nothing more will come of it (built here, found
        nowhere, no builder answered in time): a node without build processes runs it whole."""
        ...

    def kept_ahead(
        self, job_id: str, spec: kernel_pb2.JobSpec, arch: str, built: job_channel_pb2.BuildOutcome
    ) -> None:
        """A job's build ended with `built` (artifacts or run_whole) on this node."""
        ...


class ExtensionBuilds:
    def __init__(self, cache: BuildCache) -> None:
        self.cache = cache
        self.queue: deque[Build] = deque()
        self.by_key: dict[str, Build] = {}  # queued or building
        self.by_process: dict[str, Build] = {}  # build process id -> its build
        self.calls: dict[str, int] = {}  # job id -> calls so far
        self.built = 0
        self.remote: Remote | None = None  # the shared artifact store (roles node, builder)
        self._compilers = ""
        self._triton = ""

    def compilers(self) -> str:
        if not self._compilers:  # asked once: `c++ --version` and `nvcc --version`
            self._compilers = extension.toolchain_id()
        return self._compilers

    def target(self, torch_version: str, cuda_version: str, arch: str) -> str:
        """What besides the call decides what it builds to (part of call_key)."""
        return f"torch {torch_version}|cuda {cuda_version}|{arch}|{self.compilers()}"

    def triton(self) -> str:
        """Triton's version as installed for this Python (the build processes'): read once."""
        if not self._triton:
            try:
                self._triton = f"triton {metadata.version('triton')}"
            except metadata.PackageNotFoundError:
                self._triton = "triton none"
        return self._triton

    def versions_of(self, torch_version: str, cuda_version: str) -> str:
        """The target without the architecture, with triton and the recipes: what a builder
        must have to build for this front end (any architecture: nvcc and Triton compile for
        one they do not run on), load_inline calls and jobs built ahead alike."""
        return (
            f"torch {torch_version}|cuda {cuda_version}|{self.triton()}|{self.compilers()}"
            f"|recipe {extension.RECIPE_VERSION}|ahead {ahead_builds.RECIPE_VERSION}"
        )

    def versions_of_job_processes(self, procs: Iterable[JobProcess]) -> set[str]:
        """The versions (versions_of) of the GPUs' job processes, as their Hello said them:
        those of the Python this front end's build processes run too."""
        return {
            self.versions_of(w.hello.device.torch_version, w.hello.device.cuda_version)
            for w in procs
            if w.hello is not None and w.device_index != BUILD_DEVICE
        }

    def _target(self, device: job_pb2.DeviceInfo, arch: str) -> str:
        return self.target(device.torch_version, device.cuda_version, arch)

    def request(
        self,
        waiter: Waiter,
        req: job_channel_pb2.ExtensionRequest,
        device: job_pb2.DeviceInfo,
        arch: str,
        builders: bool,
    ) -> job_channel_pb2.ExtensionBuilt | None:
        """The answer now (from the cache, or build_here), or None: the job waits for a build
        (`next_build` hands it out)."""
        done = job_channel_pb2.ExtensionBuilt(job_id=waiter.job_id, request_id=waiter.request_id)
        self.calls[waiter.job_id] = self.calls.get(waiter.job_id, 0) + 1
        if self.calls[waiter.job_id] > MAX_CALLS_PER_JOB:
            done.error = f"more than {MAX_CALLS_PER_JOB} load_inline calls in one job"
            return done
        arguments = req.call.arguments_json
        try:
            call = json.loads(arguments) if len(arguments) <= MAX_CALL_BYTES else None
        except ValueError:
            call = None
        if not isinstance(call, dict):
            done.build_here = True  # torch judges the call itself
            return done
        versions, remote = "", False
        if self.remote is not None:  # a node: builders may build it when it has no builds
            versions = self.versions_of(device.torch_version, device.cuda_version)
            remote = self.remote.can_build(versions)
        if (not builders and not remote) or extension.refusal(call):
            done.build_here = True
            return done
        target = self._target(device, arch)
        key = extension.call_key(call, target)
        cached = self._entry(key)
        if cached is not None:
            out = _answer(waiter, cached)
            out.cache_hit = True
            return out
        build = self.by_key.get(key)
        if build is None:
            main = extension.main_key(call, target)
            build = Build(key, main, str(call.get("name", "")), arguments, arch, versions=versions)
            self.by_key[key] = build
            build.waiters.append(waiter)
            if self.remote is not None:
                self.remote.resolve(build, builders)
            else:
                self.queue.append(build)
            return None
        build.waiters.append(waiter)
        return None

    def add_requested(
        self, key: str, call: dict[str, Any], arguments_json: str, arch: str, target: str
    ) -> Build | None:
        """A builder's build of a request it took from the shared store (`key`, computed
        there; the caller checked it is call_key(call, target)), queued for a build process.
        None when this builder builds that key already."""
        if key in self.by_key:
            return None
        main = extension.main_key(call, target)
        build = Build(key, main, str(call.get("name", "")), arguments_json, arch, requested=True)
        self.by_key[key] = build
        self.queue.append(build)
        return build

    def add_requested_ahead(self, key: str, spec: kernel_pb2.JobSpec, arch: str) -> Build | None:
        """A builder's build of a node's job built ahead (`key`, computed there; the caller
        checked it is ahead_builds.key of these sources, this architecture and its versions),
        queued for a build process. None when this builder builds that key already."""
        if key in self.by_key:
            return None
        name = f"{prebuild.kind(spec) or 'job'} kernels built ahead"
        build = Build(key, "", name, "", arch, requested=True, spec=spec)
        self.by_key[key] = build
        self.queue.append(build)
        return build

    def assignment(
        self, build: Build
    ) -> tuple[kernel_pb2.JobSpec, job_channel_pb2.ExtensionCall | None]:
        """What a build process is given for `build` (AssignJob's spec and extension): the
        load_inline call (with a reusable main.o), or the job's sources built ahead."""
        if build.spec is not None:
            return build.spec, None
        call = job_channel_pb2.ExtensionCall(
            arguments_json=build.arguments_json, main_object=self.main_object(build)
        )
        return kernel_pb2.JobSpec(), call

    def build_here(self, build: Build) -> None:
        """The shared store and the builders did not answer: queued for this front end's
        own build processes."""
        self.queue.append(build)

    def delivered(
        self, build: Build, data: bytes
    ) -> list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]] | None:
        """What the shared store holds for `build` (a serialized ExtensionBuilt), kept in the
        local cache too: the answer for each waiting job. None when it cannot be read."""
        try:
            kept = job_channel_pb2.ExtensionBuilt.FromString(data)
        except DecodeError:
            return None
        self.by_key.pop(build.key, None)
        self.cache.put(build.key, data)
        return [(w, _answer(w, kept)) for w in build.waiters]

    def ended(
        self, build: Build, answer: job_channel_pb2.ExtensionBuilt
    ) -> list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]:
        """`build` ends with `answer` for its waiters (not kept: a failure, or build_here)."""
        self.by_key.pop(build.key, None)
        return [(w, _answer(w, answer)) for w in build.waiters]

    def next_build(self) -> Build | None:
        """The oldest queued build still wanted by a job (or by a node, on a builder)."""
        while self.queue:
            build = self.queue.popleft()
            if build.waiters or build.requested:
                return build
            self.by_key.pop(build.key, None)
        return None

    def main_object(self, build: Build) -> bytes:
        """main.o of an earlier build with the same main.cpp and flags (b"": none kept)."""
        entry = self._entry(build.main_key)
        return entry.library if entry is not None else b""

    def _entry(self, key: str) -> job_channel_pb2.ExtensionBuilt | None:
        data = self.cache.get(key)
        if data is None:
            return None
        try:
            return job_channel_pb2.ExtensionBuilt.FromString(data)
        except DecodeError:  # damaged on disk: built again
            self.cache.forget(key)
            return None

    def started(self, build: Build, proc: JobProcess) -> None:
        build.proc = proc
        build.started = time.monotonic()
        self.by_process[proc.worker_id] = build

    def building(self, proc: JobProcess) -> Build | None:
        return self.by_process.get(proc.worker_id)

    def finished_build(
        self, proc: JobProcess, outcome: job_channel_pb2.BuildOutcome
    ) -> list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]:
        """A build process answered (BuildOutcome): a load_inline call's (`finished`), or, on a
        builder, a job's build: kept in the cache and the shared store (artifacts, run_whole),
        or its result sent back to the node that asked. Nobody waits here for the latter."""
        build = self.by_process.get(proc.worker_id)
        if build is None or build.spec is None:
            return self.finished(proc, outcome.extension)
        del self.by_process[proc.worker_id]
        self.by_key.pop(build.key, None)
        data = ahead_builds.kept(build.spec, build.arch, outcome)
        if data is not None:
            self.cache.put(build.key, data)
            self.built += 1
            if self.remote is not None:
                self.remote.kept(build, data)
        elif self.remote is not None:
            if outcome.HasField("result"):
                self.remote.failed_ahead(build, outcome)
            else:
                self.remote.failed(
                    build, f"the build process answered no cubin per source for {build.arch}"
                )
        return []

    def finished(
        self, proc: JobProcess, built: job_channel_pb2.ExtensionBuilt
    ) -> list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]:
        """A build process answered: kept in the cache (a library or a compile error; not
        a build the builder refused), and the answer for each waiting job."""
        build = self.by_process.pop(proc.worker_id, None)
        if build is None:
            return []
        self.by_key.pop(build.key, None)
        kept = job_channel_pb2.ExtensionBuilt(
            library=built.library, error=built.error, log=built.log, fast=built.fast
        )
        kept.build_time.CopyFrom(built.build_time)
        keep = built.library or (built.error and not built.error.startswith("not built by"))
        if keep:
            data = kept.SerializeToString()
            self.cache.put(build.key, data)
            self.built += 1
            if self.remote is not None:
                self.remote.kept(build, data)
        elif self.remote is not None:
            self.remote.failed(build, built.error or "the build process answered nothing")
        if built.library and built.main_object:
            entry = job_channel_pb2.ExtensionBuilt(library=built.main_object)
            self.cache.put(build.main_key, entry.SerializeToString())
        return [(w, _answer(w, kept)) for w in build.waiters]

    def lost(
        self, proc: JobProcess, why: str
    ) -> list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]:
        """The build process ended without an answer: each waiting job gets the failure (not
        kept: the next call builds again)."""
        build = self.by_process.pop(proc.worker_id, None)
        if build is None:
            return []
        self.by_key.pop(build.key, None)
        failed = job_channel_pb2.ExtensionBuilt(
            error=f"Error building extension '{build.name}': the build process {why}"
        )
        if build.spec is not None:  # a job's build (a builder's): its node builds it itself
            failed.error = f"the build process of the {build.name} {why}"
        if self.remote is not None:
            self.remote.failed(build, failed.error)
        return [(w, _answer(w, failed)) for w in build.waiters]

    def forget_job(self, job_id: str) -> None:
        """The job ended: it waits for nothing (a build only it wanted is dropped from the
        queue when its turn comes)."""
        self.calls.pop(job_id, None)
        for build in self.by_key.values():
            build.waiters = [w for w in build.waiters if w.job_id != job_id]
