"""Issue 40 for GPU MODE tasks: a KERNEL_TYPE_GPU_MODE job's kernel is timed from outside its
process as a compared ModelNew is (tests/security/test_hostile_timing.py), one session of timed
calls per benchmark case (engine/gpumode_judge_timing.py, engine/timed_calls.py), through the
public API of a real service. Its judge makes each call's data from a secret variant of the
case's seed, checks a random quarter with the task's check_implementation and bounds every call
with its own clock: a swapped clock is timed by that bound (flagged), a cache is found wrong, an
honest kernel is timed by its own clock unflagged; each is followed by the next tenants, judged
right. A task whose data the calls cannot carry is timed in its own process, as the result says.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ke_service import ServiceProcess
from kerneleval import gpumode
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from test_hostile_jobs import hostile_service, next_tenants_are_judged_right, run_job
from test_hostile_jobs import pytestmark as hostile_marks

pytestmark = hostile_marks
SLOW_MS = 20.0


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    # A task's five cases take over 5 MiB of the record (each trial's header room is 1 MiB).
    yield from hostile_service(tmp_path_factory, record_max_mib=64)


@pytest.fixture(scope="module")
def stub(svc: ServiceProcess) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


@pytest.fixture(autouse=True)
def service_up(svc: ServiceProcess) -> None:
    if svc.proc is not None and svc.proc.poll() is not None:
        svc.start()


GPUMODE_TASKS = Path(__file__).resolve().parents[1] / "gpumode_tasks"
SOFTMAX = GPUMODE_TASKS / "softmax_py"
GPUMODE_CHECKS = 5  # the softmax task's cases: 3 tests and 2 benchmarks, each checked once

GPUMODE_ATTACKS = {
    # Its clock swapped, after its checks, for one that reads 19 ms early once (then puts
    # itself back): the harness's clock that reads it next says the call took ~1 ms.
    "gpumode-clock-swapped": f"""
import time

import torch

calls = [0]


def custom_kernel(data):
    x, out = data
    calls[0] += 1
    t = time.monotonic() + 0.02
    while time.monotonic() < t:
        pass
    if calls[0] > {GPUMODE_CHECKS}:
        real = time.perf_counter_ns

        def once():
            time.perf_counter_ns = real
            return real() - 19_000_000

        time.perf_counter_ns = once
    return torch.softmax(x, dim=-1)
""",
    # Outputs cached by the data's pointer and shape: the case's data is the same on every
    # trial of a case (its fixed seed), so the work is done once and handed back after.
    "gpumode-cache-by-pointer": """
import time

import torch

seen = {}


def custom_kernel(data):
    x, out = data
    key = (x.data_ptr(), tuple(x.shape))
    if key not in seen:
        t = time.monotonic() + 0.02
        while time.monotonic() < t:
            pass
        seen[key] = torch.softmax(x, dim=-1)
    return seen[key]
""",
    # Its process's report of the cases' times, rewritten through the frames of the code that
    # builds it (after its checks): the judge takes no time from there.
    "gpumode-frames-rewritten": f"""
import sys
import time

import torch

calls = [0]


def custom_kernel(data):
    x, out = data
    calls[0] += 1
    t = time.monotonic() + 0.02
    while time.monotonic() < t:
        pass
    if calls[0] > {GPUMODE_CHECKS}:
        frame = sys._getframe(1)
        while frame is not None:
            result = getattr(frame.f_locals.get("self"), "result", None)
            if result is not None and hasattr(result, "benchmark_cases"):
                for case in result.benchmark_cases:
                    case.runtime.median_ms = case.runtime.mean_ms = 0.001
                result.runtime.median_ms = result.runtime.mean_ms = 0.001
            frame = frame.f_back
    return torch.softmax(x, dim=-1)
""",
    # Its process told, through the frames, not to serve its judge's timed calls: it then
    # times itself, where it chooses its clock.
    "gpumode-declines-to-serve": """
import sys

import torch


def custom_kernel(data):
    x, out = data
    frame = sys._getframe(1)
    while frame is not None:
        config = getattr(frame.f_locals.get("self"), "config", None)
        if config is not None and hasattr(config, "timed_by_judge"):
            config.timed_by_judge = False
        frame = frame.f_back
    return torch.softmax(x, dim=-1)
