"""Issue 16's benchmarks' helpers (bench_result_cache, bench_mcp), checked on the CPU: the
batch's repeats are where and what they should be, and every spec passes the service's
validation."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_result_cache as RC  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402


def test_job_plan_spreads_repeats_of_earlier_jobs() -> None:
    plan = RC.job_plan(600, 0.3)
    assert len(plan) == 600 and plan[0] == 0
    firsts: set[int] = set()
    repeat_slots = []
    for slot, number in enumerate(plan):
        if number in firsts:
            repeat_slots.append(slot)
        else:
            assert number == len(firsts)  # new jobs are numbered in order
            firsts.add(number)
    assert len(repeat_slots) == 180 and len(firsts) == 420
    for start in range(0, 600, 10):  # 3 of every 10: interleaved, not bunched at the end
        assert sum(1 for s in repeat_slots if start <= s < start + 10) == 3
    assert RC.job_plan(600, 0.3) == plan  # the seed fixes it
    assert RC.job_plan(600, 0.3, seed=1) != plan
    assert RC.job_plan(10, 0.0) == list(range(10))
    with pytest.raises(ValueError):
        RC.job_plan(10, 1.0)


def test_batch_repeats_are_exact_copies_and_pass_validation() -> None:
    plan = RC.job_plan(40, 0.3)
    args = argparse.Namespace(size=64, correct_trials=2, warmup_count=3, perf_trials=20)
    for bypass in (True, False):
        specs = RC.batch(plan, args, bypass=bypass)
        assert len(specs) == 40
        assert all(s.options.bypass_cache is bypass for s in specs)
        for slot, (number, spec) in enumerate(zip(plan, specs, strict=True)):
            first = plan.index(number)
            assert spec == specs[first] and (slot == first or spec is not specs[first])
        assert len({s.kernel.source_code for s in specs}) == len(set(plan))
        assert all(validate_spec(s) == [] for s in specs)


def test_repeat_mismatches_and_origins() -> None:
    ok, bad = job_pb2.VERDICT_OK, job_pb2.VERDICT_INCORRECT
    assert RC.repeat_mismatches([0, 1, 0, 1], [ok, bad, ok, bad]) == 0
    assert RC.repeat_mismatches([0, 1, 0, 1], [ok, bad, bad, None]) == 2
    run, cache, shared = (job_pb2.RESULT_ORIGIN_RUN, job_pb2.RESULT_ORIGIN_CACHE,
                          job_pb2.RESULT_ORIGIN_SHARED_RUN)  # fmt: skip
    jobs = [job_pb2.Job(result_origin=o) for o in (run, cache, cache, shared)]
    assert RC.origin_counts(jobs) == {
        "RESULT_ORIGIN_RUN": 1, "RESULT_ORIGIN_CACHE": 2, "RESULT_ORIGIN_SHARED_RUN": 1,
    }  # fmt: skip
    assert [RC.arm_order(r)[0] for r in range(3)] == ["baseline", "cache", "baseline"]


def test_mcp_bench_sends_the_tools_spec_with_a_source_per_call() -> None:
    pytest.importorskip("mcp")  # the client's [mcp] extra
    import bench_mcp

    a, b = bench_mcp.tool_args(1, 1, 0), bench_mcp.tool_args(2, 1, 0)
    assert a["source"] != b["source"] and a["reference_source"] == b["reference_source"]
    spec = bench_mcp.spec_of(a)
    assert spec.kernel.source_code == a["source"] and validate_spec(spec) == []
    assert spec.options.correct_trial_count == 1 and spec.options.perf_trial_count == 0
    assert [bench_mcp.rotation(r)[0] for r in range(4)] == [
        "grpc_evaluate", "grpc_run", "mcp", "grpc_evaluate",
    ]  # fmt: skip
    s = bench_mcp.p50_p90([0.001 * v for v in range(1, 11)])
    assert s["n"] == 10 and s["p50_ms"] == pytest.approx(5.5) and s["p90_ms"] == pytest.approx(9)
