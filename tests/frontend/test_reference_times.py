"""jobs/reference_times.py: which jobs share a judge's time of their reference, for how long."""

from __future__ import annotations

import pytest
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval_server.jobs import reference_times
from kerneleval_server.jobs.judge_record import reference_key
from kerneleval_server.jobs.reference_times import ReferenceTimes


def spec(**options: object) -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec()
    s.kernel.type = kernel_pb2.KERNEL_TYPE_TRITON
    s.kernel.source_code = "candidate"
    s.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    s.reference.source_code = "class Model: ..."
    for name, value in options.items():
        setattr(s.options, name, value)
    return s


def timed(median: float) -> job_pb2.EvalResult:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OK)
    result.reference_runtime.median_ms = median
    return result


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(reference_times.time, "monotonic", c)
    return c


def test_a_time_is_given_until_it_is_older_than_the_limit(clock: Clock) -> None:
    times = ReferenceTimes(60.0)
    s = spec()
    key = reference_key(s)
    assert times.known(0, s, key) is None
    times.learn(0, s, key, timed(2.5))
    clock.now += 59.0
    stats, age = times.known(0, s, key) or (None, 0.0)
    assert stats is not None and stats.median_ms == 2.5 and age == pytest.approx(59.0)
    # Another candidate of the same problem (its code is not in the key) takes it too.
    other = spec()
    other.kernel.source_code = "another candidate"
    assert times.known(0, other, reference_key(other)) is not None
    clock.now += 2.0
    assert times.known(0, s, key) is None


def test_what_decides_a_time_keeps_it_apart() -> None:
    times = ReferenceTimes(60.0)
    s = spec(seed=3)
    times.learn(0, s, reference_key(s), timed(2.5))
    assert times.known(1, s, reference_key(s)) is None, "another GPU"
    apart = [spec(seed=4), spec(seed=3, perf_trial_count=50), spec(seed=3, flush_l2=False)]
    io = spec(seed=3)
    io.kernel.io.args.add(name="n", int_value=8)  # the kernel's IOContract gives the inputs
    new_ref = spec(seed=3)
    new_ref.reference.source_code = "class Model: another"
    for other in [*apart, io, new_ref]:
        assert times.known(0, other, reference_key(other)) is None, other
    assert times.known(0, spec(seed=3, bypass_cache=True), reference_key(s)) is None
    # What a job's time does not depend on does not keep it apart.
    assert times.known(0, spec(seed=3, atol=0.5, correct_trial_count=1), reference_key(s))


def test_nothing_is_kept_that_is_not_one_measured_time(clock: Clock) -> None:
    s = spec()
    key = reference_key(s)
    off = ReferenceTimes(0.0)
    off.learn(0, s, key, timed(2.5))
    assert off.known(0, s, key) is None, "0 times every job's reference"
    times = ReferenceTimes(60.0)
    wrong = timed(2.5)
    wrong.verdict = job_pb2.VERDICT_INCORRECT
    for result in (wrong, timed(0.0), job_pb2.EvalResult(verdict=job_pb2.VERDICT_OK)):
        times.learn(0, s, key, result)
        assert times.known(0, s, key) is None, result
    untimed = spec(perf_trial_count=0)
    times.learn(0, untimed, reference_key(untimed), timed(2.5))
    assert times.known(0, untimed, reference_key(untimed)) is None
    task = spec()
    task.kernel.type = kernel_pb2.KERNEL_TYPE_GPU_MODE  # timed per benchmark case
    times.learn(0, task, reference_key(task), timed(2.5))
    assert times.known(0, task, reference_key(task)) is None


def test_the_oldest_are_dropped_past_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference_times, "MAX_KEPT", 3)
    times = ReferenceTimes(60.0)
    specs = [spec(seed=i) for i in range(4)]
    for s in specs:
        times.learn(0, s, reference_key(s), timed(1.0))
    assert times.known(0, specs[0], reference_key(specs[0])) is None
    assert all(times.known(0, s, reference_key(s)) for s in specs[1:])


def test_a_job_that_asks_for_the_compile_baseline_neither_takes_nor_leaves_a_time() -> None:
    """EvalOptions.compile_baseline (issue 43): its judge times the compiled reference beside
    the eager one; an eager-only time is never handed to it, nor its time mixed with others."""
    times = ReferenceTimes(60.0)
    plain, compiled = spec(seed=3), spec(seed=3, compile_baseline=True)
    key = reference_key(plain)
    assert reference_key(compiled) == key  # the same reference: only the options differ
    times.learn(0, plain, key, timed(2.5))
    assert times.known(0, plain, key) is not None
    assert times.known(0, compiled, key) is None, "an eager-only time for a compiled baseline"
    with_baseline = timed(4.0)
    with_baseline.compiled_reference_runtime.median_ms = 1.0
    times.learn(0, compiled, key, with_baseline)
    stats, _ = times.known(0, plain, key) or (None, 0.0)
    assert stats is not None and stats.median_ms == 2.5, "its time is not mixed in"
    assert times.known(0, compiled, key) is None
