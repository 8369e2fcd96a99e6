"""Jobs that share a GPU, and those that run alone: a job that ran out of GPU memory while
other jobs held some of it ran on a GPU that was not its own; it runs again, once, with the
GPU to itself (manager.py `_retry_alone`), and its GPU is held for it until then.
"""

from __future__ import annotations

from typing import Protocol

from kerneleval.v1 import job_pb2

from kerneleval_server.error_texts import NVML_OOM_ASSERT
from kerneleval_server.fleet.gpu_memory import GpuMemory
from kerneleval_server.fleet.job_processes import JobProcess, JobProcessTable
from kerneleval_server.jobs.gpu_use import GpuUse
from kerneleval_server.jobs.judging import Judges
from kerneleval_server.jobs.running import Running, Stage
from kerneleval_server.jobs.scheduler import FairQueue
from kerneleval_server.jobs.store import JobStore

# An allocation that failed, as torch says it: its OOM error, or the assertion its allocator
# raises instead where NVML cannot start (a sandbox) while it describes the OOM.
OOM_TEXTS = ("CUDA out of memory", NVML_OOM_ASSERT)


class CrowdingHost(Protocol):
    """What the crowding reads of the job life cycle (manager.py JobManager)."""

    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def queue(self) -> FairQueue: ...
    @property
    def store(self) -> JobStore: ...
    @property
    def memory(self) -> GpuMemory: ...
    @property
    def judges(self) -> Judges: ...
    @property
    def draining(self) -> bool: ...


class Crowding:
    def __init__(self, m: CrowdingHost) -> None:
        self.m = m
        # Jobs re-run with a GPU to themselves (they ran out of memory beside others).
        self.alone: set[str] = set()

    def mark(self, run: Running, proc: JobProcess) -> None:
        """A job starts on `proc`: it, and the jobs already on its GPU, are crowded when
        they share it (their memory was each other's too)."""
        others = [o for o in self._running_on(proc.device_index) if o is not run]
        if others or self.busy_on(proc.device_index, but=proc):
            run.crowded = True
        for other in others:
            other.crowded = True

    def runs_alone(self, run: Running, result: job_pb2.EvalResult) -> bool:
        """The job ran out of GPU memory crowded, and has not run alone yet: from now on it
        does (its problem's footprint learned; judges started ahead on its GPU, which would
        wait for it while it waits for them, leave)."""
        text = f"{result.error.message}\n{result.compilation_error}"
        oom = result.verdict == job_pb2.VERDICT_OUT_OF_MEMORY or any(m in text for m in OOM_TEXTS)
        job = run.job
        if not oom or not run.crowded or job.job_id in self.alone:
            return False
        memory = self.m.memory
        memory.ran_out(GpuUse.memory_key(run))
        self.alone.add(job.job_id)
        device = job.device_index
        for other in list(self.m.running.values()):
            # A judge started ahead holds memory and counts as using the GPU, so this job
            # waits for it; its kernel, not admitted yet, now waits for this job: neither
            # would ever go. It leaves (its job's judge starts afresh once the kernel ran).
            if (
                other.ahead is not None
                and other.proc.device_index == device
                and not memory.holds(device, other.proc.worker_id)
            ):
                self.m.judges.leave_ahead(other)
        return True

    def held_devices(self) -> dict[int, str]:
        """GPU -> the job to run alone there (queued: where it ran out of memory; or running)."""
        held: dict[int, str] = {}
        for job_id in self.alone:
            run = self.m.running.get(job_id)
            if run is not None:
                held[run.proc.device_index] = job_id
            elif job_id in self.m.queue and not self.m.draining:  # it starts after the stop
                job = self.m.store.get(job_id)
                if job is not None:
                    held.setdefault(job.device_index, job_id)
        return held

    def busy_on(self, device: int, but: JobProcess | None = None) -> bool:
        """A job process of the device has used the GPU for a job and has not exited (its GPU
        memory is not given back until it has), other than `but` and idle launch processes.
        Jobs still compiling (a load_inline build can take half a minute) hold next to none."""
        return any(
            w is not but and w.device_index == device and w.used_gpu
            and not (w.reusable and not w.job_id)
            for w in self.m.job_processes.by_id.values()
        )  # fmt: skip

    def _running_on(self, device: int) -> list[Running]:
        return [
            r for r in self.m.running.values()
            if r.proc.device_index == device and r.proc.worker_id
            and r.stage not in (Stage.AWAITING_LAUNCH, Stage.AWAITING_JUDGE)
        ]  # fmt: skip
