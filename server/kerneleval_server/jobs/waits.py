"""What every unfinished job waits for, said while it waits, and a bound on every wait.

A job's timeout counts only the time it can run (deadline.py): waiting for a job process, a
judge, a launch process, GPU memory or the GPU gate pauses it or pushes it later. A job that
waits for something that never comes would then wait for ever, silently (issue 44: an RL
step that stalled on a GPU and printed nothing). So every CHECK_S `Waits.check` looks at
each unfinished job:
- what it waits for (`waiting_for`), named the same way in its events, the service log and
  `ListJobs`' clients: once a wait passes SAY_AFTER_S the job's events say so (once per
  wait), and the service log says it with its GPU's memory, gate and processes;
- a wait longer than --max-wait-s ends the job FAILED (the service's doing, not the
  kernel's: `VERDICT_SERVICE_ERROR`), naming what it waited for; its process, if it has one,
  is killed. A queued job's wait for a job process is bounded the same way only while no job
  has started anywhere for that long (a long queue that moves is not a stall).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

from kerneleval.v1 import job_pb2

from kerneleval_server import metrics as metrics_mod
from kerneleval_server.fleet.gpu_memory import GpuMemory
from kerneleval_server.fleet.job_processes import JobProcessTable
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.jobs.builds.paths import BuildPaths
from kerneleval_server.jobs.crowding import Crowding
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.gpu_use import GpuUse
from kerneleval_server.jobs.judging import Judges
from kerneleval_server.jobs.running import Running, Stage
from kerneleval_server.jobs.scheduler import FairQueue, GpuGate
from kerneleval_server.jobs.store import JobStore

log = logging.getLogger("kerneleval.jobs")
CHECK_S = 5.0
SAY_AFTER_S = 30.0


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class WaitsHost(Protocol):
    """What the watch over waits reads of the job life cycle (manager.py JobManager), and
    what it does to a job that waited too long: its process killed, the job ended."""

    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def queue(self) -> FairQueue: ...
    @property
    def store(self) -> JobStore: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def memory(self) -> GpuMemory: ...
    @property
    def gate(self) -> GpuGate: ...
    @property
    def crowding(self) -> Crowding: ...
    @property
    def judges(self) -> Judges: ...
    @property
    def gpu_use(self) -> GpuUse: ...
    @property
    def builds(self) -> BuildPaths: ...
    @property
    def watchdog(self) -> WatchdogLike | None: ...
    def spawn(self, coro: Awaitable[Any]) -> None: ...
    def finish(
        self,
        job: job_pb2.Job,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
        reason: str = "",
    ) -> None: ...


@dataclass
class _Seen:
    what: str
    since: float  # monotonic
    said: bool = False


def waiting_for(m: WaitsHost, run: Running) -> str:
    """What a started job waits for ("" when it runs: its own time, under its deadline)."""
    device = run.proc.device_index
    if run.stage is Stage.AWAITING_LAUNCH:
        return f"a launch process on GPU {device}"
    if run.stage is Stage.AWAITING_JUDGE:
        if run.job.job_id in m.judges.queue:
            return f"a judge process on GPU {run.job.device_index}"
        if run.kernel_proc is not None:
            return "its kernel's process to exit (its outputs are read once nothing can write them)"
        return "its kernel's record to be sealed for its judge"
    if run.kill is not None:
        return f"its job process to exit after its {run.kill.value}"
    if run.proc.worker_id in m.gpu_use.waiting:
        need = m.memory.footprint(m.gpu_use.memory_key(run))
        held, budget, holders = m.memory.usage(device)
        if run.job.job_id in m.crowding.alone or need is None:
            return f"GPU {device} to itself ({holders} holder(s) of its memory)"
        return (
            f"{_size(need)} of GPU {device}'s memory ({_size(held)} of {_size(budget)} held "
            f"by {holders})"
        )
    if run.stage is Stage.TIMING_WAITS_KERNEL:
        return "its kernel's process to exit before the reference is timed"
    if run.window is not None and run.window.draining:
        return f"GPU {device} to drain other jobs' queued work"
    if run.grant_asked_at:
        writer, readers = m.gate.holders(device)
        kind = "a timing window" if run.phase == job_pb2.PHASE_PROFILING else "a check's share"
        held_by = f"window held by {writer}" if writer else f"{len(readers)} check(s) running"
        return f"{kind} of GPU {device} ({held_by})"
    return ""


def unfinished(m: WaitsHost) -> list[tuple[str, str]]:
    """(job id, why it has not finished) for each started job: what it waits for, or what
    still runs. Said when a drain's grace ends (main.py `_shutdown`): these run again at the
    next start."""
    out = []
    for run in list(m.running.values()):
        what = waiting_for(m, run)
        if what:
            out.append((run.job.job_id, f"it waited for {what}"))
            continue
        whose = "its judge" if run.judged_now else "its kernel"
        phase = job_pb2.Phase.Name(run.phase) if run.phase else "starting"
        out.append((run.job.job_id, f"{whose} still ran ({phase.removeprefix('PHASE_')})"))
    return out


class Waits:
    """The manager's (`m`) watch over its jobs' waits (module docstring)."""

    def __init__(self, m: WaitsHost, max_wait_s: float) -> None:
        self.m = m
        self.max_wait_s = max_wait_s
        self._seen: dict[str, _Seen] = {}
        self.last_start = time.monotonic()  # a job last started on a job process
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def started(self) -> None:
        self.last_start = time.monotonic()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive any one bad look
                log.exception("checking the jobs' waits failed")

    def now_waiting(self) -> dict[str, tuple[str, float]]:
        """job id -> (what it waits for, seconds so far), as of the last check."""
        now = time.monotonic()
        return {job_id: (s.what, now - s.since) for job_id, s in self._seen.items()}

    def check(self) -> None:
        now = time.monotonic()
        current: dict[str, str] = {}
        for run in list(self.m.running.values()):
            what = waiting_for(self.m, run)
            if what:
                current[run.job.job_id] = what
        # A queued job its tenant's share holds back (--tenant-max-running) waits for the
        # tenant's own jobs, not for the service: said, never ended for it.
        own: set[str] = set()
        for waiting in self.m.queue.waiting(lambda q: True):
            job_id = waiting.job_id
            if not self.m.queue.lane_open(waiting.lane):
                own.add(job_id)
                current[job_id] = "one of its tenant's running jobs to end (--tenant-max-running)"
            else:
                current[job_id] = "a job process" + self._queue_note(job_id)
        seen: dict[str, _Seen] = {}
        for job_id, what in current.items():
            old = self._seen.get(job_id)
            seen[job_id] = old if old is not None and old.what == what else _Seen(what, now)
        self._seen = seen
        stalled_queue = now - self.last_start > self.max_wait_s
        for job_id, s in list(seen.items()):
            waited = now - s.since
            queued = job_id not in self.m.running
            if job_id in own:
                pass  # its tenant's own jobs hold it back
            elif self.max_wait_s > 0 and waited > self.max_wait_s and (not queued or stalled_queue):
                self._end(job_id, s.what, waited)
                continue
            if waited > SAY_AFTER_S and not s.said:
                s.said = True
                self._say(job_id, s.what, waited)

    def _queue_note(self, job_id: str) -> str:
        if job_id in self.m.crowding.alone:
            held = self.m.crowding.held_devices()
            device = next((d for d, j in held.items() if j == job_id), None)
            if device is not None:
                return f" with GPU {device} to itself, once its other processes have exited"
        return ""

    def _say(self, job_id: str, what: str, waited: float) -> None:
        self.m.hub.log(job_id, f"kerneleval: has waited {waited:.0f} s for {what}")
        log.warning(
            "job %s has waited %.0f s for %s; %s", job_id, waited, what, self.gpus(),
            extra={"job_id": job_id},
        )  # fmt: skip

    def gpus(self) -> str:
        """Each GPU's memory holders, gate and job processes, for a log line."""
        m = self.m
        parts = []
        every = m.job_processes.by_id.values()
        devices = sorted({p.device_index for p in every if p.device_index != BUILD_DEVICE})
        for device in devices:
            held, budget, holders = m.memory.usage(device)
            writer, readers = m.gate.holders(device)
            procs = [p for p in every if p.device_index == device]
            ready = sum(1 for p in procs if p.ready)
            judges = sum(1 for p in procs if p.judge_key and not p.gone)
            busy = sum(1 for p in procs if p.job_id)
            parts.append(
                f"GPU {device}: memory {_size(held)} of {_size(budget)} by {holders}, window "
                f"{writer or '-'}, {len(readers)} check(s), {len(procs)} processes "
                f"({ready} ready, {busy} busy, {judges} judges)"
            )
        parts.append(
            f"queue {len(m.queue)}, judges wanted {len(m.judges.queue)}, launches wanted "
            f"{len(m.builds.launch_queue)}, memory waits {len(m.gpu_use.waiting)}"
        )
        return "; ".join(parts)

    def _end(self, job_id: str, what: str, waited: float) -> None:
        """The wait passed its bound: the job ends FAILED, its process (if any) killed."""
        self._seen.pop(job_id, None)
        m = self.m
        run = m.running.get(job_id)
        job = run.job if run is not None else m.store.get(job_id)
        if job is None or job.state not in (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING):
            return
        reason = (
            f"waited {waited:.0f} s for {what}, which never came (--max-wait-s "
            f"{self.max_wait_s:.0f}): the service's failure, not the kernel's; run it again"
        )
        log.error("job %s: %s; %s", job_id, reason, self.gpus(), extra={"job_id": job_id})
        if run is None:
            m.queue.remove(job_id)
        elif run.proc.job_id == job_id and not run.proc.gone:
            run.proc.gone = True
            if m.watchdog is not None:
                m.spawn(m.watchdog.kill_worker(run.proc.worker_id, metrics_mod.KILL_STALLED))
        result = job_pb2.EvalResult()
        result.CopyFrom(job.result)
        result.verdict = job_pb2.VERDICT_SERVICE_ERROR
        result.error.exception_type = "ServiceStalled"
        result.error.message = reason
        m.finish(job, job_pb2.JOB_STATE_FAILED, result, reason)
