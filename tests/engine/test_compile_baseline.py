"""EvalOptions.compile_baseline (issue 43): the reference's Model under torch.compile, timed as
the eager reference is (by its judge: call by call when the judge drives the kernel's timed
calls, timing.measure otherwise; by the kernel's own process where no judge follows), its
compile time outside the timed calls; a compile that fails is a note. torch.compile runs here
on the CPU with inductor's C++ backend: the tests that compile skip without a C++ compiler."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import ADD_MODEL, TORCH, TRITON, TRITON_ADD, RecordingReporter, V, job, source
from test_judge import ADD_NEW, judged, served_judge
from test_triton_launch import add_args

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None,
    reason="torch.compile's inductor backend needs a C++ compiler on the CPU",
)


def _assert_compiled_baseline(r: V.EvalResult, trials: int = 3) -> None:
    assert r.verdict == V.VERDICT_OK, r
    c = r.compiled_reference_runtime
    assert c.median_ms > 0 and c.trial_count == trials, c
    assert c.source == r.reference_runtime.source == V.TIMING_SOURCE_CPU_WALL_CLOCK
    assert r.compiled_speedup == pytest.approx(c.median_ms / r.runtime.median_ms)
    assert r.speedup == pytest.approx(r.reference_runtime.median_ms / r.runtime.median_ms)
    assert r.compile_time.ToNanoseconds() > 0
    assert any(n.startswith("compile_baseline: the reference compiled") for n in r.notes), r.notes


def test_without_the_option_nothing_is_compiled(engine_dir: Path) -> None:
    _, final = judged(engine_dir, job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL)))
    assert final is not None
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.speedup > 0
    assert not r.HasField("compiled_reference_runtime") and not r.HasField("compile_time")
    assert r.compiled_speedup == 0
    assert not any("compile_baseline" in n for n in r.notes)


@needs_compiler
def test_the_judge_times_the_compiled_reference_as_the_eager_one(engine_dir: Path) -> None:
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), compile_baseline=True)
    own, final = judged(engine_dir, spec)
    assert final is not None
    # The kernel's process neither compiles nor times the reference: its judge does.
    assert not own.result.HasField("compiled_reference_runtime")
    _assert_compiled_baseline(final.result)


@needs_compiler
def test_driven_from_outside_the_compiled_reference_takes_the_same_calls(
    engine_dir: Path,
) -> None:
    """The kernel's process serves its timed calls (here a thread, on a socket pair); the
    judge times the eager reference call by call, then the compiled one through the same
    steps on the same trials, then drives the kernel's calls."""
    spec = job(
        source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), compile_baseline=True,
        perf_trial_count=4,
    )  # fmt: skip
    reporter = RecordingReporter()
    r = served_judge(engine_dir, spec, reporter).result
    _assert_compiled_baseline(r, trials=4)
    assert any(n.startswith("timed from outside its process") for n in r.notes), r.notes
    # One timing window for both references (the second: the kernel's calls, driven).
    assert reporter.phases() == [
        V.PHASE_COMPILING, V.PHASE_VALIDATING, V.PHASE_PROFILING, V.PHASE_PROFILING,
    ]  # fmt: skip


@needs_compiler
def test_a_job_judged_in_its_own_process_times_the_compiled_reference_too(run) -> None:  # type: ignore[no-untyped-def]
    out, _ = run(job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), compile_baseline=True))
    _assert_compiled_baseline(out.result)


def test_a_compile_that_fails_is_a_note_not_the_kernels_failure(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(model: object, *a: object, **k: object) -> object:
        def call(*args: object) -> object:
            raise RuntimeError("BackendCompilerFailed: inductor could not compile it")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), compile_baseline=True)
    _, final = judged(engine_dir, spec)
    assert final is not None
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.speedup > 0 and r.failed_side == V.SIDE_UNSPECIFIED
    assert not r.HasField("compiled_reference_runtime") and r.compiled_speedup == 0
    assert any(
        "torch.compile of the reference failed compiling it" in n and "inductor could not" in n
        for n in r.notes
    ), r.notes


def test_a_reference_that_is_no_model_gets_a_note(engine_dir: Path) -> None:
    """A reference launched from its IOContract has no Model to compile."""
    ref = source(TRITON, TRITON_ADD, add_args(), grid=(4, 1, 1))
    spec = job(source(TRITON, TRITON_ADD, add_args(), grid=(4, 1, 1)), ref, compile_baseline=True)
    own, final = judged(engine_dir, spec)
    assert final is not None, own.result
    r = final.result
    assert r.verdict == V.VERDICT_OK, r
    assert not r.HasField("compiled_reference_runtime")
    assert any("the reference is not a Model" in n for n in r.notes), r.notes
