"""Timing as do_bench does it: CUDA events, warm-ups, the L2 flushed before each trial, trials
queued back to back. A kernel that leaves work on another stream (seen in most of a few
probe runs) is timed with a device-wide synchronize after every trial instead, so that the
hidden work is counted.

Persisting L2: a kernel can set part of the L2 aside (cudaLimitPersistingL2CacheSize) and mark
its data persisting (an access-policy window on its stream), and that data survives the flush.
Before the warm-ups, before every timed trial (ahead of its flush) and after the last one, the
timing demotes every persisting line and sets the limit back to 0 (`PersistingL2.reset`: two
runtime calls a trial, about 4 us on an H100, not waiting for the GPU), and says how often it
found the limit set again after the first reset (the persisting_l2 flag).

The clocks, events and synchronizes are the ones bound when this module was imported (before
any job code ran): a candidate that rewrites time.perf_counter_ns or torch.cuda.Event's methods
later changes nothing here, and what it rewrites in this module tamper.check_timers reports."""

from __future__ import annotations

import ctypes
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401 - np.median's first call imports it: here, not in a timed job
import torch
from kerneleval.v1 import job_pb2

L2_FLUSH_BYTES = 256 * 1024 * 1024  # as triton.testing.do_bench: larger than any L2
WARMUP_MS = 25.0  # at least this much warm-up work, as triton.testing.do_bench
MAX_EXTRA_WARMUPS = 10_000
_IDLE_CYCLES = 100_000  # without a flush, a short spin hides the host's launch latency
LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize (cuda_runtime_api.h, CUDA 11+)

# Bound at import, before any job code runs (see the module's docstring).
_perf_counter_ns = time.perf_counter_ns
_cuda_synchronize = torch.cuda.synchronize
_cuda_sleep: Callable[[int], None] = torch.cuda._sleep
_empty = torch.empty


class _Event(torch.cuda.Event):
    """torch.cuda.Event with the methods it had at import."""

    record = torch.cuda.Event.record
    elapsed_time = torch.cuda.Event.elapsed_time
    synchronize = torch.cuda.Event.synchronize


@dataclass
class TrialCheck:
    """Work around one timed trial, outside its timed span: `before` it (new inputs written in
    place), `after` it (its outputs checked). Which trial is the caller's secret."""

    trial: int
    before: Callable[[], None]
    after: Callable[[], None]


@dataclass
class Timing:
    stats: job_pb2.RuntimeStats
    side_stream_trials: int = 0  # trials whose work finished after the launching stream
    persisting_l2_bytes: int = 0  # the largest persisting-L2 set-aside found (and reset)
    persisting_l2_resets: int = 0  # how many resets found one
    note: str = ""  # why persisting L2 could not be reset, where it could not


class PersistingL2:
    """The persisting-L2 set-aside, through the CUDA runtime this process already loaded (the
    libcudart torch links, found by its soname: nothing new is loaded). `reset` demotes every
    persisting line (cudaCtxResetPersistingL2Cache) and sets the limit back to 0, and answers
    the limit it found: two calls when none was set. None where it cannot (`note` says why);
    after a failed call it stops trying, and clears the runtime's last error, which torch's
    next launch check would otherwise take for its own."""

    def __init__(self, lib: Any = None, note: str = "") -> None:
        self.lib, self.note = lib, note

    def reset(self) -> int | None:
        lib = self.lib
        if lib is None:
            return None
        size = ctypes.c_size_t(0)
        ok = (
            self._call("cudaDeviceGetLimit", ctypes.byref(size), LIMIT_PERSISTING_L2)
            and self._call("cudaCtxResetPersistingL2Cache")
            and (not size.value or self._call("cudaDeviceSetLimit", LIMIT_PERSISTING_L2, 0))
        )
        return size.value if ok else None

    def _call(self, name: str, *args: Any) -> bool:
        code: int = getattr(self.lib, name)(*args)
        if code != 0:
            self.lib.cudaGetLastError()
            self.lib = None
            self.note = (
                f"persisting L2 was not reset before timed trials: {name} failed (cudaError {code})"
            )
        return code == 0


