"""Which queued job runs next, and which worker may time right now.

The queue is fair between clients: one FIFO per client_tag, served round-robin. A job that
names a device waits for that device; others take any. Timing is exclusive per device: one
PROFILING phase at a time, so measurements do not disturb each other, while other workers on
the same device keep compiling and validating.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class QueuedJob:
    job_id: str
    client_tag: str
    device_index: int | None  # None: any device


class FairQueue:
    def __init__(self) -> None:
        # client_tag -> its jobs; the order of the dict is the round-robin order.
        self._lanes: OrderedDict[str, deque[QueuedJob]] = OrderedDict()
        self._index: dict[str, QueuedJob] = {}

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._index

    def push(self, job: QueuedJob) -> int:
        """Queues a job; returns how many jobs were ahead of it."""
        ahead = len(self._index)
        self._lanes.setdefault(job.client_tag, deque()).append(job)
        self._index[job.job_id] = job
        return ahead

    def remove(self, job_id: str) -> bool:
        job = self._index.pop(job_id, None)
        if job is None:
            return False
        lane = self._lanes[job.client_tag]
        lane.remove(job)
        if not lane:
            del self._lanes[job.client_tag]
        return True

    def pop_for(self, device_index: int) -> QueuedJob | None:
        """The next job that may run on the device, taking clients in turn."""
        for tag in list(self._lanes):
            lane = self._lanes[tag]
            for job in lane:
                if job.device_index is None or job.device_index == device_index:
                    lane.remove(job)
                    del self._index[job.job_id]
                    # This client goes to the back of the round.
                    self._lanes.move_to_end(tag)
                    if not lane:
                        del self._lanes[tag]
                    return job
        return None


class ProfilingGate:
    """One timing grant per device; the rest wait in order."""

    def __init__(self, grant: Callable[[str], None]) -> None:
        self._grant = grant  # called with the worker id that may time now
        self._holder: dict[int, str] = {}
        self._waiting: dict[int, deque[str]] = {}

    def request(self, device_index: int, worker_id: str) -> None:
        if self._holder.get(device_index) in (None, worker_id):
            self._holder[device_index] = worker_id
            self._grant(worker_id)
        elif worker_id not in self._waiting.setdefault(device_index, deque()):
            self._waiting[device_index].append(worker_id)

    def release(self, device_index: int, worker_id: str) -> None:
        """The worker no longer times (job ended, worker gone); hands the grant on."""
        waiting = self._waiting.get(device_index)
        if waiting and worker_id in waiting:
            waiting.remove(worker_id)
        if self._holder.get(device_index) != worker_id:
            return
        del self._holder[device_index]
        if waiting:
            nxt = waiting.popleft()
            self._holder[device_index] = nxt
            self._grant(nxt)

    def holder(self, device_index: int) -> str | None:
        return self._holder.get(device_index)
