"""ReferenceTimes: a reference's time, measured by one job's judge, given to the judges of the
next jobs of the same reference on the same GPU for a while (--reference-time-reuse-s).

Every candidate of a problem is compared with the same reference (KernelBench times it once
per problem). Timing it again for each candidate took a second timing window per job: the
GPU, held in windows all the time under a batch, timed half as many kernels. Only a judge's
time is kept: the judge is a process no candidate's code ran in, and its window had the GPU
to itself. The time is kept for what decides it: the reference (its code, entry points and
I/O: judge_record.reference_key, given by the caller), the inputs (the kernel's IOContract and
the seed), how it is timed (trials, warm-up, L2 flush) and the GPU. A job that asks for
torch.compile's baseline (EvalOptions.compile_baseline) neither takes nor leaves a time: its
judge compiles and times both references itself, and an eager-only time is never mixed with
one measured beside a compiled baseline.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.spec.validation import is_timed

MAX_KEPT = 1024  # distinct references a front end keeps times of, the oldest dropped first


@dataclass
class _Kept:
    stats: job_pb2.RuntimeStats
    at: float  # time.monotonic() when it was measured (its job's judge answered)


class ReferenceTimes:
    def __init__(self, reuse_s: float) -> None:
        self.reuse_s = reuse_s
        self._kept: dict[tuple[int, str], _Kept] = {}

    def known(
        self, device: int, spec: kernel_pb2.JobSpec, reference: str
    ) -> tuple[job_pb2.RuntimeStats, float] | None:
        """An earlier judge's time of this job's reference (`reference`: its reference_key)
        on this GPU and its age in seconds, if one is younger than the reuse limit and the job
        takes it."""
        key = _key(device, spec, reference)
        if key is None or self.reuse_s <= 0 or spec.options.bypass_cache:
            return None
        kept = self._kept.get(key)
        if kept is None:
            return None
        age = time.monotonic() - kept.at
        if age > self.reuse_s:
            del self._kept[key]
            return None
        return kept.stats, age

    def learn(
        self, device: int, spec: kernel_pb2.JobSpec, reference: str, result: job_pb2.EvalResult
    ) -> None:
        """A judge timed the job's reference (verdict OK, a time it measured itself: the
        caller gave it none)."""
        key = _key(device, spec, reference)
        if (
            key is None
            or self.reuse_s <= 0
            or result.verdict != job_pb2.VERDICT_OK
            or not result.HasField("reference_runtime")
            or not result.reference_runtime.median_ms > 0
        ):
            return
        stats = job_pb2.RuntimeStats()
        stats.CopyFrom(result.reference_runtime)  # the outcome's own goes on with its job
        self._kept.pop(key, None)  # re-inserted last: the dict's order is the age order
        self._kept[key] = _Kept(stats, time.monotonic())
        while len(self._kept) > MAX_KEPT:
            del self._kept[next(iter(self._kept))]


def _key(device: int, spec: kernel_pb2.JobSpec, reference: str) -> tuple[int, str] | None:
    """None for a job whose reference's time is not one number to keep: untimed, a GPU
    MODE task (timed per benchmark case), or one that asks for torch.compile's baseline (its
    judge times the compiled reference beside the eager one, every time)."""
    o = spec.options
    gpu_mode = spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE
    if not is_timed(o) or not spec.HasField("reference") or gpu_mode or o.compile_baseline:
        return None
    timing = kernel_pb2.EvalOptions()
    for name in ("perf_trial_count", "warmup_count", "seed", "flush_l2"):
        if o.HasField(name):
            setattr(timing, name, getattr(o, name))
    h = hashlib.sha256(reference.encode())
    h.update(spec.kernel.io.SerializeToString(deterministic=True))
    h.update(timing.SerializeToString(deterministic=True))
    return device, h.hexdigest()
