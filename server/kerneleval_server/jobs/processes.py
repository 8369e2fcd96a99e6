"""The job life cycle's job processes (manager.py): the watchdog told which job each runs,
each watched to its exit once its job is done with it (killed if it stays), freed for the
next job or lost; the watchdog commands run in the background, their failures logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from kerneleval_server import metrics as metrics_mod
from kerneleval_server.fleet.job_processes import WorkerState, WorkerTable
from kerneleval_server.fleet.watchdog import WatchdogLike
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
    def workers(self) -> WorkerTable: ...
    @property
    def gate(self) -> GpuGate: ...


class ProcessKeeper:
    def __init__(self, m: ProcessesHost) -> None:
        self.m = m
        self._tasks: set[asyncio.Task[Any]] = set()

    def set_job(self, worker_id: str, job_id: str, finished: bool = False) -> None:
        """Tells the watchdog which job a job process runs ("": none), so that its exits and
        XIDs name the job (`finished`: its job is done; its slot goes to a spare)."""
        if self.m.watchdog is not None:
            self.spawn(self.m.watchdog.set_job(worker_id, job_id, finished=finished))

    def spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception as exc:  # noqa: BLE001 - a failed command is logged, not fatal
                log.warning("background task failed (a watchdog command, a cancel): %s", exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def watch_exit(self, worker: WorkerState) -> None:
        if worker.exit_watch is None:
            worker.exit_watch = asyncio.get_running_loop().call_later(
                OUTCOME_EXIT_GRACE_S, self._kill_if_still_there, worker
            )

    def _kill_if_still_there(self, worker: WorkerState) -> None:
        if self.m.workers.by_id.get(worker.worker_id) is not worker or self.m.watchdog is None:
            return  # it exited
        log.warning(
            "job process %s still runs %.0f s after its outcome or its channel's end: killed",
            worker.worker_id,
            OUTCOME_EXIT_GRACE_S,
            extra={"worker_id": worker.worker_id},
        )
        self.spawn(self.m.watchdog.kill_worker(worker.worker_id, metrics_mod.KILL_AFTER_OUTCOME))

    def worker_lost(self, worker: WorkerState) -> None:
        worker.gone = True
        if self.m.watchdog is not None:
            self.spawn(self.m.watchdog.kill_worker(worker.worker_id, metrics_mod.KILL_LOST))

    def free_worker(self, worker: WorkerState, completed: bool) -> None:
        self.m.gate.release(worker.device_index, worker.worker_id)
        if worker.job_id:
            if completed:
                worker.completed += 1
            if self.m.watchdog is not None and not worker.gone:
                self.spawn(self.m.watchdog.set_job(worker.worker_id, ""))
        worker.job_id = ""
