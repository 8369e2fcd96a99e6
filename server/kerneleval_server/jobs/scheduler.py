"""Which queued job runs next, and which job process may time right now.

The queue is fair between clients: one FIFO per client_tag, served round-robin; with tenants
(--tenants-file) one FIFO per tenant instead, its client_tags sharing it; a tenant at its
share of the job slots (--tenant-max-running: `FairQueue.lane_open`) is passed over until one
of its jobs ends, while the other lanes are served. A job that
names a device waits for that device; others take any. Timing is exclusive per device: one
PROFILING phase at a time, so measurements do not disturb each other, while other job
processes on the same device keep compiling and validating. Devices whose "GPU" is the
host's CPU (no GPU: the CPU pseudo-device, or fake-NVML devices on a host without one) share
one gate: their timed trials all run on the same cores, so one of them times at a time on
the host.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kerneleval_server.spec import placement


@dataclass
class QueuedJob:
    job_id: str
    client_tag: str
    device_index: int | None  # None: any device
    prebuild: str = ""  # prebuild.kind(spec): "" runs whole, "cuda"/"triton" may be built ahead
    model: str = ""  # the GPU model it names (placement.py); "": any
    tenant: str = ""  # the tenant that submitted it ("": none, or the admin)

    @property
    def lane(self) -> tuple[str, str]:
        """The unit of fairness: its tenant's, else (tenants off, the admin) its client_tag's."""
        return ("tenant", self.tenant) if self.tenant else ("client_tag", self.client_tag)

    def fits(self, device_index: int, device_name: str) -> bool:
        return placement.fits(self.device_index, self.model, device_index, device_name)


class FairQueue:
    def __init__(self) -> None:
        # QueuedJob.lane -> its jobs; the order of the dict is the round-robin order.
        self._lanes: OrderedDict[tuple[str, str], deque[QueuedJob]] = OrderedDict()
        self._index: dict[str, QueuedJob] = {}
        # Whether a lane may start a job now (--tenant-max-running: the manager's count of
        # the tenant's running jobs); a lane it closes keeps its jobs and its turn.
        self.lane_open: Callable[[tuple[str, str]], bool] = lambda lane: True

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._index

    def job_ids(self) -> list[str]:
        return list(self._index)

    def queued_in(self, lane: tuple[str, str]) -> int:
        """The jobs queued in one lane (QueuedJob.lane): a tenant's, or a client_tag's."""
        return len(self._lanes.get(lane, ()))

    def waiting(self, accept: Callable[[QueuedJob], bool]) -> list[QueuedJob]:
        """The queued jobs `accept` takes, oldest first (none is taken out)."""
        return [job for job in self._index.values() if accept(job)]

    def push(self, job: QueuedJob) -> int:
        """Queues a job; returns how many jobs were ahead of it."""
        ahead = len(self._index)
        self._lanes.setdefault(job.lane, deque()).append(job)
        self._index[job.job_id] = job
        return ahead

    def remove(self, job_id: str) -> bool:
        job = self._index.pop(job_id, None)
        if job is None:
            return False
        lane = self._lanes[job.lane]
        lane.remove(job)
        if not lane:
            del self._lanes[job.lane]
        return True

    def pop_for(
        self,
        device_index: int | None,
        accept: Callable[[QueuedJob], bool] | None = None,
        device_name: str = "",
        quota: bool = True,
    ) -> QueuedJob | None:
        """The next job that may run on the device (None: any; `device_name`, its GPU's name,
        for jobs that name a model) and that `accept` takes, taking clients in turn; a lane
        `lane_open` closes is passed over (`quota` False: not, for a job already started once
        and re-run in the same attempt)."""
        for tag in list(self._lanes):
            if quota and not self.lane_open(tag):
                continue
            lane = self._lanes[tag]
            for job in lane:
                if accept is not None and not accept(job):
                    continue
                if device_index is None or job.fits(device_index, device_name):
                    lane.remove(job)
                    del self._index[job.job_id]
                    # This client goes to the back of the round.
                    self._lanes.move_to_end(tag)
                    if not lane:
                        del self._lanes[tag]
                    return job
        return None


@dataclass
class _DeviceGate:
    readers: set[str] = field(default_factory=set)
    writer: str | None = None
    queue: deque[tuple[str, bool]] = field(default_factory=deque)  # (worker_id, exclusive)
    window_since: float = 0.0  # clock time the current window was granted
    window_seconds: float = 0.0  # windows held before the current one, summed
    window_count: int = 0
    wanted_since: float | None = None  # since when a window is held or asked for
    wanted_seconds: float = 0.0  # such spells before the current one, summed
    writer_device: int = 0  # the device of the window's holder (a host gate has several)

    def timing_wanted(self) -> bool:
        return self.writer is not None or any(exclusive for _, exclusive in self.queue)


class GpuGate:
    """Per device, a reader/writer gate over the GPU: correctness checks (shared) run together;
    a timing window (exclusive) runs alone. Requests are served in the order they came, and a
    waiting window holds back the checks that asked after it (writer-preferring), so timing is
    never starved and checks are never passed over for long. Devices are independent, but
    for those on the host's CPU (`share_host`): one gate for all of them."""

    def __init__(
        self,
        grant: Callable[[str, bool], None],
        on_window: Callable[[int, str, float], None] = lambda device, holder, seconds: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._grant = grant  # called with (worker_id, exclusive) when it may use the GPU
        self._on_window = on_window  # called with (device, holder, seconds) when a window ends
        self._clock = clock
        self._devices: dict[int, _DeviceGate] = {}
        self._host: _DeviceGate | None = None  # the gate of the devices on the host's CPU
        self._device_of: dict[str, int] = {}  # worker_id -> the device it asked for

    def share_host(self, device_index: int) -> None:
        """The device runs its jobs on the host's CPU (its job processes see no GPU): it takes
        the host's gate, which every such device shares, so that timed trials on the CPU never
        run beside other timed trials (their cores are the same), and checks wait for them as
        on a GPU. A device whose own gate is in use now moves at its next idle moment (the
        next job process's Hello asks again)."""
        gate = self._devices.get(device_index)
        if self._host is None:
            self._host = _DeviceGate()
        if gate is self._host:
            return
        if gate is not None and (gate.readers or gate.writer or gate.queue):
            return
        self._devices[device_index] = self._host

    def on_host(self, device_index: int) -> bool:
        """Whether the device shares the host's gate (share_host)."""
        return self._host is not None and self._devices.get(device_index) is self._host

    def request(self, device_index: int, worker_id: str, exclusive: bool) -> None:
        gate = self._devices.setdefault(device_index, _DeviceGate())
        self._device_of[worker_id] = device_index
        if gate.writer == worker_id or (worker_id in gate.readers and not exclusive):
            self._grant(worker_id, exclusive)  # holds it already
            return
        gate.readers.discard(worker_id)  # a check that goes on to time gives its share back
        if any(w == worker_id for w, _ in gate.queue):
            gate.queue = deque((w, x) for w, x in gate.queue if w != worker_id)
        gate.queue.append((worker_id, exclusive))
        self._pump(gate)
        self._track_wanted(gate)

    def release(self, device_index: int, worker_id: str) -> None:
        """The job process no longer uses the GPU (its job ended, or it is gone); the next go."""
        gate = self._devices.get(device_index)
        if gate is None:
            return
        gate.queue = deque((w, x) for w, x in gate.queue if w != worker_id)
        gate.readers.discard(worker_id)
        self._device_of.pop(worker_id, None)
        if gate.writer == worker_id:
            gate.writer = None
            held = self._clock() - gate.window_since
            gate.window_seconds += held
            self._on_window(gate.writer_device, worker_id, held)
        self._pump(gate)
        self._track_wanted(gate)

    def _track_wanted(self, gate: _DeviceGate) -> None:
        now = self._clock()
        if gate.timing_wanted() and gate.wanted_since is None:
            gate.wanted_since = now
        elif not gate.timing_wanted() and gate.wanted_since is not None:
            gate.wanted_seconds += now - gate.wanted_since
            gate.wanted_since = None

    def _pump(self, gate: _DeviceGate) -> None:
        while gate.queue and gate.writer is None:
            worker_id, exclusive = gate.queue[0]
            if exclusive and gate.readers:
                return  # the window waits for the checks that hold the GPU
            gate.queue.popleft()
            if exclusive:
                gate.writer = worker_id
                gate.writer_device = self._device_of.get(worker_id, 0)
                gate.window_since = self._clock()
                gate.window_count += 1
            else:
                gate.readers.add(worker_id)
            self._grant(worker_id, exclusive)

    def occupancy(self) -> dict[int, tuple[float, int, float]]:
        """Per device: seconds timing windows were held (the current one so far), how many
        were granted, and seconds a window was held or asked for. Devices on the host's CPU
        each show the host gate's (while one times, none of them can)."""
        now = self._clock()
        out = {}
        for index, g in sorted(self._devices.items()):
            held = g.window_seconds + (now - g.window_since if g.writer else 0.0)
            wanted = g.wanted_seconds + (now - g.wanted_since if g.wanted_since else 0.0)
            out[index] = (held, g.window_count, wanted)
        return out

    def holders(self, device_index: int) -> tuple[str | None, set[str]]:
        """(the timing window's holder, the checks') of a device."""
        gate = self._devices.get(device_index, _DeviceGate())
        return gate.writer, set(gate.readers)
