"""GPU memory admission: jobs whose inputs and outputs fill a GPU are not checked beside each
other only to run out of memory.

A KernelBench level-1 activation moves 6.4 GB tensors: its inputs, the reference's outputs
and the candidate's take about 20 GB, so four fit on an 80 GB GPU and sixteen job processes
checking at once ran out of memory and re-ran one by one (`JobManager._retry_alone`). What a
job needs is learned per *problem* (the reference and the inputs' contract: what decides the
tensors' sizes) from the peak device memory that earlier jobs of it reported, and a job asks
for it when it asks for the GPU to check (PHASE_VALIDATING): it gets the GPU once that much
is free of what other admitted jobs need, and holds it until its process exits (a job
process gives its memory back only then) or, for a launch process, until its outcome.

- A problem not learned yet checks without a reservation, as before admission, so one
  candidate per problem (a KernelBench run) runs as before. Once a job of it has run out of
  memory beside others, its jobs check with the GPU to themselves until a peak is learned
  (the first that ends OK or INCORRECT).
- A learned footprint is the median of the last FOOTPRINT_SAMPLES peaks of jobs that ended
  OK or INCORRECT. Job processes report their own peak (torch's reserved memory, with what
  they hand over by descriptor and a judge's timed-call buffers: device memory outside
  torch's allocator), and a candidate's code runs there, so a report is a claim: one job
  cannot move the median,
  a majority that inflates it only makes its own problem's jobs check fewer at a time, and
  a footprint over the budget means "alone" (admitted only on an otherwise unreserved GPU).
- A job re-run alone (it ran out of memory beside others) reserves the whole budget.
- A kernel's process that serves its judge's timed calls holds less than its checks did
  (`serving_bytes`), held as a judge's shares are: a judge is admitted beside them when
  nothing else is held, since its kernel's process waits for it.
"""

from __future__ import annotations

import hashlib
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kerneleval.v1 import kernel_pb2

FOOTPRINT_SAMPLES = 16  # peaks kept per problem
KNOWN_PROBLEMS = 4096  # problems remembered, least recently used forgotten
# What a process holds for its CUDA context and libraries beside its tensors (an H200's idle
# job process: 0.4-0.6 GiB as nvidia-smi reads it).
PROCESS_BYTES = 512 << 20


def serving_bytes(shared_bytes: int) -> int:
    """What a kernel's process holds while it serves its judge's timed calls: the outputs it
    handed over (mapped, until it exits), the outputs its code makes again in each call, and
    its context."""
    return 2 * shared_bytes + PROCESS_BYTES


def problem_key(spec: kernel_pb2.JobSpec) -> str:
    """What decides a job's tensors: its reference and the inputs' contract (not the
    candidate's code, which every candidate of a problem differs in)."""
    h = hashlib.sha256()
    h.update(spec.reference.SerializeToString(deterministic=True))
    h.update(b"\0")
    h.update(spec.kernel.io.SerializeToString(deterministic=True))
    return h.hexdigest()


@dataclass
class _Holder:
    key: str
    reserved: int  # bytes; 0 for a scout (not learned yet)


@dataclass
class _Device:
    budget: int = 0  # bytes admitted jobs may reserve together; 0: no admission (unknown)
    holders: dict[str, _Holder] = field(default_factory=dict)  # worker_id -> what it holds

    def reserved(self) -> int:
        return sum(h.reserved for h in self.holders.values())


