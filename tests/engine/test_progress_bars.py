"""One bar per phase with the result's counts, whatever processes the phases ran in (issue 43):
the engine's own reporters, the kernel's process and then its judge (as the front end streams
them, one after the other), turned into bars by the client's PhaseBars."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine_helpers import ADD_MODEL, TORCH, RecordingReporter, V, job, source
from kerneleval.progress import Bar, PhaseBars
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval_server.engine import EngineConfig, Recorder, judge_job, run_job
from test_gpumode import task_spec
from test_judge import ADD_NEW, LIMIT

PROFILING, VALIDATING = job_pb2.PHASE_PROFILING, job_pb2.PHASE_VALIDATING


def as_events(reporters: list[RecordingReporter]) -> list[job_pb2.JobEvent]:
    out = []
    for rep in reporters:
        for e in rep.events:
            if e[0] == "phase":
                out.append(job_pb2.JobEvent(phase=job_pb2.JobPhase(phase=e[1])))
            elif e[0] == "progress":
                p = job_pb2.JobProgress(phase=e[1], done_count=e[2], total_count=e[3])
                out.append(job_pb2.JobEvent(progress=p))
    return out


def final_bars(spec: kernel_pb2.JobSpec, reporters: list[RecordingReporter]) -> dict[str, Any]:
    """The bars' last counts, and every bar moved in order (a label never goes back)."""
    bars = PhaseBars.for_spec(spec)
    moved: list[Bar] = []
    for ev in as_events(reporters):
        moved += bars.event(ev)
    seen: dict[str, int] = {}
    for b in moved:  # counts only grow
        assert b.done >= seen.get(b.label, 0), moved
        seen[b.label] = b.done
    return {label: (b.done, b.total) for label, b in bars.bars.items()}


def judged_run(engine_dir: Path, spec: kernel_pb2.JobSpec) -> tuple[Any, list[RecordingReporter]]:
    fd = os.memfd_create("record")
    try:
        kernel, judge = RecordingReporter(), RecordingReporter()
        own = run_job(spec, kernel, EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT)))
        assert own.result.verdict == V.VERDICT_OK, own.result
        final = judge_job(spec, judge, EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT)
        return final, [kernel, judge]
    finally:
        os.close(fd)


def test_a_judged_comparison_shows_each_phase_once(engine_dir: Path) -> None:
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), perf_trial_count=4)
    final, reporters = judged_run(engine_dir, spec)
    # Both processes compile, validate and time: two series of phases.
    assert [r.phases().count(PROFILING) for r in reporters] == [1, 1]
    r = final.result
    assert final_bars(spec, reporters) == {
        "compiling": (0, 0),
        "validating": (r.validation.trial_count, r.validation.trial_count),  # 5, not twice
        "profiling kernel": (r.runtime.trial_count, 4),
        "profiling reference": (r.reference_runtime.trial_count, 4),
    }


def test_a_comparison_in_one_process_splits_its_timing(run) -> None:  # type: ignore[no-untyped-def]
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), perf_trial_count=4)
    out, rep = run(spec)
    assert rep.events[-1] == ("progress", PROFILING, 8, 8)  # one series of 2n
    assert final_bars(spec, [rep]) == {
        "compiling": (0, 0),
        "validating": (5, 5),
        "profiling kernel": (4, 4),
        "profiling reference": (4, 4),
    }


def test_a_judged_gpu_mode_task_counts_its_cases_and_each_sides_trials(engine_dir: Path) -> None:
    spec = task_spec()  # 3 tests, 2 benchmarks, 3 timed trials each
    final, reporters = judged_run(engine_dir, spec)
    assert final.result.verdict == V.VERDICT_OK
    # The kernel's process timed the kernel alone: its series ends at its total.
    kernel_timing = [e for e in reporters[0].events if e[:2] == ("progress", PROFILING)]
    assert kernel_timing[-1] == ("progress", PROFILING, 6, 6)
    assert final_bars(spec, reporters) == {
        "compiling": (0, 0),
        "validating": (5, 5),
        "profiling kernel": (6, 6),
        "profiling reference": (6, 6),
    }


def test_a_gpu_mode_task_in_one_process_times_both_sides_case_by_case(run) -> None:  # type: ignore[no-untyped-def]
    spec = task_spec()
    _, rep = run(spec)
    assert final_bars(spec, [rep]) == {
        "compiling": (0, 0),
        "validating": (5, 5),
        "profiling": (12, 12),  # kernel and ref_kernel alternate per case: one bar
    }


def test_a_job_run_again_starts_its_bars_again() -> None:
    bars = PhaseBars(False, 3)
    ev = job_pb2.JobEvent(progress=job_pb2.JobProgress(phase=VALIDATING, done_count=5,
                                                       total_count=5))  # fmt: skip
    assert bars.event(ev) == [Bar("validating", VALIDATING, 5, 5)]  # no phase event before it
    assert bars.event(ev) == []  # nothing new
    bars.event(job_pb2.JobEvent(started=job_pb2.JobStarted(attempt=2)))
    ev.progress.done_count = 1
    assert bars.event(ev)[-1] == Bar("validating", VALIDATING, 1, 5)
