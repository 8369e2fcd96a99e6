"""A started job as the front end follows it, from its start on a process to its end: its
`Running` record, and where it is (`Stage`) as one value.

A job goes QUEUED -> RUNNING in the store when a process takes it (manager.py `start`); from
then on the manager follows it here until `finish`. On the way it may be:

    RUNNING            its process (whole, a build, a launch or its judge) runs it
    AWAITING_LAUNCH    built ahead, waiting for a launch process (its deadline paused)
    AWAITING_JUDGE     its kernel ran OK and handed over, waiting for a judge process
                       (its deadline paused)
    TIMING_WAITS_KERNEL  its judge asked to time the reference while its kernel's process
                       had not exited yet (judging.py `kernel_exited` grants it)

and, whatever the stage, the front end may have asked its process to be killed (`kill`:
its timeout ran out, or a client cancelled it): the process's exit then ends the job so.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server.fleet import faults
from kerneleval_server.fleet.job_processes import JobProcess
from kerneleval_server.fleet.timing_windows import Window
from kerneleval_server.jobs.deadline import Deadline
from kerneleval_server.jobs.judge_record import Record


class Stage(enum.Enum):
    """Where a started job is (the module docstring says each)."""

    RUNNING = "running"
    AWAITING_LAUNCH = "awaiting a launch process"
    AWAITING_JUDGE = "awaiting a judge process"
    TIMING_WAITS_KERNEL = "its judge's timing waits for its kernel's process to exit"


class Kill(enum.Enum):
    """Why the front end asked for a running job's process to be killed."""

    TIMEOUT = "timeout"
    CANCEL = "cancel"


@dataclass
class Running:
    job: job_pb2.Job
    proc: JobProcess
    timeout_s: float
    phase: int = 0
    stage: Stage = Stage.RUNNING
    kill: Kill | None = None  # asked of its process by the front end, if anything
    xid: faults.XidSeen | None = None
    timers: list[asyncio.TimerHandle] = field(default_factory=list)
    deadline: Deadline | None = None
    grant_asked_at: float = 0.0  # loop time of a pending GPU request
    outcome_wait: asyncio.TimerHandle | None = None
    outcome: job_channel_pb2.JobOutcome | None = None
    compile_cache: list[job_channel_pb2.CacheFile] = field(default_factory=list)  # given
    window: Window | None = None  # its timing window, once granted
    # Built ahead, waiting for a launch process (its deadline paused): what was built.
    built: list[job_channel_pb2.KernelArtifact] = field(default_factory=list)
    build_arch: str = ""  # what its build process built for
    # A build job given its raw CUDA reference, built for an earlier job (compile_cache.py:
    # built_reference): its build process builds the kernel alone.
    given_reference: list[job_channel_pb2.KernelArtifact] = field(default_factory=list)
    crowded: bool = False  # another job ran on its GPU meanwhile (their memory was its too)
    memory_key: str = ""  # its problem, for GPU memory admission (fleet/gpu_memory.py)
    memory_wait_said: bool = False  # its events said it waits for GPU memory
    # Judged outside the kernel's process (judging.py): its record, and between the kernel's
    # outcome and a judge process taking it (deadline paused), waiting; the window the
    # kernel was timed in (the judge times the reference in one of its own).
    record: Record | None = None
    kernel_window: Window | None = None
    # The kernel's process from its outcome until it has exited: its judge may start and
    # check meanwhile, but times the reference only once nothing of the kernel is left.
    kernel_proc: JobProcess | None = None
    # Its judge, started ahead with its kernel (judging.start_ahead), until its JudgeGo.
    ahead: JobProcess | None = None
    # Its kernel's process stays after its outcome, serving its timed calls to the judge
    # (JobOutcome.serves_timed_calls), and the judge's window lets it run (drives_kernel).
    kernel_serves: bool = False
    drives_kernel: bool = False

    @property
    def judged_now(self) -> bool:
        """Its kernel ran OK and handed over: what its process says now is its judge's."""
        return self.record is not None and self.record.kernel_outcome is not None

    def stop_timers(self) -> None:
        """Its kill's fallback, its deadline and its outcome's wait for an XID stop."""
        for timer in self.timers:
            timer.cancel()
        if self.deadline is not None:
            self.deadline.cancel()
        if self.outcome_wait is not None:
            self.outcome_wait.cancel()

    # The stage in judging.py's and gpu_use.py's words.
    @property
    def awaiting_launch(self) -> bool:
        return self.stage is Stage.AWAITING_LAUNCH

    @property
    def awaiting_judge(self) -> bool:
        return self.stage is Stage.AWAITING_JUDGE

    @awaiting_judge.setter
    def awaiting_judge(self, value: bool) -> None:
        self._enter(Stage.AWAITING_JUDGE, value)

    @property
    def timing_waits_kernel(self) -> bool:
        return self.stage is Stage.TIMING_WAITS_KERNEL

    @timing_waits_kernel.setter
    def timing_waits_kernel(self, value: bool) -> None:
        self._enter(Stage.TIMING_WAITS_KERNEL, value)

    def _enter(self, stage: Stage, value: bool) -> None:
        """Into `stage` (value true), or out of it back to RUNNING."""
        if value:
            self.stage = stage
        elif self.stage is stage:
            self.stage = Stage.RUNNING


@dataclass
class Unstored:
    """A job submit made and has not stored yet (it is stored as it is sent to a process)."""

    job: job_pb2.Job
    event: job_pb2.JobEvent  # its queued event
    cache_key: str
    idempotency_key: str
    later: list[job_pb2.JobEvent] = field(default_factory=list)  # stored after it


def stamp(ts: Any) -> None:
    ts.FromNanoseconds(time.time_ns())


def copy_job(job: job_pb2.Job) -> job_pb2.Job:
    out = job_pb2.Job()
    out.CopyFrom(job)
    return out


def xid_suspects(
    running: Iterable[Running], x: watchdog_pb2.XidObserved
) -> list[tuple[Running, bool]]:
    """The jobs an XID belongs to, and whether that is sure.

    Sure: the kernel log named the job's process, or a job process on that device just
    reported a poisoned context (NVML is ~2 s late, so by now that process may be gone and
    the watchdog may name whoever runs on the GPU next). Otherwise the watchdog's guess
    (the job processes running jobs there): the XID is noted, but never turns an OK into a fault.
    """
    on_device = [r for r in running if r.proc.device_index == x.device_index]
    by_pid = [r for r in on_device if x.pid and r.proc.pid == x.pid]
    if by_pid:
        return [(r, True) for r in by_pid]
    waiting = [r for r in on_device if r.outcome is not None and r.outcome.context_poisoned]
    if waiting:
        return [(r, True) for r in waiting]
    job_ids, worker_ids = set(x.job_ids), set(x.worker_ids)
    named = [r for r in on_device if r.job.job_id in job_ids or r.proc.worker_id in worker_ids]
    return [(r, False) for r in named or on_device]
