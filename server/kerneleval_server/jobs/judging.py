"""Compared jobs judged outside the kernel's process (issue 13; docs/TRUST.md "The judge").

A compared job whose kernel's host code runs in its job process gets a record: a memfd the
front end makes and hands to that process with its AssignJob. The process writes the kernel's
outputs there (engine/record.py). When it answers OK, the record is sealed (no more writes,
no resizing: the kernel's code cannot change it after the fact) and handed to a second, fresh
job process on the same GPU, the judge, which imports only the reference and answers the
job's final result. The front end never reads the record: it only makes, seals and passes it.

A judge process that judged cleanly stays for the next job with the same reference (a
standing judge, keyed by `reference_key`): only the reference's own code ever ran in it, and
the next reference to run there is that same code.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Iterable
from typing import Any, Protocol

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.config import Config
from kerneleval_server.fleet.gpu_memory import GpuMemory
from kerneleval_server.fleet.job_processes import JobProcess, JobProcessTable
from kerneleval_server.fleet.timing_windows import TimingWindows
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.framing import FrameError
from kerneleval_server.jobproc import GATED_PHASES
from kerneleval_server.jobs.builds import prebuild
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.gpu_use import GpuUse
from kerneleval_server.jobs.judge_record import Record
from kerneleval_server.jobs.path_measures import PathMeasures
from kerneleval_server.jobs.reference_times import ReferenceTimes
from kerneleval_server.jobs.running import Running
from kerneleval_server.jobs.scheduler import GpuGate
from kerneleval_server.jobs.store import JobStore
from kerneleval_server.spec.validation import is_timed


class JudgesHost(Protocol):
    """What the judges ask of the job life cycle (manager.py JobManager)."""

    @property
    def config(self) -> Config: ...
    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def store(self) -> JobStore: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def gate(self) -> GpuGate: ...
    @property
    def windows(self) -> TimingWindows: ...
    @property
    def memory(self) -> GpuMemory: ...
    @property
    def gpu_use(self) -> GpuUse: ...
    @property
    def watchdog(self) -> WatchdogLike | None: ...
    def dispatch(self) -> None: ...
    def on_protocol_violation(self, proc: JobProcess, what: str) -> None: ...
    def finish(
        self,
        job: job_pb2.Job,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
        reason: str = "",
    ) -> None: ...
    def free_process(self, proc: JobProcess, completed: bool) -> None: ...
    def kill_lost(self, proc: JobProcess) -> None: ...
    def watch_exit(self, proc: JobProcess) -> None: ...
    def busy_on(self, device: int, but: JobProcess | None = None) -> bool: ...
    def held_devices(self) -> dict[int, str]: ...
    def spawn(self, coro: Awaitable[Any]) -> None: ...


log = logging.getLogger("kerneleval.jobs")
SEAL_RETRY_S = 0.05  # a judged job's record, still mapped by its kernel's process: try again
STANDING_JUDGE_IDLE_S = 30.0  # a standing judge with nothing to judge for this long leaves
# A judged job waits for a busy standing judge of its reference rather than take a fresh job
# process while this many or fewer wait for each: fresh processes come at about 5 a second a
# host (issue 12), and a fresh judge per job held a ModelNew batch at 1.4 processes a job.
JOBS_WAITING_PER_STANDING_JUDGE = 2
# A judge is started ahead only for problems seen to need at most this much GPU memory: it
# holds the trials' reference outputs beside the kernel's process (engine: AHEAD_MAX_BYTES).
AHEAD_MAX_FOOTPRINT = 2 << 30
FREE_A_SLOT_EVERY_S = 1.0  # a launch process retired for a judge: the next, per GPU, at most


def wanted(spec: kernel_pb2.JobSpec, hello: job_channel_pb2.Hello | None) -> bool:
    """A compared job (a GPU MODE task too: its checker runs in the judge) run whole by an
    engine that judges (test engines do not). The debug aids re-run the job in a child
    process of its own (engine/isolated.py): such jobs are judged in the kernel's process, as
    the docs say."""
    if hello is None or not hello.judges or not spec.HasField("reference"):
        return False
    o = spec.options
    return not (o.sanitize or o.device_metrics or o.launch_blocking or o.device_side_assertions)


def times_kernel(spec: kernel_pb2.JobSpec, prebuilt: object) -> bool:
    """Whether the judge of a job drives and times its kernel's calls in the kernel's process
    (engine/timed_calls.py; AssignJob.timed_by_judge): every timed job whose kernel's host code
    runs there (not a launch of kernels built ahead: its own path). A GPU MODE task's too, one
    session per benchmark case (engine/gpumode_judge_timing.py); one whose data cannot be
    shared is timed in its own process, as its result says."""
    return is_timed(spec.options) and not prebuilt


def record_for(
    job_id: str,
    spec: kernel_pb2.JobSpec,
    hello: job_channel_pb2.Hello | None,
    config: Config,
    prebuilt: list[job_channel_pb2.KernelArtifact],
    build_arch: str,
) -> tuple[Record | None, bool]:
    """The record a job's kernel's process is given (None: it is judged there, or not at
    all), and whether its judge times the kernel (AssignJob.timed_by_judge): a job run whole,
    or launched built ahead with its reference judged outside (prebuild.reference_judged);
    never a build job (`build_arch`)."""
    if (
        build_arch
        or (prebuilt and not prebuild.reference_judged(spec))
        or config.record_max_mib <= 0
        or not wanted(spec, hello)
    ):
        return None, False
    record = Record.make(
        job_id, config.record_max_mib << 20, spec, config.record_share_max_mib << 20
    )
    timed_by_judge = times_kernel(spec, prebuilt)
    # Its process serves the calls only with the record's socket.
    record.timed_by_judge = timed_by_judge and record.share_theirs >= 0
    return record, timed_by_judge


def judge_request(
    kernel: job_pb2.EvalResult,
    kernel_gone: bool,
    reference_time: tuple[job_pb2.RuntimeStats, float] | None = None,
    paths: Iterable[job_channel_pb2.PathMeasure] = (),
) -> job_channel_pb2.JudgeRequest:
    request = job_channel_pb2.JudgeRequest(
        candidate=kernel, kernel_gone=kernel_gone, path_measures=paths
    )
    if reference_time is not None:
        request.reference_runtime.CopyFrom(reference_time[0])
        request.reference_runtime_age_s = reference_time[1]
    return request


def unjudged(kernel: job_pb2.EvalResult) -> None:
    """A judged job whose kernel's process ended it (its verdict not OK) never reaches its
    judge: what only a judge may say is dropped from the process's report. A process that
    claimed its outputs passed, then failed on purpose, would otherwise skip the judge and
    still read correct (a failure it reports of itself stands)."""
    if kernel.correctness_status in (job_pb2.CORRECTNESS_PASSED, job_pb2.CORRECTNESS_NOT_CHECKED):
        kernel.correctness_status = job_pb2.CORRECTNESS_UNSPECIFIED
    if kernel.correctness_status != job_pb2.CORRECTNESS_FAILED:
        kernel.correctness = False
        kernel.ClearField("validation")
    for name in (
        "speedup", "speedup_suspicious", "reference_runtime", "reference_runtime_age",
        "compiled_reference_runtime", "compiled_speedup", "compile_time",
    ):  # fmt: skip
        kernel.ClearField(name)


def timed_by_itself(result: job_pb2.EvalResult) -> None:
    """A time from the process that ran the kernel's code is the kernel's word: never said to
    be timed from outside (RuntimeStats.timed_from_outside), whatever that process claims.
    Only a judge's answer says so."""
    # Cleared, not set to False: setting it would make an absent runtime present.
    if result.HasField("runtime"):
        result.runtime.ClearField("timed_from_outside")
    for case in result.benchmark_cases:
        if case.HasField("runtime"):
            case.runtime.ClearField("timed_from_outside")