class GpuMemory:
    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._devices: dict[int, _Device] = {}
        self._peaks: OrderedDict[str, deque[int]] = OrderedDict()
        self._hungry: set[str] = set()  # ran out of memory beside others, not learned yet

    def set_total(self, device: int, total_bytes: int) -> None:
        """The GPU's memory (NVML); 0 turns admission off for it (a CPU or an unknown size)."""
        self._devices.setdefault(device, _Device()).budget = int(total_bytes * self.fraction)

    def admits_on(self, device: int) -> bool:
        """Admission is on for the GPU (its memory is known, the share is not 0)."""
        dev = self._devices.get(device)
        return dev is not None and dev.budget > 0

    def holds(self, device: int, worker_id: str) -> bool:
        dev = self._devices.get(device)
        return dev is not None and worker_id in dev.holders

    def footprint(self, key: str) -> int | None:
        peaks = self._peaks.get(key)
        if not peaks:
            return None
        self._peaks.move_to_end(key)
        return int(statistics.median(peaks))

    def learn(self, key: str, peak_bytes: int) -> None:
        if peak_bytes <= 0:
            return
        peaks = self._peaks.setdefault(key, deque(maxlen=FOOTPRINT_SAMPLES))
        peaks.append(peak_bytes)
        self._hungry.discard(key)
        self._peaks.move_to_end(key)
        while len(self._peaks) > KNOWN_PROBLEMS:
            self._peaks.popitem(last=False)

    def ran_out(self, key: str) -> None:
        """A job of the problem ran out of memory beside others: until a peak of it is
        learned, its jobs check with the GPU to themselves."""
        if key not in self._peaks:
            self._hungry.add(key)
            while len(self._hungry) > KNOWN_PROBLEMS:
                self._hungry.pop()

    def admit(self, device: int, worker_id: str, key: str, alone: bool = False) -> bool:
        """Whether the job process's job may use the GPU now; if so, what it needs is held for it
        until `release`. False: ask again once memory was released or a peak learned."""
        dev = self._devices.get(device)
        if dev is None or dev.budget <= 0 or worker_id in dev.holders:
            return True
        reserved = dev.reserved()
        need = self.footprint(key)
        if need is None and key in self._hungry:
            alone = True  # ran out of memory beside others, not learned yet: the GPU alone
        if alone or any(h.reserved >= dev.budget for h in dev.holders.values()):
            # A job alone takes the budget; nothing joins one that holds it.
            if dev.holders:
                return False
            dev.holders[worker_id] = _Holder(key, dev.budget)
            return True
        if need is None:  # not learned: as before admission, it may run out of memory
            dev.holders[worker_id] = _Holder(key, 0)
            return True
        need = min(need, dev.budget)
        if reserved + need > dev.budget and dev.holders:
            return False
        dev.holders[worker_id] = _Holder(key, need)
        return True

    def hold(self, device: int, holder: str, nbytes: int, key: str = "") -> None:
        """Memory that stays used until `release(device, holder)`, held whatever else is, as
        the process that made it held it: a judged kernel's outputs handed over by
        descriptor, on the GPU until its judge has read them; a kernel's process serving its
        judge's calls. `key`: a problem's, for a job admitted beside these (not one of them)."""
        dev = self._devices.get(device)
        if dev is not None and dev.budget > 0 and nbytes > 0:
            dev.holders[holder] = _Holder(key, min(nbytes, dev.budget))

    def only_shares(self, device: int) -> bool:
        """Nothing but what `hold` holds without a key (judged kernels' outputs waiting for
        their judges, kernels' processes serving them) is held on the GPU: no running job
        will give any back."""
        dev = self._devices.get(device)
        return dev is not None and all(h.key == "" for h in dev.holders.values())

    def release(self, device: int, worker_id: str) -> bool:
        """The job process's memory is given back. True if it held some (waiters may go)."""
        dev = self._devices.get(device)
        return dev is not None and dev.holders.pop(worker_id, None) is not None

    def sweep(self, device: int, live: set[str]) -> list[str]:
        """Gives back what holders not in `live` hold (a job process whose exit went unheard,
        its record gone): a job waiting for the GPU to itself would wait for them for ever.
        The holders dropped."""
        dev = self._devices.get(device)
        stale = [h for h in dev.holders if h not in live] if dev is not None else []
        for holder in stale:
            del dev.holders[holder]  # type: ignore[union-attr]
        return stale

    def usage(self, device: int) -> tuple[int, int, int]:
        """(bytes reserved, the budget, jobs holding) of a GPU."""
        dev = self._devices.get(device)
        if dev is None:
            return 0, 0, 0
        return dev.reserved(), dev.budget, len(dev.holders)