""",
}


def _gpumode_spec(source: str, tag: str, task_dir: Path = SOFTMAX) -> object:
    options = kernel_pb2.EvalOptions(perf_trial_count=8, warmup_count=1, correct_trial_count=1)
    options.timeout.seconds = 60
    return gpumode.spec_from_task(
        gpumode.load_task(task_dir), source, options=options, client_tag=tag
    )


def test_a_gpu_mode_kernel_with_a_swapped_clock_is_timed_by_the_judges_bound(stub, svc) -> None:  # type: ignore[no-untyped-def]
    source = GPUMODE_ATTACKS["gpumode-clock-swapped"]
    ran = run_job(stub, _gpumode_spec(source, "mallory-gpumode-clock"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert "time_outside_bound" in [f.rule_id for f in r.flags], ran.describe()
    assert r.runtime.source == job_pb2.TIMING_SOURCE_OUTSIDE_BOUND, ran.describe()
    for case in r.benchmark_cases:
        assert case.runtime.median_ms > SLOW_MS * 0.8, (case, r.notes)
        assert case.runtime.source == job_pb2.TIMING_SOURCE_OUTSIDE_BOUND, case
        assert 0 < case.speedup < 1, case
    assert r.runtime.median_ms > SLOW_MS * 0.8 and 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_a_gpu_mode_kernel_rewriting_its_times_through_frames_is_not_believed(stub, svc) -> None:  # type: ignore[no-untyped-def]
    source = GPUMODE_ATTACKS["gpumode-frames-rewritten"]
    ran = run_job(stub, _gpumode_spec(source, "mallory-gpumode-frames"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    for case in r.benchmark_cases:
        assert case.runtime.median_ms > SLOW_MS * 0.8 and 0 < case.speedup < 1, case
    assert r.runtime.median_ms > SLOW_MS * 0.8 and 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_a_gpu_mode_kernel_that_declines_to_serve_is_not_believed(stub, svc) -> None:  # type: ignore[no-untyped-def]
    source = GPUMODE_ATTACKS["gpumode-declines-to-serve"]
    ran = run_job(stub, _gpumode_spec(source, "mallory-gpumode-declines"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert "was to serve its timed calls" in r.error.message, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_a_gpu_mode_kernel_caching_by_pointer_is_incorrect(stub, svc) -> None:  # type: ignore[no-untyped-def]
    """Every timed call's data is made by the judge from a secret variant of the case's seed
    and written into the same shared memory: a cache by pointer (or by the task's seeds)
    hands back another call's output, which check_implementation fails."""
    source = GPUMODE_ATTACKS["gpumode-cache-by-pointer"]
    ran = run_job(stub, _gpumode_spec(source, "mallory-gpumode-cache"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_INCORRECT, ran.describe()
    assert "replayed_outputs" in [f.rule_id for f in r.flags], ran.describe()
    assert "secret variant of its seed" in r.validation_error, r.validation_error
    assert r.speedup == 0 and not r.HasField("runtime"), ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_an_honest_gpu_mode_kernel_is_timed_from_outside_unflagged(stub, svc) -> None:  # type: ignore[no-untyped-def]
    source = (SOFTMAX / "submission.py").read_text()
    ran = run_job(stub, _gpumode_spec(source, "alice-gpumode-honest"), svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert not [f for f in r.flags if f.source == job_pb2.FLAG_SOURCE_RUNTIME], ran.describe()
    assert r.runtime.source == job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK, ran.describe()
    assert any(n.startswith("timed from outside its process") for n in r.notes), r.notes
    assert r.runtime.timed_from_outside, ran.describe()
    assert len(r.benchmark_cases) == 2
    for case in r.benchmark_cases:
        assert case.passed and case.runtime.trial_count == 8, case
        assert case.runtime.timed_from_outside, case
        assert case.reference_runtime.trial_count == 8 and case.speedup > 0, case
    assert r.runtime.median_ms > 0 and r.speedup > 0, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


UNSHARED_REFERENCE = """
import torch


def generate_input(rows: int, cols: int, seed: int):
    torch.manual_seed(seed)
    x = torch.randn(rows, cols) * 4
    return x, torch.empty_like(x), torch.float32  # a dtype: nothing the timed calls carry


def ref_kernel(data):
    x, _, dtype = data
    return torch.softmax(x.to(dtype), dim=-1)


def check_implementation(data, output):
    want = ref_kernel(data)
    if not torch.allclose(output, want, rtol=1e-5, atol=1e-6):
        return False, "values differ"
    return True, ""
"""

UNSHARED_SUBMISSION = """
import torch


def custom_kernel(data):
    x, out, dtype = data
    return torch.softmax(x.to(dtype), dim=-1)
"""


def test_a_gpu_mode_task_whose_data_cannot_be_shared_is_timed_in_its_process(  # type: ignore[no-untyped-def]
    stub, svc, tmp_path: Path
) -> None:
    """Data holding what the timed calls cannot carry (here a dtype): the job is timed as
    before, in the kernel's process, and says so; never a crash or a wrong verdict."""
    tasks = tmp_path / "tasks"
    shutil.copytree(GPUMODE_TASKS, tasks)
    (tasks / "softmax_py" / "reference.py").write_text(UNSHARED_REFERENCE)
    ran = run_job(stub, _gpumode_spec(UNSHARED_SUBMISSION, "carol-gpumode-unshared",
                                      tasks / "softmax_py"), svc)  # fmt: skip
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert any(n.startswith("timed in its own process, not from outside: benchmark 0: its "
                            "data holds a dtype") for n in r.notes), r.notes  # fmt: skip
    assert not any(n.startswith("timed from outside") for n in r.notes), r.notes
    assert not r.runtime.timed_from_outside, ran.describe()
    assert all(c.runtime.trial_count == 8 and c.speedup > 0 for c in r.benchmark_cases), r