def tampered(why: str) -> job_pb2.EvalResult:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
    result.failed_side = job_pb2.SIDE_KERNEL
    result.error.exception_type = "Tampering"
    result.error.message = "tampering: " + why
    return result


class Judges:
    """The front end's side of the judge: judged jobs waiting for one (`queue`, in the order
    their kernels ran), the hand-over from a kernel's outcome to its judge, and the standing
    judges. `m` is the job manager (jobs/manager.py): its running jobs, dispatch, GPU windows,
    job processes and job ends."""

    def __init__(self, m: JudgesHost, exit_grace_s: float, kill_fallback_s: float) -> None:
        self.m = m
        self.queue: deque[str] = deque()  # their kernel ran OK: each waits for a judge
        self.freed_for_judge: dict[int, float] = {}  # GPU -> when a launch process left for one
        self.free_later: set[int] = set()  # GPUs where a dispatch is due to free the next
        self.exit_grace_s = exit_grace_s  # a job process's exit after its outcome, at most
        self.kill_fallback_s = kill_fallback_s  # a kill the watchdog never confirms
        self.times = ReferenceTimes(m.config.reference_time_reuse_s)
        self.paths = PathMeasures()  # judges' measures of their own path, for the next ones
        self.given_time: set[str] = set()  # jobs whose judge was given an earlier time

    def forget(self, job_id: str) -> None:
        """The job ended: it waits for no judge."""
        if job_id in self.queue:
            self.queue.remove(job_id)
        self.given_time.discard(job_id)

    # ---- judge ahead (--judge-ahead) --------------------------------------------------

    def start_ahead(self, run: Running) -> None:
        """The kernel of a judged job has just been given to its process: an idle standing
        judge of its reference on its GPU gets the job too, ahead (JudgeRequest.ahead). It
        runs the reference on the trials' inputs meanwhile, with a check's GPU grant, says
        JudgePrepared (the grant goes back) and waits; the kernel's outcome sends it the
        JudgeGo (`_start`), and the verdict waits only for the comparison. Only on a GPU not
        held for a job alone, for a problem seen to fit AHEAD_MAX_FOOTPRINT, with its GPU
        memory admitted now; never for a GPU MODE task (its checks are per case)."""
        record, spec, device = run.record, run.job.spec, run.job.device_index
        if (
            record is None
            or not self.m.config.judge_ahead
            or spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE
            or device in self.m.held_devices()
        ):
            return
        judge = next(
            (
                w for w in self.m.job_processes.by_id.values()
                if w.ready and w.judge_key == record.reference_key and w.device_index == device
            ),
            None,
        )  # fmt: skip
        if judge is None:
            return
        key = self.m.gpu_use.memory_key(run, judge=True)
        need = self.m.memory.footprint(key)
        if need is not None and need > AHEAD_MAX_FOOTPRINT:
            return
        if not self.m.memory.admit(device, judge.worker_id, key):
            return
        try:
            sent = judge.assign(
                run.job.job_id, spec, run.job.attempt_count,
                record_fd=record.fd, record_max_bytes=record.max_bytes,
                judge=job_channel_pb2.JudgeRequest(
                    ahead=True, path_measures=self.paths.given(device, record.reference_key)
                ),
                share_fd=record.share_ours, share_max_bytes=record.share_max_bytes,
            )  # fmt: skip
        except FrameError:
            self.m.memory.release(device, judge.worker_id)
            return
        run.ahead = judge
        if self.m.watchdog is not None:
            self.m.spawn(self.m.watchdog.set_job(judge.worker_id, run.job.job_id))
        if not sent:
            run.ahead = None
            self.m.kill_lost(judge)
            return
        # Its check (it shares the GPU) is asked for with its job, as a launch's is
        # (GpuUse.ask_early): the grant is in by the time it has built the reference, and it
        # is prepared before the kernel's outputs are, not a round trip later.
        judge.used_gpu = judge.check_asked = True
        self.m.gate.request(device, judge.worker_id, False)

    @staticmethod
    def answers_ahead(proc: JobProcess, job_id: str, run: Running | None) -> bool:
        """Whether the process's frame for `job_id` is a judge's started ahead, not the
        job's: before its JudgeGo, or with the job gone from it (ended, or another attempt's
        `run`)."""
        return bool(job_id) and proc.ahead_job == job_id and (run is None or run.proc is not proc)

    def on_ahead_message(
        self, run: Running | None, judge: JobProcess, msg: job_channel_pb2.JobProcessMessage
    ) -> None:
        """A frame of a judge started ahead, before its JudgeGo: its check asks the GPU gate
        for a share of the GPU (its memory was admitted at its start), JudgePrepared gives
        it back, its log lines are the job's. Its phases are not the job's (the kernel's
        process reports those); a timing phase ahead breaks the protocol. Its job may have
        left it already (`run` None or another attempt's): its check is granted all the same,
        or it would wait for ever and never read the JudgeGo that abandons the job."""
        kind = msg.WhichOneof("kind")
        if kind == "phase" and msg.phase.phase == job_pb2.PHASE_PROFILING:
            self.m.on_protocol_violation(judge, "a timing phase from a judge started ahead")
        elif kind == "phase" and msg.phase.phase in GATED_PHASES:
            judge.used_gpu = True
            if judge.check_asked:
                judge.check_asked = False  # asked for with its job: granted or waiting
            else:
                self.m.gate.request(judge.device_index, judge.worker_id, False)
        elif kind == "log" and run is not None and run.ahead is judge:
            self.m.hub.log(run.job.job_id, msg.log.text)

    def ahead_answered(self, judge: JobProcess, outcome: job_channel_pb2.JobOutcome) -> None:
        """A judge started ahead answered before its JudgeGo: it left an abandoned job, or
        its reference failed ahead (the job's judge then starts afresh once the kernel's
        outputs are in, and says so). Clean, it stands again for its reference."""
        run = self.m.running.get(judge.job_id)
        if run is not None and run.ahead is judge:
            run.ahead = None
        judge.ahead_job = judge.prepared_job = ""
        judge.check_asked = False
        self.m.free_process(judge, completed=False)
        self.m.memory.release(judge.device_index, judge.worker_id)
        if outcome.reusable and not outcome.context_poisoned and not judge.gone:
            judge.reusable, judge.used_gpu = True, False
            self.stand(judge, judge.judge_key)
        else:
            self.retire(judge, "its reference failed while it judged ahead")
        self.m.dispatch()

    def leave_ahead(self, run: Running) -> None:
        """The job is done with its record (it ended, or runs again) before its kernel's
        outputs were in: its judge started ahead answers at once, and stays."""
        judge, run.ahead = run.ahead, None
        if judge is None or judge.gone:
            return
        go = job_channel_pb2.JudgeGo(job_id=run.job.job_id, abandon=True)
        if not judge.send(job_channel_pb2.FrontendMessage(judge_go=go)):
            self.m.kill_lost(judge)

    def drop_record(self, run: Running) -> None:
        """The job is done with its record: closed, what its shares held of the GPU given
        back, a judge started ahead with it (which holds it too) told to leave it, and a
        kernel's process that served its timed calls watched to its exit."""
        self.leave_ahead(run)
        kernel = run.kernel_proc
        if run.kernel_serves and kernel is not None:
            self.m.watch_exit(kernel)
        record = run.record
        if record is None:
            return
        if record.gpu_held_on is not None:
            self.m.memory.release(record.gpu_held_on, record.holder)
            record.gpu_held_on = None
        record.close()

    def await_judge(self, run: Running, outcome: job_channel_pb2.JobOutcome) -> None:
        """The kernel ran OK in its process: its record, sealed (at once, unless that process
        still maps it writable: then once it has exited), waits (the deadline paused) for a
        judge on its GPU, a standing judge of its reference or a fresh job process. The
        judge's GPU use goes through memory admission like any job's (the kernel's process
        holds its memory until it has exited: a judge beside it ran KernelBench's problems
        out of memory), and it times the reference only once the kernel's process is gone."""
        assert run.record is not None and run.deadline is not None
        run.record.kernel_outcome = outcome
        run.kernel_window, run.window = run.window, None
        run.kernel_proc = run.proc
        run.deadline.pause()
        run.awaiting_judge = True
        if not run.kernel_serves:
            # Should the kernel's exit never be heard of (it is killed before this).
            run.timers.append(
                asyncio.get_running_loop().call_later(
                    self.exit_grace_s + self.kill_fallback_s, self.kernel_exited, run
                )
            )
        self._seal_and_queue(run.job.job_id, 0)

    def judged(self, run: Running, outcome: job_channel_pb2.JobOutcome) -> None:
        """The judge's outcome: a reference it timed itself, and the measures of its own path
        it took, are kept for the next judges."""
        device = run.proc.device_index if run.proc is not None else -1
        if outcome.job_id not in self.given_time and run.record is not None:
            outcome.result.ClearField("reference_runtime_age")  # no earlier time was given
            self.times.learn(device, run.job.spec, run.record.reference_key, outcome.result)
        if run.record is not None:
            self.paths.learn(device, run.record.reference_key, outcome.path_measures)
        self.given_time.discard(outcome.job_id)

    def kernel_exited(self, run: Running) -> None:
        """The judged job's kernel's process is gone: its record can be sealed if it could
        not be before, and a judge waiting to time may."""
        run.kernel_proc = None
        record = run.record
        if record is not None and record.shared_bytes and record.gpu_held_on is None:
            # Its process gave its memory back; what it handed over stays until judged.
            record.gpu_held_on = run.job.device_index
            self.m.memory.hold(record.gpu_held_on, record.holder, record.shared_bytes)
        self._seal_and_queue(run.job.job_id, 0)
        if run.timing_waits_kernel and self.m.running.get(run.job.job_id) is run:
            run.timing_waits_kernel = False
            self.m.gpu_use.ask(run)

    def _seal_and_queue(self, job_id: str, tries: int) -> None:
        run = self.m.running.get(job_id)
        if run is None or run.record is None or not run.awaiting_judge:
            return
        if job_id in self.queue:
            return
        if run.record.shared_bytes and run.kernel_proc is not None and not run.kernel_serves:
            # What it handed over by descriptor is read once nothing can write it. (One that
            # serves its timed calls stays: rewriting its checked outputs gains it nothing,
            # since its timed calls are checked on inputs it never saw.)
            return
        if run.record.seal():
            self.queue.append(job_id)
            self.m.dispatch()
            return
        if tries * SEAL_RETRY_S > self.exit_grace_s + 1:  # it is killed before this
            why = "the kernel's process kept the record of its outputs mapped for writing"
            self.m.finish(run.job, job_pb2.JOB_STATE_DONE, tampered(why))
            return
        run.timers.append(
            asyncio.get_running_loop().call_later(
                SEAL_RETRY_S, self._seal_and_queue, job_id, tries + 1
            )
        )

    def start(
        self, fresh: list[JobProcess], standing: list[JobProcess], held: dict[int, str]
    ) -> None:
        """Judged jobs in the order their kernels ran, each on the GPU its kernel ran on: to
        a standing judge of its reference there; while those are busy, up to
        JOBS_WAITING_PER_STANDING_JUDGE each wait for one, and the next go to fresh job
        processes. On a GPU held
        for a job to run alone, only that job's judge, once the GPU is empty, and the judges
        whose kernels' shares hold memory there (found on an H100: a job waiting for the GPU
        to itself waited for shares that only their judge's start gives back)."""
        waiting: dict[tuple[int, str], int] = {}  # (GPU, reference) -> jobs left waiting
        for job_id in list(self.queue):
            run = self.m.running.get(job_id)
            if run is None or run.record is None:
                self.queue.remove(job_id)
                continue
            if run.ahead is not None:
                # Its judge started ahead: the JudgeGo now, even on a GPU held for a job
                # alone (which waits for that judge: it counts as using the GPU).
                self.queue.remove(job_id)
                self._start(job_id, run.ahead)
                continue
            device = run.job.device_index
            alone = held.get(device)
            shares_held = run.record.gpu_held_on is not None
            if alone is not None and (alone != job_id or self.m.busy_on(device)):
                # Unless its kernel's shares hold memory there, or its kernel's process waits
                # for its timed calls: the job that waits for the GPU to itself waits for
                # them, and only this judge lets them go.
                if not shares_held and not run.kernel_serves:
                    continue
            key = run.record.reference_key
            here = [w for w in standing + fresh if w.ready and w.device_index == device]
            proc = next((w for w in here if w.judge_key == key), None)
            if proc is None and alone is None and not shares_held:
                queued = waiting.get((device, key), 0)
                if queued < self._standing_judges(device, key) * JOBS_WAITING_PER_STANDING_JUDGE:
                    waiting[(device, key)] = queued + 1
                    continue  # one of them is free soon, and a fresh process is dear
            proc = proc or next((w for w in here if not w.assigned_job_id), None)
            if proc is not None:
                self.queue.remove(job_id)
                self._start(job_id, proc)
            else:
                self._free_a_slot(device, fresh, key)

    def _standing_judges(self, device: int, key: str) -> int:
        """The standing judges of a reference on a GPU that are free soon (busy ones: a ready
        one was looked for). Not one started ahead for a kernel still running: that kernel
        may run to its timeout (a hung one held a judge, and the jobs waiting for it, 120 s)."""
        ahead = {r.ahead.worker_id for r in self.m.running.values() if r.ahead is not None}
        return sum(
            1 for w in self.m.job_processes.by_id.values()
            if w.judge_key == key and w.device_index == device and not w.gone
            and w.worker_id not in ahead
        )  # fmt: skip

    def _free_a_slot(self, device: int, fresh: list[JobProcess], key: str) -> None:
        """A judged job finds no judge on its GPU: where its slots hold launch processes
        (they stay, job after job; with --workers-per-device 1 the only slot did, and a
        launched job waited for ever), an idle one leaves, and the spare that takes its slot
        is the judge. Not while a standing judge of its reference is busy there (it is free
        soon); one a GPU per FREE_A_SLOT_EVERY_S (a spare's promotion takes less), the next
        asked for by a dispatch then."""
        procs = self.m.job_processes.by_id.values()
        if any(w.judge_key == key and w.device_index == device and not w.gone for w in procs):
            return
        loop = asyncio.get_running_loop()
        wait = self.freed_for_judge.get(device, -FREE_A_SLOT_EVERY_S) + FREE_A_SLOT_EVERY_S
        wait -= loop.time()
        if wait > 0:  # asked again then, should no spare have judged it meanwhile
            if device not in self.free_later:
                self.free_later.add(device)
                loop.call_later(wait, self._free_later_due, device)
            return
        idle = next((w for w in fresh if w.ready and w.device_index == device and w.launches), None)
        if idle is not None:  # a busy one is idle after its job: that outcome asks again
            self.freed_for_judge[device] = loop.time()
            self.retire(idle, "its slot goes to a judge (a judged job found none on its GPU)")

    def _free_later_due(self, device: int) -> None:
        self.free_later.discard(device)
        self.m.dispatch()

    def retire(self, proc: JobProcess, why: str) -> None:
        """An idle reusable job process leaves: its channel closed, it exits 0."""
        log.info("job process retired: %s", why, extra={"worker_id": proc.worker_id})
        proc.gone = True
        proc.reusable = False
        self.m.watch_exit(proc)
        if self.m.watchdog is not None:
            self.m.spawn(self.m.watchdog.set_job(proc.worker_id, "", finished=True))
        if proc.writer is not None:
            proc.writer.close()

    def stand(self, proc: JobProcess, key: str) -> None:
        """The judge judged cleanly: it stays, for jobs with the same reference only, outside
        its GPU's job process slots (a spare takes its slot, as when a process leaves), up to
        --standing-judges-per-device of them and STANDING_JUDGE_IDLE_S idle."""
        others = [
            w for w in self.m.job_processes.by_id.values()
            if w.judge_key and w is not proc and w.device_index == proc.device_index
            and not w.gone
        ]  # fmt: skip
        if len(others) >= max(1, self.m.config.standing_judges_per_device):
            # The one idle longest makes room (a loop moves on to its next problem), unless
            # all are busy: then this one goes.
            idle = sorted((w for w in others if w.ready), key=lambda w: w.idle_since)
            if not idle:
                self.retire(proc, f"{len(others)} judges stand on its GPU already, all busy")
                return
            self.retire(idle[0], "a judge of a newer reference takes its place")
        if not proc.judge_key and self.m.watchdog is not None:
            self.m.spawn(self.m.watchdog.set_job(proc.worker_id, "", finished=True))
        proc.judge_key = key
        proc.idle_since = since = asyncio.get_running_loop().time()
        asyncio.get_running_loop().call_later(
            STANDING_JUDGE_IDLE_S, self._retire_if_idle, proc, since
        )

    def _retire_if_idle(self, proc: JobProcess, since: float) -> None:
        if proc.ready and proc.judge_key and proc.idle_since == since:
            self.retire(proc, f"a standing judge idle for {STANDING_JUDGE_IDLE_S:.0f} s")
            self.m.dispatch()

    def _start(self, job_id: str, proc: JobProcess) -> None:
        run = self.m.running.get(job_id)
        if run is None or run.record is None or run.record.kernel_outcome is None:
            return
        job = run.job
        known = self.times.known(proc.device_index, job.spec, run.record.reference_key)
        paths = self.paths.given(proc.device_index, run.record.reference_key)
        request = judge_request(
            run.record.kernel_outcome.result, run.kernel_proc is None, known, paths
        )
        request.kernel_serves = run.kernel_serves and run.kernel_proc is not None
        request.kernel_timed_by_judge = run.record.timed_by_judge
        ahead = run.ahead is proc
        try:
            if ahead:
                go = job_channel_pb2.JudgeGo(job_id=job_id, request=request)
                sent = proc.send(job_channel_pb2.FrontendMessage(judge_go=go))
                run.ahead = None
            else:
                sent = proc.assign(
                    job_id,
                    job.spec,
                    job.attempt_count,
                    record_fd=run.record.fd,
                    record_max_bytes=run.record.max_bytes,
                    judge=request,
                    share_fd=run.record.share_ours,
                    share_max_bytes=run.record.share_max_bytes,
                )
        except FrameError as exc:
            self.m.finish(job, job_pb2.JOB_STATE_FAILED, job.result, f"no judge: {exc}")
            return
        run.proc, run.phase, run.outcome, run.awaiting_judge = proc, 0, None, False
        if known is not None:
            self.given_time.add(job_id)
        # What the kernel handed over by descriptor stays held (record.gpu_held_on) until
        # the judge's own admission covers it (GpuUse.admit): the memory is on the GPU, in
        # the judge's socket, until it has read it. Given back here, before the judge was
        # admitted, admission over-admitted by those bytes (an H200 RL step: 43 jobs ran out
        # of memory and re-ran alone, two of them out of memory again alone).
        job.worker_id = proc.worker_id
        proc.job_id = job_id
        event = self.m.hub.next_event(job_id)
        standing = (
            f", which judged {proc.completed} earlier job(s) of this reference only"
            if proc.judge_key
            else ""
        )
        timed = f"its time an earlier job's, {known[1]:.1f} s ago" if known else "is timed there"
        ran = "ran there on the trials' inputs while the kernel ran" if ahead else "runs there"
        event.log.text = (
            f"kerneleval: the kernel ran; judged by {proc.worker_id}, a process its code "
            f"never ran in{standing} (the reference {ran}, {timed})"
        )
        self.m.store.update(job, event)
        self.m.hub.publish(event, persisted=True)
        assert run.deadline is not None
        run.deadline.resume()
        if self.m.windows.frozen(proc.device_index):
            run.deadline.pause()
        if self.m.watchdog is not None and not ahead:
            self.m.spawn(self.m.watchdog.set_job(proc.worker_id, job_id))
        if not sent:
            self.m.kill_lost(proc)
        elif ahead and proc.prepared_job == job_id:
            # Waiting for its go (its JudgePrepared gave its share back): its check, next, is
            # asked for with it. One still preparing holds its share: it asks itself after.
            self.m.gpu_use.ask_early(run)
