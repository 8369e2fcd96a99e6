"""bench_rl_step's candidates, checked on the CPU: the mix adds up, every candidate is a
distinct valid spec carrying what it was planted with, and the Triton ones get their planted
verdicts in the engine (Triton's interpreter; the CUDA ones need a GPU: the bench's own run
checks them)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_rl_step as R  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402

needs_kernelbench = pytest.mark.skipif(
    not (R.KERNELBENCH / "level1").is_dir(), reason="no ../shared/kernelbench"
)


def test_the_mix_adds_up_and_spreads_over_problems_and_backends() -> None:
    planned = R.plan(64, R.DEFAULT_MIX, ["cuda", "triton"], seed=19)
    assert Counter(p["kind"] for p in planned) == {
        "ok": 44, "wrong": 10, "compile_error": 5, "fault": 5
    }  # fmt: skip
    assert Counter(p["backend"] for p in planned) == {"cuda": 32, "triton": 32}
    assert {p["problem"] for p in planned} == set(R.PROBLEMS)
    assert planned == R.plan(64, R.DEFAULT_MIX, ["cuda", "triton"], seed=19)  # seeded
    with pytest.raises(SystemExit, match="adds up to 3"):
        R.plan(64, "ok=3", ["cuda"], seed=1)
    with pytest.raises(SystemExit, match="unknown kind"):
        R.plan(1, "lucky=1", ["cuda"], seed=1)


@needs_kernelbench
def test_candidates_are_distinct_valid_and_carry_their_plant() -> None:
    planned = R.plan(64, R.DEFAULT_MIX, ["cuda", "triton"], seed=19)
    specs = R.specs_for(planned, "t", smoke=False, timeout_s=60)
    assert len({s.kernel.source_code for s in specs}) == 64
    for p, spec in zip(planned, specs, strict=True):
        assert validate_spec(spec) == [], p
        src = spec.kernel.source_code
        assert ("load_inline" in src) == (p["backend"] == "cuda")
        assert ("undefined" in src) == (p["kind"] == "compile_error")
        assert ("<< 36" in src) == (p["kind"] == "fault")
        assert ("+ 0.01" in src) == (p["kind"] == "wrong")
        assert spec.options.seed == 42 and spec.options.perf_trial_count == 10


@needs_kernelbench
@pytest.mark.parametrize("kind", ["ok", "wrong", "compile_error"])
def test_triton_candidates_get_their_verdicts_in_the_engine(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as a CPU job process runs Triton
    planned = [{"index": 0, "problem": "19_ReLU.py", "backend": "triton", "kind": kind,
                "block": 128}]  # fmt: skip
    (spec,) = R.specs_for(planned, "engine", smoke=True, timeout_s=60)
    spec.options.perf_trial_count = 0
    outcome = run_job(spec, NullReporter(), EngineConfig(work_dir=tmp_path))
    assert outcome.result.verdict == R.SMOKE_EXPECTED[kind], outcome.result


def test_a_configurations_row_summarizes_its_steps() -> None:
    """--configs: each set of the service's flags gets a row of its steps (walls, as
    planted, the share of job-seconds waiting for a process, the window's share of wall,
    processes started, jobs re-run alone, the windows' OpenWindow and time held)."""

    def job(wait: float, total: float) -> dict[str, object]:
        phases = dict.fromkeys(R.PHASES, 0.0)
        return {"phases": phases | {"wait_for_process": wait, "total": total}}

    steps = [
        {"wall_s": 30.0, "as_planted": 64, "timing_window_fraction": {"0": 0.5},
         "jobs": [job(1.0, 4.0), job(1.0, 4.0)], "processes_started": 150,
         "alone_reruns": [{"job_id": "a"}]},
        {"wall_s": 20.0, "as_planted": 63, "timing_window_fraction": {"0": 0.7},
         "jobs": [job(3.0, 4.0), job(3.0, 4.0)], "processes_started": 140},
    ]  # fmt: skip
    windows = {"open_ms": 1.5, "held_ms": 480.0}
    row = R.config_row({"flags": "--freeze-warming false", "steps": steps, "windows": windows})
    assert row == ["--freeze-warming false", 2, "30.0, 20.0", 25.0, "64, 63", 0.5, 0.6,
                   "150, 140", "1, 0", 1.5, 480.0]  # fmt: skip
    assert R.config_row({"flags": "", "steps": steps[:1]})[0] == "(defaults)"


def test_a_cold_row_says_the_start_and_the_pool_before_each_step() -> None:
    """Issue 44's report: the cold start (service start to the first verdict) as its own row,
    and what the service held ready (processes, GPU memory) before each step."""
    run = {"flags": "", "pch_s": 69.0, "pool_ready_s": 80.5, "cold_start_s": 95.25,
           "steps": [{"pool_before": {"processes": 19, "memory_used_mib": 9000.4}},
                     {"pool_before": {"processes": 21, "memory_used_mib": 10500.0}}]}  # fmt: skip
    assert R.cold_row(run) == ["(defaults)", 69.0, 80.5, 95.25, "19, 21", "9000, 10500"]


def test_the_memory_sampler_says_the_fullest_gpu_and_the_processes_while_jobs_wait() -> None:
    """Issue 44: what the GPU held (nvidia-smi, by role) at its fullest, and, only over the
    samples while a job of the step waited for its process, the median count of each role
    (slots full beside ready processes, or processes short)."""
    sampler = R.GpuMemorySampler.__new__(R.GpuMemorySampler)
    sampler.samples = [
        {"busy": 90.0, "judging": 40.0, "total": 130.0, "n busy": 16, "n idle": 3, "t": 10.0},
        {"busy": 50.0, "total": 50.0, "n busy": 12, "n idle": 0, "t": 11.0},
        {"busy": 10.0, "total": 10.0, "n busy": 2, "n idle": 9, "t": 30.0},  # none waits
    ]
    summary = sampler.summary([(9.0, 11.5), (9.5, 10.5)])
    assert summary["at_most_mib"]["total"] == 130.0
    assert summary["while_jobs_wait"] == {"samples": 2, "n busy": 14.0, "n idle": 1.5}
    run = {"flags": "", "steps": [{
        "footprints": {"kernel": {"peak_median_mib": 26404.0},
                       "judge": {"peak_median_mib": 49186.0}},
        "gpu_memory": summary, "alone_reruns": [{}],
    }]}  # fmt: skip
    row = R.memory_row(run, 0)
    assert row[:6] == ["(defaults)", 0, 26404.0, 49186.0, 130.0, 90.0]
    assert row[6] == 40.0 and row[-2] == 1 and row[-1] == "14.0/1.5/0/0"
    assert R.queued_at({}) == []
