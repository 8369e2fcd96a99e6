"""Issue 40: times no candidate can forge. Each attack is a `ModelNew` compared with its
reference through the public API of a real service (the watchdog, sealed job processes, a
judge process): the kernel's timed calls are driven by its judge, which never loads its code,
and bounded by the judge's clock (engine/timed_calls.py). Whatever the candidate does to the
clocks, the frames or its outputs in its own process, it is timed by that bound (flagged
time_outside_bound) or found wrong on inputs it never saw; the next tenants are judged right.

The attacks work for 20 ms a call and try to be timed as if they took none; the reference
takes well under that, so a forged time shows as a speedup over 1 and an honest one under it.
"""

from __future__ import annotations

import hostile_sources as hs
import pytest
from kerneleval.v1 import job_pb2
from test_hostile_jobs import (  # noqa: F401 - the module's service and stub are fixtures here
    next_tenants_are_judged_right,
    run_job,
    spec,
    stub,
    svc,
)

pytestmark = pytest.mark.timeout(180)
SLOW_MS = 20.0

REFERENCE = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


def get_inputs():
    return [torch.randn(4096)]


def get_init_inputs():
    return []
"""

HEAD = """
import ctypes
import sys
import threading
import time

import torch
"""

HONEST = """
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x * 2.0
"""

ATTACKS = {
    # The clock the harness reads, swapped after its work for one that reads 19 ms early
    # once (then puts itself back): only in its timed calls, after its check (which would
    # see a rewritten timing).
    "clock-swapped": """
class ModelNew(torch.nn.Module):
    calls = 0

    def forward(self, x):
        ModelNew.calls += 1
        t = time.monotonic() + 0.02
        while time.monotonic() < t:
            pass
        if ModelNew.calls > 1:
            real = time.perf_counter_ns

            def once():
                time.perf_counter_ns = real
                return real() - 19_000_000

            time.perf_counter_ns = once
        return x * 2.0
""",
    # Its calls of no work slowed by 20 ms (the engine's copy of the outputs rebound, a
    # module no check watches, to sleep where forward did not run: a call of no work), so
    # that the path's cost looks 20 ms dearer and the bound of its real calls 20 ms lower;
    # its own clock then swapped, as above, to agree with it.
    "calls-of-no-work-slowed": """
from kerneleval_server.engine import timed_calls

_copy = timed_calls._copy_outputs


def _slow_copy(got, outputs):
    if not ModelNew.in_call:
        time.sleep(0.02)
    ModelNew.in_call = False
    return _copy(got, outputs)


timed_calls._copy_outputs = _slow_copy


class ModelNew(torch.nn.Module):
    calls = 0
    in_call = False

    def forward(self, x):
        ModelNew.calls += 1
        ModelNew.in_call = True
        t = time.monotonic() + 0.02
        while time.monotonic() < t:
            pass
        if ModelNew.calls > 1:
            real = time.perf_counter_ns

            def once():
                time.perf_counter_ns = real
                return real() - 19_900_000

            time.perf_counter_ns = once
        return x * 2.0
""",
    # Its process told, through the frames of the code that runs it, not to serve its timed
    # calls to its judge: it then times itself, where it can choose its clock.
    "declines-to-serve": """
class ModelNew(torch.nn.Module):
    def forward(self, x):
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            config = getattr(owner, "config", None)
            if config is not None and hasattr(config, "timed_by_judge"):
                config.timed_by_judge = False
            frame = frame.f_back
        return x * 2.0
""",
    # The result's time, rewritten through the frames of the code that builds it (its own
    # process's report: the judge takes no time from there).
    "frames-rewritten": """
class ModelNew(torch.nn.Module):
    def forward(self, x):
        t = time.monotonic() + 0.02
        while time.monotonic() < t:
            pass
        frame = sys._getframe(1)
        while frame is not None:
            owner = frame.f_locals.get("self")
            result = getattr(owner, "result", None)
            if result is not None and hasattr(result, "runtime"):
                result.runtime.median_ms = 0.001
                result.runtime.mean_ms = 0.001
            frame = frame.f_back
        return x * 2.0
""",
    # Honest for its first calls (its check), then its work left to run after it returns.
    "work-after-return": """
class ModelNew(torch.nn.Module):
    calls = 0

    def forward(self, x):
        ModelNew.calls += 1
        if ModelNew.calls <= 2:
            return x * 2.0
        out = torch.zeros_like(x)
        src = x.clone()

        def later():
            time.sleep(0.02)
            out.copy_(src * 2.0)

        threading.Thread(target=later, daemon=True).start()
        return out
""",
    # A cache keyed on what it can see of its input: its pointer and version counter.
    "cache-by-version": """
