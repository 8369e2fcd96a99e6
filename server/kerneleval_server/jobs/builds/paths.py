"""A job's builds outside its own process, one path each, beside the job life cycle
(manager.py) that starts and ends them:

- **Built ahead, then launched** (prebuild.py): a job of IOContract kernels goes first to a
  build process (`dispatch_builds`: this node's, or the shared artifact store and the
  builders, artifact_store.py), which compiles them for the GPU's architecture (`on_built`);
  the job then waits, its deadline paused, for a launch process (`await_launch`,
  `next_launch`), or ends (a compile error), or runs whole (`run_whole`). What was built is
  kept (compile_cache.py): a later job with the same code skips its build (`built_earlier`).
- **load_inline**: a job process's `load_inline` call is built by a build process
  (`on_extension_request`, extension_builds.py, `fast_build`) and answered to every job that
  waits for the same call (`answer_extensions`).

The life cycle is reached through `Lifecycle`, never through its private parts.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.config import Config
from kerneleval_server.fleet.devices import Devices
from kerneleval_server.fleet.job_processes import JobProcess, JobProcessTable
from kerneleval_server.framing import FrameError
from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.jobs.builds import prebuild
from kerneleval_server.jobs.builds.build_cache import BuildCache
from kerneleval_server.jobs.builds.compile_cache import (
    CompileCache,
    as_artifacts,
    as_files,
    built_key,
    built_reference,
)
from kerneleval_server.jobs.builds.extension_builds import BUILD_TIMEOUT_S, ExtensionBuilds, Waiter
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.running import Running, Stage, Unstored, copy_job, stamp
from kerneleval_server.jobs.scheduler import FairQueue, QueuedJob
from kerneleval_server.jobs.store import TERMINAL, JobStore
from kerneleval_server.spec import placement

log = logging.getLogger("kerneleval.jobs")


class Lifecycle(Protocol):
    """What the build paths ask of the job life cycle (JobManager)."""

    config: Config
    store: JobStore
    hub: EventHub
    queue: FairQueue
    fleet: Devices
    running: dict[str, Running]
    job_processes: JobProcessTable
    max_timeout_s: float

    def dispatch(self) -> None: ...
    def start(self, job_id: str, proc: JobProcess, build_arch: str = "") -> None: ...
    def finish(
        self,
        job: job_pb2.Job,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
        reason: str = "",
    ) -> None: ...
    def track(
        self,
        job: job_pb2.Job,
        proc: JobProcess,
        compile_cache: list[job_channel_pb2.CacheFile] | None = None,
    ) -> Running: ...
    def mark_started(self, job: job_pb2.Job, worker_id: str, new_attempt: bool) -> None: ...
    def requeue(self, job: job_pb2.Job) -> None: ...
    def unstored(self, job_id: str) -> Unstored | None: ...
    def store_new(self, job_id: str, as_it_is: bool = False) -> None: ...
    def set_job(self, worker_id: str, job_id: str, finished: bool = False) -> None: ...
    def watch_exit(self, proc: JobProcess) -> None: ...
    def free_process(self, proc: JobProcess, completed: bool) -> None: ...
    def kill_lost(self, proc: JobProcess) -> None: ...


class BuildPaths:
    def __init__(self, m: Lifecycle, built: BuildCache, compile_cache_bytes: int) -> None:
        self.m = m
        # What was built, on disk across restarts: extensions, and the compile cache's entries.
        self.compile_cache = CompileCache(compile_cache_bytes, built)
        self.extensions = ExtensionBuilds(built)
        self.launch_queue: deque[str] = deque()  # built ahead, in the order they were built
        self.launched: set[str] = set()  # jobs sent to a launch process wholly prebuilt
        self.run_whole: set[str] = set()  # the build process said: not buildable ahead
        self.device_arch: dict[int, str] = {}  # "sm_90" per GPU, from its job processes' Hello
        self.engine_judges = False  # its GPU job processes' Hello: they judge compared jobs

    # ---- from the life cycle ------------------------------------------------------------

    def kind(self, job: job_pb2.Job) -> str:
        """How the queue takes the job: built ahead ("cuda", "triton") or whole ("")."""
        if job.job_id in self.run_whole:
            return ""
        return prebuild.kind(job.spec, self.judges_launch(job.spec))

    def dispatch_builds(self, ready: list[JobProcess], draining: bool) -> None:
        """Build processes' work: `load_inline` builds first (their jobs hold a GPU's
        process), then jobs built ahead (the shared artifact store and the builders first).
        While draining, only the builds that started jobs wait on."""
        for proc in ready:
            if proc.device_index == BUILD_DEVICE and self.extensions.queue:
                self.start_extension_build(proc)
        ready = [w for w in ready if w.ready]
        remote = self.extensions.remote
        queue = self.m.queue
        if remote is not None and not draining:
            # Offered while its tenant is under its share (--tenant-max-running): a job the
            # builders answer starts (built_elsewhere).
            ahead = queue.waiting(lambda q: self.built_ahead(q) and queue.lane_open(q.lane))
            for waiting in ahead:  # it looks for them in the store
                self.m.store_new(waiting.job_id)
            remote.offer_ahead([(q.job_id, self.build_arch(q)) for q in ahead])
        for proc in ready if not draining else []:
            while proc.device_index == BUILD_DEVICE and len(queue):
                queued = queue.pop_for(None, self.builds_here)
                if queued is None:
                    break
                arch = self.build_arch(queued)
                if not self.built_earlier(queued.job_id, arch):
                    self.m.start(queued.job_id, proc, build_arch=arch)
                    break

    def on_build_message(
        self, proc: JobProcess, msg: job_channel_pb2.JobProcessMessage, kind: str | None
    ) -> bool:
        """A build process's message (True: it was one): its `load_inline` build's answer or
        log, or its build of a job."""
        build = self.extensions.building(proc)
        if build is not None:  # a build process building a load_inline call
            if kind == "build":
                self._on_extension_built(proc, msg.build)
            elif kind == "log":
                self.publish_log(build.waiters, msg.log.text)
            return True
        if kind == "build":
            self.on_built(proc, msg.build)
            return True
        return False

    def process_exited(self, proc: JobProcess, exited: watchdog_pb2.WorkerExited) -> None:
        """A job process exited: a `load_inline` build it ran is lost."""
        if self.extensions.building(proc) is not None:
            why = f"exited ({exited.reason or 'code ' + str(exited.exit_code)})"
            self.extension_build_lost(proc, why)

    def keep_compiled(self, run: Running, outcome: job_channel_pb2.JobOutcome) -> None:
        """What the job's process compiled, kept for later jobs with the same code."""
        if not outcome.compile_cache:
            return
        why = self.compile_cache.store(
            run.job.spec, run.proc.device_index, run.compile_cache, list(outcome.compile_cache)
        )
        if why:
            log.warning("compile cache of job %s not kept: %s", outcome.job_id, why)

    def forget(self, job_id: str) -> None:
        """The job ended: nothing of it waits here any more."""
        self.extensions.forget_job(job_id)
        self.launched.discard(job_id)
        self.run_whole.discard(job_id)
        if job_id in self.launch_queue:
            self.launch_queue.remove(job_id)

    # ---- the shared artifact store's host (ahead_builds.Host) ------------------------------

    @property
    def queue(self) -> FairQueue:
        return self.m.queue

    @property
    def store(self) -> JobStore:
        return self.m.store

    @property
    def hub(self) -> EventHub:
        return self.m.hub

    @property
    def job_processes(self) -> JobProcessTable:
        return self.m.job_processes

    @property
    def max_timeout_s(self) -> float:
        return self.m.max_timeout_s

    def dispatch(self) -> None:
        self.m.dispatch()

    # ---- load_inline builds ---------------------------------------------------------------

    def start_extension_build(self, proc: JobProcess) -> None:
        build = self.extensions.next_build()
        if build is None:
            return
        spec, call = self.extensions.assignment(build)  # a call, or (a builder's) a job's kernels
        try:
            sent = proc.assign(build.build_id, spec, 1, build_arch=build.arch, extension=call)
        except FrameError as exc:
            sent = False
            log.error("extension build %s cannot be sent: %s", build.build_id, exc)
        self.extensions.started(build, proc)
        self.publish_log(build.waiters, f"kerneleval: building {build.name!r} in {proc.worker_id}")
        if not sent:
            self.extension_build_lost(proc, "could not be reached")
            return
        self.m.set_job(proc.worker_id, build.build_id)
        proc.exit_watch = asyncio.get_running_loop().call_later(
            BUILD_TIMEOUT_S, self._extension_build_timeout, proc
        )

    def _extension_build_timeout(self, proc: JobProcess) -> None:
        if self.extensions.building(proc) is None:
            return
        self.extension_build_lost(proc, f"ran past {BUILD_TIMEOUT_S:.0f} s and was killed")
        self.m.kill_lost(proc)

    def on_extension_request(
        self, proc: JobProcess, run: Running, req: job_channel_pb2.ExtensionRequest
    ) -> None:
        assert proc.hello is not None
        device = proc.hello.device
        arch = prebuild.arch_of(device.compute_capability)
        builders = BUILD_DEVICE in self.m.fleet.devices and self.m.fleet.device_takes_jobs(
            BUILD_DEVICE
        )
        waiter = Waiter(run.job.job_id, proc, req.request_id)
        answer = self.extensions.request(waiter, req, device, arch, builders)
        if answer is None:
            text = "kerneleval: load_inline queued for a build process"
            if self.extensions.remote is not None:
                text += " (the shared store and the builders first)"
            self.publish_log([waiter], text)
            self.m.dispatch()
            return
        if answer.cache_hit:
            self.publish_log([waiter], "kerneleval: load_inline from the build cache")
        proc.send(job_channel_pb2.FrontendMessage(extension=answer))

    def _on_extension_built(self, proc: JobProcess, built: job_channel_pb2.BuildOutcome) -> None:
        proc.gone = True  # a build process builds once, then exits
        if proc.exit_watch is not None:  # the build's timeout
            proc.exit_watch.cancel()
            proc.exit_watch = None
        self.m.watch_exit(proc)
        self.m.free_process(proc, completed=True)
        self.answer_extensions(self.extensions.finished_build(proc, built))
        self.m.dispatch()

    def extension_build_lost(self, proc: JobProcess, why: str) -> None:
        self.answer_extensions(self.extensions.lost(proc, why))

    def answer_extensions(
        self, answers: list[tuple[Waiter, job_channel_pb2.ExtensionBuilt]]
    ) -> None:
        for waiter, answer in answers:
            run = self.m.running.get(waiter.job_id)
            if run is None or run.proc is not waiter.proc or run.outcome is not None:
                continue  # it ended meanwhile
            took = answer.build_time.ToNanoseconds() / 1e9
            what = answer.error.splitlines()[0] if answer.error else f"built in {took:.1f} s"
            self.publish_log([waiter], f"kerneleval: load_inline: {what}")
            try:
                waiter.proc.send(job_channel_pb2.FrontendMessage(extension=answer))
            except FrameError as exc:
                log.error("extension for job %s not sent: %s", waiter.job_id, exc)

    def publish_log(self, waiters: list[Waiter], text: str) -> None:
        for waiter in waiters:
            if waiter.job_id in self.m.running:
                self.m.hub.log(waiter.job_id, text)

    # ---- built ahead, then launched --------------------------------------------------------

    def built_ahead(self, queued: QueuedJob) -> bool:
        """The job goes to a build process first: its kernels can be, there is a GPU to build
        for (Triton runs in its interpreter without one), and a build process pool, this
        node's or the builders'. A node without build processes of its own (GPU nodes that
        leave compiling to `--role builder`) keeps such a job for the builders until they
        answer or the wait ends (artifact_store: ahead_ended); then it runs whole."""
        if not queued.prebuild:
            return False
        if queued.prebuild != "cuda" and not self.build_arch(queued):
            return False
        if BUILD_DEVICE in self.m.fleet.devices:
            return self.m.fleet.device_takes_jobs(BUILD_DEVICE)
        remote = self.extensions.remote
        if remote is not None and not remote.ahead_ended(queued.job_id):
            return True
        # Nothing will build it ahead: from now on a plain job (offered no more).
        queued.prebuild = ""
        if remote is not None:
            self.m.hub.log(
                queued.job_id,
                "kerneleval: no builder built it ahead and this node has no build processes: "
                "runs in a job process of its own",
            )
        return False

    def judges_launch(self, spec: kernel_pb2.JobSpec) -> bool:
        """A kernel built ahead may be launched alone and its reference, which has host code,
        run in its judge only (--judge-launches): this node's job processes judge, and what
        the judge reads fits the record or the shares (a launch process cannot judge
        itself)."""
        c = self.m.config
        return (
            c.judge_launches
            and self.engine_judges
            and c.record_max_mib > 0
            and prebuild.judged_launch_fits(
                spec, c.record_max_mib << 20, c.record_share_max_mib << 20
            )
        )

    def build_arch(self, queued: QueuedJob) -> str:
        """The architecture to build for: the job's GPU's, else the one all GPUs share."""
        if queued.device_index is not None:
            arch = self.device_arch.get(queued.device_index, "")
        else:
            name = self.m.fleet.device_name
            archs = {a for i, a in self.device_arch.items() if queued.fits(i, name(i))}
            arch = archs.pop() if len(archs) == 1 else ""
        if not arch and queued.prebuild == "cuda" and not self.device_arch:
            return prebuild.cpu_arch()  # no GPU here: nvcc checks it, nothing launches it
        return arch

    def built_earlier(self, job_id: str, arch: str) -> bool:
        """A job with exactly this code was built for this architecture: it skips its build
        and waits for a launch process with what was built then. (A job just submitted is
        stored as its launch is sent, or after the dispatch: submit.)"""
        new = self.m.unstored(job_id)
        job = copy_job(new.job) if new is not None else self.m.store.get(job_id)
        if job is None or job.state in TERMINAL:
            return True  # nothing to build
        files = self.compile_cache.files_for(job.spec, built_key(arch))
        artifacts = as_artifacts(files) if files else []
        if not artifacts or prebuild.check_artifacts(job.spec, artifacts):
            return False
        job.state = job_pb2.JOB_STATE_RUNNING
        job.attempt_count += 1
        job.worker_id = ""
        stamp(job.start_time)
        event = self.m.hub.next_event(job_id)
        event.log.text = "built ahead for a job with the same code: waits for a launch process"
        if new is not None:
            new.later.append(event)
        else:
            self.m.store.update(job)
            self.m.hub.publish(event)
        run = self.m.track(job, JobProcess("", 0, BUILD_DEVICE, False, 0, gone=True))
        self.await_launch(run, artifacts)
        return True

    def builds_here(self, queued: QueuedJob) -> bool:
        """Built ahead by a build process of this front end: not while the shared artifact
        store and the builders are asked for it (jobs/builds/artifact_store.py)."""
        remote = self.extensions.remote
        return self.built_ahead(queued) and (remote is None or remote.builds_here(queued.job_id))

    def built_elsewhere(
        self, job_id: str, arch: str, built_by: str, built: job_channel_pb2.BuildOutcome
    ) -> None:
        """A queued job's build answer from the shared artifact store or a builder
        (jobs/builds/artifact_store.py): the job starts as a build job `built_by` ran for
        `arch`, and goes on as after a build here (on_built: a launch, its result, or run
        whole)."""
        if not self.m.queue.remove(job_id):
            return  # it ended, or started, meanwhile
        job = self.m.store.get(job_id)
        if job is None or job.state in TERMINAL:
            return
        self.m.mark_started(job, built_by, new_attempt=True)
        proc = JobProcess(built_by, 0, BUILD_DEVICE, False, 0, job_id=job_id, gone=True)
        run = self.m.track(job, proc)
        run.build_arch = arch
        built.job_id = job_id
        self.on_built(proc, built)

    def await_launch(self, run: Running, artifacts: list[job_channel_pb2.KernelArtifact]) -> None:
        """Built: the job waits, its deadline paused, for a launch process."""
        assert run.deadline is not None
        run.deadline.pause()
        run.built = artifacts
        run.stage = Stage.AWAITING_LAUNCH
        self.launched.add(run.job.job_id)
        self.launch_queue.append(run.job.job_id)

    def next_launch(self, device_index: int) -> str:
        """The oldest built job that may run on the device."""
        name = self.m.fleet.device_name(device_index)
        for job_id in self.launch_queue:
            run = self.m.running.get(job_id)
            if run is None:
                continue
            if placement.may_run_on(run.job.spec, device_index, name):
                self.launch_queue.remove(job_id)
                return job_id
        return ""

    def on_built(self, proc: JobProcess, built: job_channel_pb2.BuildOutcome) -> None:
        """A build process's answer: the job ends (a compile error), waits for a launch
        process with what was built, or goes back to the queue to run whole."""
        run = self.m.running.get(built.job_id)
        if run is None or run.proc is not proc:
            return
        if run.kill is not None:  # its cancel or timeout crossed this answer: its exit ends it
            return
        proc.gone = True  # a build process builds once, then exits
        self.m.watch_exit(proc)
        self.m.free_process(proc, completed=True)
        job = run.job
        if not built.run_whole and not built.HasField("result"):
            self._with_given_reference(run, built)
        problem = (
            ""
            if built.run_whole or built.HasField("result")
            else (prebuild.check_artifacts(job.spec, list(built.artifacts)))
        )
        if built.HasField("result") or problem:
            result = job_pb2.EvalResult()
            if problem:  # the build process broke its contract: as a protocol violation
                result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
                result.error.exception_type = "ProtocolViolation"
                result.error.message = f"build process {proc.worker_id}: {problem}"
            else:
                result.CopyFrom(built.result)
                result.ClearField("timing_window")
            self.m.finish(job, job_pb2.JOB_STATE_DONE, result)
            return
        if self.extensions.remote is not None:  # for the other nodes (builds/artifact_store.py)
            self.extensions.remote.kept_ahead(job.job_id, job.spec, run.build_arch, built)
        if built.run_whole:
            self.m.hub.log(
                job.job_id, f"not built ahead ({built.run_whole}): runs in a job process of its own"
            )
            self.run_whole.add(job.job_id)
            job.attempt_count -= 1  # its whole run is the same attempt
            assert run.deadline is not None
            run.deadline.cancel()
            self.m.running.pop(job.job_id, None)
            self.m.requeue(job)
        else:
            self.m.hub.log(
                job.job_id, f"built ahead by {proc.worker_id}: waits for a launch process"
            )
            why = self.compile_cache.store(
                job.spec, built_key(run.build_arch), [], as_files(list(built.artifacts))
            )
            if why:
                log.warning("what job %s built is not kept: %s", job.job_id, why)
            self.keep_reference(job.spec, run, built)
            self.await_launch(run, list(built.artifacts))
        self.m.dispatch()

    def reference_built_before(
        self, spec: kernel_pb2.JobSpec, arch: str
    ) -> list[job_channel_pb2.KernelArtifact]:
        """The job's raw CUDA reference as a build made it for an earlier job, if kept."""
        if spec.reference.type != kernel_pb2.KERNEL_TYPE_CUDA or not spec.reference.io.args:
            return []
        files = self.compile_cache.files_for(built_reference(spec), built_key(arch))
        artifacts = as_artifacts(files) if files else []
        return artifacts if [a.role for a in artifacts] == ["reference"] else []

    def _with_given_reference(self, run: Running, built: job_channel_pb2.BuildOutcome) -> None:
        """A build given the job's reference built the kernel alone: the job's artifacts are
        both (what a build of the whole job answers, as the other nodes expect it too)."""
        if run.given_reference and all(a.role != "reference" for a in built.artifacts):
            built.artifacts.extend(run.given_reference)

    def keep_reference(
        self, spec: kernel_pb2.JobSpec, run: Running, built: job_channel_pb2.BuildOutcome
    ) -> None:
        """A raw CUDA reference built beside a raw CUDA kernel is kept for every later job
        with that reference: nvcc made each from its own source, and no candidate's code ran
        in that build (a Triton kernel's module runs where it is built: what is built beside
        one is kept only with it, under the whole job's code)."""
        if (
            run.given_reference
            or spec.kernel.type != kernel_pb2.KERNEL_TYPE_CUDA
            or spec.reference.type != kernel_pb2.KERNEL_TYPE_CUDA
        ):
            return
        reference = [a for a in built.artifacts if a.role == "reference"]
        if len(reference) == 1:
            self.compile_cache.store(
                built_reference(spec), built_key(run.build_arch), [], as_files(reference)
            )
