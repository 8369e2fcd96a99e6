"""A job whose process is gone before its outcome (manager.py `process_exited`, `cancel`,
`on_deadline`): the kill the front end asks for (`kill`, with a fallback should the watchdog
never report the exit: `lost`), and what the exit means for the job (`before_outcome`): a
cancel ends it CANCELLED, a fault the exit names (faults.classify_exit) ends it with that
verdict, and an ambiguous loss runs it again while attempts remain (`retry_or_fail`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server import metrics as metrics_mod
from kerneleval_server.config import Config
from kerneleval_server.fleet import faults
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.jobs import endings
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.judging import Judges
from kerneleval_server.jobs.processes import ProcessKeeper
from kerneleval_server.jobs.running import Kill, Running, Stage
from kerneleval_server.metrics import Metrics

KILL_FALLBACK_S = 10.0  # a kill the watchdog never confirms still ends the job


class ExitsHost(Protocol):
    """What a job's lost process asks of the job life cycle (manager.py JobManager)."""

    @property
    def config(self) -> Config: ...
    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def watchdog(self) -> WatchdogLike | None: ...
    @property
    def judges(self) -> Judges: ...
    @property
    def processes(self) -> ProcessKeeper: ...
    def spawn(self, coro: Awaitable[Any]) -> None: ...
    def dispatch(self) -> None: ...
    def requeue(self, job: job_pb2.Job) -> None: ...
    def finish(
        self,
        job: job_pb2.Job,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
        reason: str = "",
    ) -> None: ...


class Exits:
    def __init__(self, m: ExitsHost) -> None:
        self.m = m

    def kill(self, run: Running, reason: str) -> None:
        """Asks the watchdog to kill the job's process (`reason`: a metrics.KILL_*); its exit
        ends the job, or, never reported, the fallback does."""
        run.proc.gone = True
        if self.m.watchdog is not None:
            self.m.spawn(self.m.watchdog.kill_worker(run.proc.worker_id, reason))
        run.timers.append(
            asyncio.get_running_loop().call_later(
                KILL_FALLBACK_S, self.lost, run.job.job_id, run.proc.worker_id
            )
        )

    def lost(self, job_id: str, worker_id: str) -> None:
        """The job's process is gone and no exit was reported (its kill unconfirmed, its
        channel dropped): as an exit the front end makes up."""
        run = self.m.running.get(job_id)
        if run is None or run.proc.worker_id != worker_id:
            return
        exited = watchdog_pb2.WorkerExited(exit_code=-1, reason=metrics_mod.LOST_REASON)
        exited.worker.worker_id = worker_id
        exited.worker.pid = run.proc.pid
        exited.worker.device_index = run.proc.device_index
        self.before_outcome(run, exited)

    def before_outcome(self, run: Running, exited: watchdog_pb2.WorkerExited) -> None:
        """The job's process exited: unless its outcome (or its build) was in, or its kernel
        was handed to a judge, the job ends or runs again."""
        if run.stage is Stage.AWAITING_JUDGE:  # the kernel's process is gone (kernel_exited)
            return
        if run.outcome is not None or run.stage is Stage.AWAITING_LAUNCH:
            return  # the result (or the build) is in; the exit is the process leaving
        if run.kill is Kill.CANCEL:
            result = job_pb2.EvalResult()
            result.fault.worker_restarted = exited.restarting
            result.fault.description = f"cancelled; worker {run.proc.worker_id} was replaced"
            self.m.finish(run.job, job_pb2.JOB_STATE_CANCELLED, result, "cancelled by a client")
            return
        decision = faults.classify_exit(
            exited,
            pending=run.kill.value if run.kill else "",
            xid=run.xid,
            phase=run.phase,
            timeout_s=run.timeout_s,
        )
        if decision.verdict == job_pb2.VERDICT_UNSPECIFIED:  # ambiguous: maybe not its doing
            self.m.processes.let_go(run, completed=False)
            self.retry_or_fail(run.job, decision.fault, job_pb2.VERDICT_CRASHED)
            self.m.metrics.running.set(len(self.m.running))
            self.m.dispatch()
            return
        event = self.m.hub.next_event(run.job.job_id)
        event.fault.CopyFrom(decision.fault)
        self.m.hub.publish(event)
        self.m.finish(run.job, job_pb2.JOB_STATE_DONE, endings.from_exit(run, decision))

    def retry_or_fail(
        self,
        job: job_pb2.Job,
        fault: job_pb2.FaultInfo,
        verdict: job_pb2.Verdict,
        service_fault: bool = False,
    ) -> None:
        """An ambiguous loss: run the job again while attempts remain. Past them, the job ends
        FAILED when the service lost it (front-end restarts), else DONE with the verdict."""
        if job.attempt_count < self.m.config.max_attempts:
            lost = self.m.running.pop(job.job_id, None)
            if lost is not None:
                self.m.judges.drop_record(lost)
            fault.description += f"; re-queued (attempt {job.attempt_count + 1})"
            event = self.m.hub.next_event(job.job_id)
            event.fault.CopyFrom(fault)
            self.m.hub.publish(event)
            self.m.requeue(job)
            return
        result = job_pb2.EvalResult()
        result.fault.CopyFrom(fault)
        result.fault.description += f"; not retried after {job.attempt_count} attempts"
        if service_fault:
            self.m.finish(job, job_pb2.JOB_STATE_FAILED, result, result.fault.description)
            return
        result.verdict = verdict or job_pb2.VERDICT_CRASHED
        self.m.finish(job, job_pb2.JOB_STATE_DONE, result)