class ModelNew(torch.nn.Module):
    seen = {}

    def forward(self, x):
        key = (x.data_ptr(), x._version)
        if key not in ModelNew.seen:
            t = time.monotonic() + 0.02
            while time.monotonic() < t:
                pass
            ModelNew.seen[key] = x * 2.0
        return ModelNew.seen[key]
""",
}


def _spec(attack: str) -> object:
    s = spec(HEAD + ATTACKS[attack], reference=REFERENCE, client_tag=f"mallory-{attack}",
             perf_trials=8)  # fmt: skip
    s.options.warmup_count = 1
    return s


def test_a_swapped_clock_is_timed_by_the_judges_bound(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    ran = run_job(stub, _spec("clock-swapped"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert "time_outside_bound" in [f.rule_id for f in r.flags], ran.describe()
    assert r.runtime.source == job_pb2.TIMING_SOURCE_OUTSIDE_BOUND, ran.describe()
    assert r.runtime.median_ms > SLOW_MS * 0.8, ran.describe()
    assert 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_slowed_calls_of_no_work_do_not_lower_the_bound(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The path's cost is measured through the candidate's process, which may slow it: it is
    capped at what the judge measures of that work itself (time_bound.decide)."""
    ran = run_job(stub, _spec("calls-of-no-work-slowed"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert "time_outside_bound" in [f.rule_id for f in r.flags], ran.describe()
    assert r.runtime.median_ms > SLOW_MS * 0.8, ran.describe()
    assert any("calls of no work took longer" in n for n in r.notes), r.notes
    next_tenants_are_judged_right(stub, svc, ran)


def test_a_process_that_declines_to_serve_its_timed_calls_is_not_believed(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The front end tells the judge that the kernel's process was given its timed calls
    (JudgeRequest.kernel_timed_by_judge): one that timed itself instead, its outputs all in
    the record, chose its clock, and its times are not taken."""
    ran = run_job(stub, _spec("declines-to-serve"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert "was to serve its timed calls" in r.error.message, ran.describe()
    assert r.runtime.median_ms == 0 and r.speedup == 0, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_a_time_rewritten_through_frames_is_not_the_one_reported(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    ran = run_job(stub, _spec("frames-rewritten"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert r.runtime.median_ms > SLOW_MS * 0.8, ran.describe()
    assert 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


@pytest.mark.parametrize("attack", ["work-after-return", "cache-by-version"])
def test_outputs_not_computed_from_the_calls_inputs_are_incorrect(stub, svc, attack: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    ran = run_job(stub, _spec(attack), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_INCORRECT, ran.describe()
    assert "replayed_outputs" in [f.rule_id for f in r.flags], ran.describe()
    assert r.speedup == 0, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_an_honest_candidate_is_timed_by_its_own_clock_unflagged(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The same path for an honest kernel: its own times agree with the judge's bound, it is
    not flagged, and the result says how it was timed."""
    honest = HONEST
    s = spec(honest, reference=REFERENCE, client_tag="alice-honest", perf_trials=8)
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert not [f for f in r.flags if f.source == job_pb2.FLAG_SOURCE_RUNTIME], ran.describe()
    assert r.runtime.source == job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK, ran.describe()
    assert any(n.startswith("timed from outside its process") for n in r.notes), r.notes
    assert r.runtime.timed_from_outside, ran.describe()
    assert r.runtime.trial_count == 8 and r.reference_runtime.trial_count == 8


def test_a_time_of_its_own_process_is_never_said_to_be_from_outside(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Evaluate without a reference: the kernel's process times it (no judge), and code of its
    own that marks that time as bounded from outside (a thread that keeps setting it on the
    engine's result, found through the frames) is not believed: only a judge's answer says
    so (RuntimeStats.timed_from_outside)."""
    attack = """
def _keep_saying(result):
    while True:  # after the engine's own copy of its stats, until the outcome is sent
        result.runtime.timed_from_outside = True
        time.sleep(0.0005)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        frame = sys._getframe(1)
        while frame is not None:
            result = getattr(frame.f_locals.get("self"), "result", None)
            if result is not None and hasattr(result, "runtime"):
                threading.Thread(target=_keep_saying, args=(result,), daemon=True).start()
                break
            frame = frame.f_back
        return x * 2.0


def get_inputs():
    return [torch.randn(4096)]
"""
    s = spec(HEAD + attack, client_tag="mallory-says-outside", perf_trials=8)
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK and r.runtime.trial_count == 8, ran.describe()
    assert not r.runtime.timed_from_outside, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_the_victim_sources_still_pass(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The hostile suite's honest candidates, timed the new way, are judged right."""
    s = spec(hs.victim_source(wrong=False), reference=hs.REFERENCE, client_tag="carol",
             perf_trials=4)  # fmt: skip
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