def _load_cudart() -> PersistingL2:
    names = []
    if torch.version.cuda:
        names.append(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    try:
        with open("/proc/self/maps") as maps:
            names += sorted({line.split()[-1] for line in maps if "/libcudart.so" in line})
    except OSError:
        pass
    for name in names:
        try:  # RTLD_NOLOAD: only a library this process has loaded already
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            lib.cudaDeviceGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
            lib.cudaDeviceSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
            lib.cudaCtxResetPersistingL2Cache.argtypes = []
        except (OSError, AttributeError):
            continue
        return PersistingL2(lib)
    return PersistingL2(
        note="persisting L2 was not reset before timed trials: the CUDA runtime (libcudart) "
        "is not loaded in this process"
    )


_cudart: PersistingL2 | None = None


def persisting_l2() -> PersistingL2:
    """The process's PersistingL2, looked up once (tests replace this function)."""
    global _cudart
    if _cudart is None:
        _cudart = _load_cudart()
    return _cudart


@dataclass
class _L2Resets:
    control: PersistingL2
    found: int = 0
    resets: int = 0

    def __call__(self, count: bool = True) -> None:
        size = self.control.reset()
        if size and count:
            self.found, self.resets = max(self.found, size), self.resets + 1

    def into(self, t: Timing) -> Timing:
        t.persisting_l2_bytes, t.persisting_l2_resets = self.found, self.resets
        t.note = self.control.note
        return t


def measure(
    fn: Callable[[], object],
    *,
    trials: int,
    warmup: int,
    flush_l2: bool,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
    check: TrialCheck | None = None,
) -> Timing:
    every = max(1, trials // 10)

    def tick(done: int) -> None:
        if progress is not None and (done % every == 0 or done == trials):
            progress(done, trials)

    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        # A chain of pairs, not a list: code that finds this frame (sys._getframe) can read
        # the times taken so far but not rewrite them.
        taken: tuple[Any, ...] = ()
        for i in range(trials):
            _around(check, i, before=True)
            t0 = _perf_counter_ns()
            fn()
            taken = ((_perf_counter_ns() - t0) / 1e6, taken)
            _around(check, i, before=False)
            tick(i + 1)
        times = []
        while taken:
            times.append(taken[0])
            taken = taken[1]
        times.reverse()
        return Timing(stats(times, job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK, flushed=False))
    return _measure_cuda(fn, trials, warmup, flush_l2, tick, check=check)


def _around(check: TrialCheck | None, trial: int, *, before: bool) -> None:
    if check is not None and check.trial == trial:
        (check.before if before else check.after)()


class CudaOps:
    """The CUDA calls timing makes; tests replace them with a simulated device."""

    def event(self) -> Any:
        return _Event(enable_timing=True)

    def synchronize(self) -> None:
        _cuda_synchronize()

    def flush_buffer(self) -> Any:
        return _empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def flush(self, buffer: Any) -> None:
        buffer.zero_()

    def idle(self) -> None:
        _cuda_sleep(_IDLE_CYCLES)


def _measure_cuda(
    fn: Callable[[], object],
    trials: int,
    warmup: int,
    flush_l2: bool,
    tick: Callable[[int], None],
    ops: Any = None,
    check: TrialCheck | None = None,
) -> Timing:
    ops = ops or CudaOps()
    l2 = _L2Resets(persisting_l2())
    cache = ops.flush_buffer() if flush_l2 else None
    # Not counted: a limit found before the warm-ups may be the driver's default (9.4 MiB
    # on an H100 with driver 580), or set by code that ran before (the reference too).
    l2(count=False)
    _warm_up(fn, warmup, ops)
    baseline = _sync_gap_ms(ops)
    if _hides_work(fn, ops, baseline):
        t = _measure_synchronized(fn, trials, cache, tick, ops, baseline, check, l2)
        l2()  # what the last trial set aside is not left to the next code timed
        return l2.into(t)
    # do_bench's loop: trials queued back to back, so the GPU runs at the clocks it runs at
    # under load, and the host's launch latency hides behind the flush of the next trial.
    # A synchronize every tenth of the way keeps progress true for long kernels.
    # Tuples: code that finds this frame cannot swap an event for one of its own.
    start = tuple(ops.event() for _ in range(trials))
    end = tuple(ops.event() for _ in range(trials))
    every = max(1, trials // 10)
    for i in range(trials):
        _around(check, i, before=True)
        _prepare(ops, cache, l2)
        start[i].record()
        fn()
        end[i].record()
        _around(check, i, before=False)
        if (i + 1) % every == 0 or i + 1 == trials:
            ops.synchronize()
            tick(i + 1)
    l2()
    times = [s.elapsed_time(e) for s, e in zip(start, end, strict=True)]
    return l2.into(Timing(stats(times, job_pb2.TIMING_SOURCE_CUDA_EVENTS, flushed=flush_l2)))


def _warm_up(fn: Callable[[], object], count: int, ops: Any) -> None:
    """`count` runs, then more until WARMUP_MS of GPU time have passed, as do_bench's 25 ms:
    under sustained load the clocks settle lower (on an H200 a 4096^3 fp16 matmul timed 10%
    faster after 10 warm-ups than after 25 ms of them). warmup_count 0 means none at all."""
    if count <= 0:
        return
    begin, end = ops.event(), ops.event()
    begin.record()
    for _ in range(count):
        fn()
    end.record()
    ops.synchronize()
    spent = begin.elapsed_time(end)
    if spent < WARMUP_MS:
        per_run = max(spent / count, 1e-3)
        for _ in range(min(math.ceil((WARMUP_MS - spent) / per_run), MAX_EXTRA_WARMUPS)):
            fn()
        ops.synchronize()


def _prepare(ops: Any, cache: Any, l2: Callable[[], None]) -> None:
    # Demoted first, then flushed: lines still persisting would survive the flush, and
    # demoted after it they would stay in the L2 for the trial.
    l2()
    if cache is not None:
        ops.flush(cache)
    else:
        ops.idle()


def _hides_work(fn: Callable[[], object], ops: Any, baseline: float, probes: int = 5) -> bool:
    """Whether work outlasts the launching stream in most of a few synchronized runs: a
    majority, because one late host thread looks the same as one hidden kernel."""
    late = 0
    for _ in range(probes):
        ops.idle()
        end, after = ops.event(), ops.event()
        fn()
        end.record()
        ops.synchronize()
        after.record()
        ops.synchronize()
        late += end.elapsed_time(after) > _gap_limit(baseline)
    return late * 2 > probes


def _gap_limit(baseline: float) -> float:
    return baseline * 2 + 0.02


def _measure_synchronized(
    fn: Callable[[], object],
    trials: int,
    cache: Any,
    tick: Callable[[int], None],
    ops: Any,
    baseline: float,
    check: TrialCheck | None = None,
    l2: Callable[[], None] = lambda: None,
) -> Timing:
    """For kernels that leave work on other streams: a device-wide synchronize after every
    trial, and the trial lasts until that work ends."""
    start = tuple(ops.event() for _ in range(trials))
    end = tuple(ops.event() for _ in range(trials))
    after = tuple(ops.event() for _ in range(trials))
    for i in range(trials):
        _around(check, i, before=True)
        _prepare(ops, cache, l2)
        start[i].record()
        fn()
        end[i].record()
        ops.synchronize()  # every stream: work on side streams ends before `after`
        after[i].record()
        _around(check, i, before=False)
        tick(i + 1)
    ops.synchronize()
    times, hidden = [], 0
    for s, e, a in zip(start, end, after, strict=True):
        t = s.elapsed_time(e)
        if e.elapsed_time(a) > _gap_limit(baseline):
            hidden += 1
            t = max(t, s.elapsed_time(a) - baseline)
        times.append(t)
    flushed = cache is not None
    return Timing(stats(times, job_pb2.TIMING_SOURCE_CUDA_EVENTS, flushed=flushed), hidden)


def _sync_gap_ms(ops: Any, samples: int = 21) -> float:
    """Median time from an idle stream's last event to an event recorded after a device-wide
    synchronize: the cost of the check itself, not of any kernel."""
    gaps = []
    for _ in range(samples):
        e, a = ops.event(), ops.event()
        e.record()
        ops.synchronize()
        a.record()
        ops.synchronize()
        gaps.append(e.elapsed_time(a))
    return float(np.median(gaps))


def stats(
    times_ms: list[float], source: job_pb2.TimingSource, *, flushed: bool
) -> job_pb2.RuntimeStats:
    a = np.asarray(times_ms, dtype=np.float64)
    if a.size == 0:
        return job_pb2.RuntimeStats(source=source, l2_flushed=flushed)
    return job_pb2.RuntimeStats(
        mean_ms=float(a.mean()),
        median_ms=float(np.median(a)),
        std_ms=float(a.std(ddof=1)) if a.size > 1 else 0.0,
        min_ms=float(a.min()),
        max_ms=float(a.max()),
        p95_ms=float(np.percentile(a, 95)),
        p99_ms=float(np.percentile(a, 99)),
        trial_count=int(a.size),
        source=source,
        l2_flushed=flushed,
    )
