"""The job life cycle's job processes (manager.py): the watchdog told which job each runs,
each watched to its exit once its job is done with it (killed if it stays), freed for the
next job or lost; the watchdog commands run in the background, their failures logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from kerneleval.internal.v1 import job_channel_pb2

from kerneleval_server import metrics as metrics_mod
from kerneleval_server.fleet.gpu_memory import GpuMemory, serving_bytes
from kerneleval_server.fleet.job_processes import JobProcess, JobProcessTable
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.jobs.builds.paths import BuildPaths
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.judging import Judges
from kerneleval_server.jobs.running import Running
from kerneleval_server.jobs.scheduler import GpuGate

log = logging.getLogger("kerneleval.jobs")
# A job process exits at once after its outcome or when its channel closes; one still alive
# this long after is killed (a candidate that sent an outcome itself, or closed the channel,
# and went on running must not keep its process and its GPU slot).
OUTCOME_EXIT_GRACE_S = 5.0


class ProcessesHost(Protocol):
    """What the keeping of job processes reads of the job life cycle (JobManager)."""

    @property
    def watchdog(self) -> WatchdogLike | None: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def gate(self) -> GpuGate: ...
    @property
    def memory(self) -> GpuMemory: ...
    @property
    def judges(self) -> Judges: ...
    @property
    def builds(self) -> BuildPaths: ...
    @property
    def hub(self) -> EventHub: ...


class ProcessKeeper:
    def __init__(self, m: ProcessesHost) -> None:
        self.m = m
        self._tasks: set[asyncio.Task[Any]] = set()

    def set_job(self, worker_id: str, job_id: str, finished: bool = False) -> None:
        """Tells the watchdog which job a job process runs ("": none), so that its exits and
        XIDs name the job (`finished`: its job is done; its slot goes to a spare)."""
        if self.m.watchdog is not None:
            self.spawn(self.m.watchdog.set_job(worker_id, job_id, finished=finished))

    async def mark_warm(self, proc: JobProcess) -> bool:
        """A job process said hello where windows let warming processes run (--freeze-warming
        false): the watchdog freezes it from now on, at once in an open window; its first
        job waits for that (True), else it is taken as gone (False: the watchdog knows it no
        more, it exited meanwhile)."""
        if self.m.watchdog is None:
            return True
        try:
            await self.m.watchdog.job_process_warm(proc.worker_id)
        except Exception as exc:  # noqa: BLE001 - a process the watchdog cannot freeze takes no job
            log.warning("job process %s not marked warm: %s", proc.worker_id, exc)
            return False
        return True

    def spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception as exc:  # noqa: BLE001 - a failed command is logged, not fatal
                log.warning("background task failed (a watchdog command, a cancel): %s", exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def watch_exit(self, proc: JobProcess) -> None:
        if proc.exit_watch is None:
            proc.exit_watch = asyncio.get_running_loop().call_later(
                OUTCOME_EXIT_GRACE_S, self._kill_if_still_there, proc
            )

    def _kill_if_still_there(self, proc: JobProcess) -> None:
        if self.m.job_processes.by_id.get(proc.worker_id) is not proc or self.m.watchdog is None:
            return  # it exited
        log.warning(
            "job process %s still runs %.0f s after its outcome or its channel's end: killed",
            proc.worker_id,
            OUTCOME_EXIT_GRACE_S,
            extra={"worker_id": proc.worker_id},
        )
        self.spawn(self.m.watchdog.kill_worker(proc.worker_id, metrics_mod.KILL_AFTER_OUTCOME))

    def kill_lost(self, proc: JobProcess) -> None:
        proc.gone = True
        if self.m.watchdog is not None:
            self.spawn(self.m.watchdog.kill_worker(proc.worker_id, metrics_mod.KILL_LOST))

    def free_process(self, proc: JobProcess, completed: bool) -> None:
        self.m.gate.release(proc.device_index, proc.worker_id)
        if proc.job_id:
            if completed:
                proc.completed += 1
            if self.m.watchdog is not None and not proc.gone:
                self.spawn(self.m.watchdog.set_job(proc.worker_id, ""))
        proc.job_id = ""

    def let_go(self, run: Running, completed: bool) -> None:
        """The run is over for the front end: its timers stop, its process takes no more of
        it."""
        run.stop_timers()
        if run.proc.job_id == run.job.job_id:
            self.free_process(run.proc, completed=completed)

    def after_outcome(
        self,
        proc: JobProcess,
        run: Running,
        outcome: job_channel_pb2.JobOutcome,
        judge: bool,
    ) -> None:
        """What becomes of a job process once it answered its job (`judge`: as its judge)."""
        # A launch process whose job came wholly prebuilt ran none of the job's code: when it
        # says it cleaned up, it takes the next built job. Any other job process ran one job:
        # it exits now, and its slot goes to a spare at once (SetJob finished). Until it has
        # exited the watchdog keeps it as the job's process, so that an XID to come names it.
        # (A process given a job whole can never be given another: JobProcess.assign.)
        if (
            outcome.reusable
            and not outcome.context_poisoned
            and (run.job.job_id in self.m.builds.launched or judge)
        ):
            proc.reusable = True
            proc.used_gpu = False  # it cleans up before it reads the next job
            self.m.memory.release(proc.device_index, proc.worker_id)
            if judge:
                assert run.record is not None
                self.m.judges.stand(proc, run.record.reference_key)
            else:
                proc.launches += 1
        else:
            proc.gone = True
            if outcome.serves_timed_calls and run.record is not None and not judge:
                # It stays, for its judge's timed calls; it is watched to its exit once the
                # job is done with it (judging.drop_record). Its slot goes to a spare all the same.
                # It let go of its checks' tensors, but it still holds the outputs it handed
                # over and makes a call's outputs again in each call: that much stays held
                # (uncounted, it ran the next jobs out of memory: H200, the RL step), as memory
                # a judge is admitted beside when nothing else is held (GpuMemory.only_shares),
                # or the judges its process waits for would wait for it.
                run.kernel_serves = True
                self.m.memory.hold(
                    proc.device_index, proc.worker_id, serving_bytes(run.record.shared_bytes)
                )
            else:
                self.watch_exit(proc)
            self.set_job(proc.worker_id, outcome.job_id, finished=True)
        if outcome.context_poisoned:
            event = self.m.hub.next_event(outcome.job_id)
            event.fault.worker_pid = proc.pid
            event.fault.worker_restarted = True
            event.fault.description = (
                f"{outcome.result.error.cuda_error_name or 'a sticky CUDA error'} poisoned the "
                f"CUDA context of worker {proc.worker_id}; it exits and is replaced"
            )
            self.m.hub.publish(event)
        self.free_process(proc, completed=True)
