"""The judge (issue 13): a compared job's kernel runs with a Recorder in one engine call, as in
its own job process; judge_job, as in a second process, imports the reference only and gives
the verdict from the record. What the kernel's process claims about itself does not count."""

from __future__ import annotations

import builtins
import os
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from engine_helpers import ADD_MODEL, TORCH, TRITON, TRITON_ADD, RecordingReporter, V, job, source
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2
from kerneleval_server.engine import (
    EngineConfig,
    Outcome,
    PathMeasure,
    Recorder,
    compare,
    gpumode,
    judge,
    judge_job,
    run_job,
)
from kerneleval_server.engine import record as rec
from test_triton_launch import add_args

LIMIT = 64 << 20

ADD_NEW = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a + b
"""

# The module body forges the kernel's own process's comparison: every trial "passes".
FORGED_COMPARE = """
import torch
import kerneleval_server.engine.compare as cmp
import kerneleval_server.engine.runner as runner
_orig = cmp.compare_outputs
def _forged(*a, **k):
    c = _orig(*a, **k)
    c.ok, c.message = True, ""
    return c
cmp.compare_outputs = _forged
runner.compare.compare_outputs = _forged
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return torch.zeros_like(a)
"""


def judged(
    engine_dir: Path,
    spec: kernel_pb2.JobSpec,
    tamper: Callable[[int], None] | None = None,
    limit: int = LIMIT,
) -> tuple[Outcome, Outcome | None]:
    """(the kernel's process's outcome, the judge's or None when it would not be asked). What
    the kernel's code patches (the comparison, GPU MODE's checks) is put back before the judge
    runs: the judge's process is another one."""
    fd = os.memfd_create("record")
    clean = (compare.compare_outputs, gpumode.judgement, gpumode._GpuModeRun._judge)

    def unpatch() -> None:
        compare.compare_outputs, gpumode.judgement, gpumode._GpuModeRun._judge = clean  # type: ignore[method-assign]

    try:
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, limit))
        own = run_job(spec, RecordingReporter(), cfg)
        unpatch()
        if own.result.verdict != V.VERDICT_OK:
            return own, None
        if tamper is not None:
            tamper(fd)
        final = judge_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), own.result, fd, limit
        )
        return own, final
    finally:
        unpatch()
        os.close(fd)


def test_an_honest_kernel_is_ok_with_the_judges_reference_time(engine_dir: Path) -> None:
    own, final = judged(engine_dir, job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL)))
    assert final is not None
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness
    assert r.validation.trials_passed == 5 == r.validation.trial_count
    # The kernel's process timed only the kernel; the reference's time is the judge's.
    assert not own.result.HasField("reference_runtime")
    assert r.runtime == own.result.runtime
    assert r.reference_runtime.median_ms > 0 and r.speedup > 0


def test_a_reference_time_given_by_the_front_end_is_not_measured_again(engine_dir: Path) -> None:
    """An earlier judge's time of the same reference (--reference-time-reuse-s): the judge
    checks the outputs as always, takes no timing phase (no window), and the speedup is
    against the given time, with a note of its age."""
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL))
    fd = os.memfd_create("record")
    try:
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT))
        own = run_job(spec, RecordingReporter(), cfg)
        assert own.result.verdict == V.VERDICT_OK, own.result
        given = V.RuntimeStats(median_ms=own.result.runtime.median_ms * 3, trial_count=100)
        reporter = RecordingReporter()
        final = judge_job(
            spec, reporter, EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT,
            reference_time=(given, 12.5),
        )  # fmt: skip
    finally:
        os.close(fd)
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness, r
    assert r.reference_runtime == given and r.speedup == pytest.approx(3.0)
    assert V.PHASE_VALIDATING in reporter.phases()
    assert V.PHASE_PROFILING not in reporter.phases()
    assert any("12.5 s ago" in n for n in r.notes), r.notes
    assert r.reference_runtime_age.ToMilliseconds() == 12500


def served_judge(
    engine_dir: Path, spec: kernel_pb2.JobSpec, reporter: RecordingReporter,
    reference_time: tuple[V.RuntimeStats, float] | None = None,
    path_measures: Sequence[PathMeasure] = (),
) -> Outcome:  # fmt: skip
    """judge_job driving the kernel's timed calls, served by a thread on a socket pair."""
    fd = os.memfd_create("record")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        cfg = EngineConfig(
            work_dir=engine_dir, recorder=Recorder(fd, LIMIT, theirs.fileno(), LIMIT),
            timed_by_judge=True,
        )  # fmt: skip
        own = run_job(spec, RecordingReporter(), cfg)
        assert own.result.verdict == V.VERDICT_OK and own.serve is not None, own.result
        assert not own.result.HasField("runtime")  # its judge times it
        server = threading.Thread(target=own.serve, args=(theirs.fileno(),), daemon=True)
        server.start()
        final = judge_job(
            spec, reporter, EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT,
            share_fd=mine.fileno(), share_max_bytes=LIMIT, kernel_serves=True,
            reference_time=reference_time, path_measures=path_measures,
        )  # fmt: skip
        server.join(timeout=60)
        return final
    finally:
        os.close(fd)
        mine.close()
        theirs.close()


def test_a_standing_judge_measures_its_own_path_once_with_the_kernel_frozen(
    engine_dir: Path,
) -> None:
    """The cap on a timed call's path (timed_calls.own_path_ns) is the judge's own measure,
    taken in a window with the kernel's process frozen: for a job whose reference time is
    reused too (a window of its own), once per judge (a standing judge's later jobs of that
    reference take no window but the kernel's)."""
    judge.forget_kept()
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), perf_trial_count=4)
    given = (V.RuntimeStats(median_ms=1.0, trial_count=100), 3.0)
    frozen_then_driven = [V.PHASE_VALIDATING, V.PHASE_PROFILING, V.PHASE_PROFILING]
    for window_first in (True, False):
        reporter = RecordingReporter()
        r = served_judge(engine_dir, spec, reporter, given).result
        assert r.verdict == V.VERDICT_OK and r.reference_runtime == given[0], r
        assert any(n.startswith("timed from outside its process") for n in r.notes), r.notes
        want = frozen_then_driven if window_first else frozen_then_driven[::2]
        assert [p for p in reporter.phases() if p != V.PHASE_COMPILING] == want
    # A job that times its reference has a window anyway: one more measure, of which the
    # median stands (one taken on a busy host does not stand for the judge's life).
    assert len(next(iter(judge._own_paths.values()))) == 1
    reporter = RecordingReporter()
    served_judge(engine_dir, spec, reporter, None)
    assert reporter.phases().count(V.PHASE_PROFILING) == 2
    assert len(next(iter(judge._own_paths.values()))) == 2
    judge.forget_kept()  # a new judge measures again
    reporter = RecordingReporter()
    served_judge(engine_dir, spec, reporter, given)
    assert reporter.phases().count(V.PHASE_PROFILING) == 2


def test_a_fresh_judge_given_earlier_judges_path_measures_takes_none(engine_dir: Path) -> None:
    """Issue 44: the front end keeps the judges' measures of their own path (per GPU and
    reference) and gives them to the reference's next judges. A fresh judge given one that
    fits its outputs opens no window for a measure of its own where the reference's time is
    given (its kernel's window only) and takes none; one for other outputs does not fit."""
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), perf_trial_count=4)
    given = (V.RuntimeStats(median_ms=1.0, trial_count=100), 3.0)
    judge.forget_kept()
    (taken,) = served_judge(engine_dir, spec, RecordingReporter(), given).path_measures
    assert taken.ns > 0 and taken.output_bytes == (4 * 64 * 4,), taken
    judge.forget_kept()  # a fresh judge
    reporter = RecordingReporter()
    again = served_judge(engine_dir, spec, reporter, given, path_measures=[taken])
    assert again.result.verdict == V.VERDICT_OK and not again.path_measures, again
    phases = [p for p in reporter.phases() if p != V.PHASE_COMPILING]
    assert phases == [V.PHASE_VALIDATING, V.PHASE_PROFILING]
    judge.forget_kept()
    other = taken._replace(output_bytes=(8,))
    third = served_judge(engine_dir, spec, RecordingReporter(), given, path_measures=[other])
    assert len(third.path_measures) == 1
    judge.forget_kept()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU times: a host without a GPU")
def test_a_cpu_speedup_over_10x_is_not_flagged_and_says_it_is_wall_clock(
    engine_dir: Path,
) -> None:
    """Issue 41: on the CPU, times are host wall-clock, and identical code read 437x there. A
    speedup over 10x is not flagged suspicious on the CPU (a note says why), and the result
    says its times are the host's wall clock."""
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL))
    fd = os.memfd_create("record")
    try:
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT))
        own = run_job(spec, RecordingReporter(), cfg)
        assert own.result.verdict == V.VERDICT_OK, own.result
        given = V.RuntimeStats(
            median_ms=own.result.runtime.median_ms * 437, trial_count=3,
            source=V.TIMING_SOURCE_CPU_WALL_CLOCK,
        )  # fmt: skip
        final = judge_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT,
            reference_time=(given, 1.0),
        )  # fmt: skip
    finally:
        os.close(fd)
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.speedup == pytest.approx(437.0), r
    assert not r.speedup_suspicious, r
    assert any("not flagged" in n and "wall-clock" in n for n in r.notes), r.notes
    assert any("host wall-clock times" in n for n in r.notes), r.notes
    assert r.runtime.source == V.TIMING_SOURCE_CPU_WALL_CLOCK


def test_a_forged_comparison_in_the_kernels_process_is_incorrect(engine_dir: Path) -> None:
    own, final = judged(engine_dir, job(source(TORCH, FORGED_COMPARE), source(TORCH, ADD_MODEL)))
    assert own.result.verdict == V.VERDICT_OK  # its own process believed the forgery
    assert final is not None
    assert final.result.verdict == V.VERDICT_INCORRECT, final.result
    assert not final.result.correctness
    assert not final.result.HasField("runtime")


def test_a_forged_verdict_and_speedup_are_replaced(engine_dir: Path) -> None:
    """What the kernel's process says of its verdict and the reference is not kept."""
    spec = job(source(TORCH, ADD_NEW.replace("a + b", "a - b")), source(TORCH, ADD_MODEL))
    fd = os.memfd_create("record")
    Recorder(fd, LIMIT).record(0, [torch.zeros(4, 64)])
    forged = V.EvalResult(verdict=V.VERDICT_OK, correctness=True, speedup=7.5)
    forged.runtime.median_ms = 0.001
    forged.reference_runtime.median_ms = 1.0
    final = judge_job(
        spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), forged, fd, LIMIT
    )
    os.close(fd)
    assert final.result.verdict == V.VERDICT_INCORRECT
    assert final.result.speedup == 0 and not final.result.HasField("reference_runtime")


def _truncate(fd: int) -> None:
    os.ftruncate(fd, 20)


def _garbage_header(fd: int) -> None:
    os.pwrite(fd, struct.pack(">I", 12) + b"\xff" * 12, len(rec.MAGIC))


def _huge_shape(fd: int) -> None:
    head = job_channel_pb2.RecordedTrial(trial=0)
    v = head.values.add(dtype="float32", offset=1 << 40, nbytes=4 << 40)
    v.shape.extend([1 << 20, 1 << 20])
    data = head.SerializeToString()
    os.ftruncate(fd, len(rec.MAGIC))
    os.pwrite(fd, struct.pack(">I", len(data)) + data, len(rec.MAGIC))


def _nothing(fd: int) -> None:
    os.ftruncate(fd, len(rec.MAGIC))


@pytest.mark.parametrize("tamper", [_truncate, _garbage_header, _huge_shape, _nothing])
def test_a_tampered_record_is_a_runtime_error(
    engine_dir: Path, tamper: Callable[[int], None]
) -> None:
    _, final = judged(engine_dir, job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL)), tamper)
    assert final is not None
    assert final.result.verdict == V.VERDICT_RUNTIME_ERROR, final.result
    assert final.result.error.message.startswith("tampering: ")
    assert final.result.failed_side == V.SIDE_KERNEL


def test_outputs_over_the_limit_are_judged_in_the_kernels_process(engine_dir: Path) -> None:
    """Both the kernel's and the reference's outputs are over the record's limit: the kernel's
    process judged itself (as before), and the result says so."""
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL))
    own, final = judged(engine_dir, spec, limit=rec.MAX_HEADER + 64)
    assert own.result.HasField("reference_runtime")  # it judged and timed both itself
    assert final is not None and final.result.verdict == V.VERDICT_OK
    assert any("judged in the kernel's own process" in n for n in final.result.notes)


def test_a_false_claim_of_outputs_over_the_limit_is_tampering(engine_dir: Path) -> None:
    def over(fd: int) -> None:
        os.ftruncate(fd, len(rec.MAGIC))
        head = job_channel_pb2.RecordedTrial(trial=0, over_limit=True, bytes=1 << 40)
        data = head.SerializeToString()
        os.pwrite(fd, struct.pack(">I", len(data)) + data, len(rec.MAGIC))

    _, final = judged(engine_dir, job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL)), over)
    assert final is not None and final.result.verdict == V.VERDICT_RUNTIME_ERROR
    assert "recorded none of its outputs" in final.result.error.message


def test_replayed_outputs_in_the_timed_trials_are_caught_by_the_judge(engine_dir: Path) -> None:
    """The timed trial on fresh inputs: the kernel hands back its first result every call
    after the correctness trials; its own process's replay check is forged to pass."""
    cand = FORGED_COMPARE.replace(
        "        return torch.zeros_like(a)",
        "        self.n = getattr(self, 'n', 0) + 1\n"
        "        if self.n <= 5:\n"
        "            return a + b\n"
        "        self.keep = getattr(self, 'keep', None)\n"
        "        if self.keep is None:\n"
        "            self.keep = a + b\n"
        "        return self.keep",
    )
    _, final = judged(
        engine_dir, job(source(TORCH, cand), source(TORCH, ADD_MODEL), perf_trial_count=20)
    )
    assert final is not None and final.result.verdict == V.VERDICT_INCORRECT, final.result
    assert any(f.rule_id == "replayed_outputs" for f in final.result.flags)


def test_outputs_over_the_limit_never_reach_the_host(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sized where they are: an output over the limit is not copied for the record."""
    copied: list[int] = []
    host_value = rec._host_value
    monkeypatch.setattr(rec, "_host_value", lambda v: copied.append(1) or host_value(v))
    fd = os.memfd_create("record")
    r = Recorder(fd, rec.MAX_HEADER + 1024)
    assert not r.record(0, [torch.zeros(1 << 16)])
    assert r.full and copied == []
    os.close(fd)


def test_a_full_record_needs_no_replay_trial(engine_dir: Path) -> None:
    """Room for the first trial only: the rest, the replay trial among them, was checked in
    the kernel's process (as its notes say), which is no tampering."""
    spec = job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL), perf_trial_count=10)
    own, final = judged(engine_dir, spec, limit=rec.MAX_HEADER * 2 + 4096)
    assert final is not None and final.result.verdict == V.VERDICT_OK, final.result
    assert any("of 5 correctness trials judged outside" in n for n in final.result.notes)
    # The reference is timed here all the same (its process's time is not believed).
    assert final.result.reference_runtime.median_ms > 0 and final.result.speedup > 0


def test_a_false_claim_that_a_later_trial_is_over_the_limit_is_tampering(
    engine_dir: Path,
) -> None:
    """Right on trial 1, then "no room" for the rest, where there was room: the judge would see
    only what the kernel chose to show."""

    def cut_after_first(fd: int) -> None:
        first = rec.read(fd)[1]  # where the second trial's header starts
        os.ftruncate(fd, first.at)
        head = job_channel_pb2.RecordedTrial(trial=1, over_limit=True, bytes=1 << 40)
        data = head.SerializeToString()
        os.pwrite(fd, struct.pack(">I", len(data)) + data, first.at)

    _, final = judged(
        engine_dir, job(source(TORCH, ADD_NEW), source(TORCH, ADD_MODEL)), cut_after_first
    )
    assert final is not None and final.result.verdict == V.VERDICT_RUNTIME_ERROR, final.result
    assert "over the record's limit, where the reference's outputs fit" in (
        final.result.error.message
    )


# A reference whose module body would mark the process it runs in: a launch process with the
# reference judged elsewhere never imports it.
MARKING_MODEL = """
import builtins
import torch
builtins._ke_reference_imported_here = True
class Model(torch.nn.Module):
    def forward(self, x, y):
        return x + y
"""


def _launched_alone(
    engine_dir: Path, kernel_code: str, perf: int = 3
) -> tuple[Outcome, Outcome, int]:
    """A Triton kernel from its IOContract run as a launch process runs it with its reference
    judged elsewhere (EngineConfig.reference_judged), then judged: (the launch's outcome, the
    judge's, the trials recorded)."""
    spec = job(
        source(TRITON, kernel_code, add_args(), grid=(4, 1, 1)),
        source(TORCH, MARKING_MODEL),
        perf_trial_count=perf,
    )
    fd = os.memfd_create("record")
    try:
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT), reference_judged=True)
        own = run_job(spec, RecordingReporter(), cfg)
        assert not hasattr(builtins, "_ke_reference_imported_here")
        recorded = len(rec.read(fd))
        final = judge_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT,
            kernel_gone=True,
        )  # fmt: skip
        return own, final, recorded
    finally:
        os.close(fd)
        if hasattr(builtins, "_ke_reference_imported_here"):
            del builtins._ke_reference_imported_here


def test_a_launch_with_its_reference_judged_elsewhere_never_imports_it(engine_dir: Path) -> None:
    """Issue 12: a Triton kernel from its IOContract against an eager reference, launched as a
    launch process launches it: the reference is never imported there, every correctness
    trial and the timed one on fresh inputs are recorded, and the judge, which ran the
    reference, gives the verdict and the reference's time."""
    own, final, recorded = _launched_alone(engine_dir, TRITON_ADD)
    assert own.result.verdict == V.VERDICT_OK, own.result
    assert own.result.correctness_status == V.CORRECTNESS_UNSPECIFIED  # not its to say
    assert recorded == 5 + 1  # the correctness trials and the replayed timed trial
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness, r
    assert r.validation.trials_passed == 5 and r.reference_runtime.median_ms > 0


def test_a_wrong_launch_with_its_reference_judged_elsewhere_is_incorrect(
    engine_dir: Path,
) -> None:
    wrong = TRITON_ADD.replace("+ tl.load(y_ptr", "- tl.load(y_ptr")
    own, final, _ = _launched_alone(engine_dir, wrong)
    assert own.result.verdict == V.VERDICT_OK  # nothing was compared where it ran
    assert final.result.verdict == V.VERDICT_INCORRECT, final.result
    assert not final.result.correctness and not final.result.HasField("runtime")


def test_a_launch_that_writes_its_input_ends_incorrect_where_it_ran(engine_dir: Path) -> None:
    """With its reference judged elsewhere, a launch whose outputs are right but which wrote
    an input it declared ARG_ROLE_INPUT ends INCORRECT in its own process (no judge needed)."""
    writes_y = TRITON_ADD.replace(
        "             mask=mask)\n",
        "             mask=mask)\n    tl.store(y_ptr + offs, tl.zeros_like(offs).to(tl.float32),"
        " mask=mask)\n",
    )
    assert writes_y != TRITON_ADD
    spec = job(
        source(TRITON, writes_y, add_args(), grid=(4, 1, 1)), source(TORCH, MARKING_MODEL),
        perf_trial_count=0,
    )  # fmt: skip
    fd = os.memfd_create("record")
    try:
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT), reference_judged=True)
        own = run_job(spec, RecordingReporter(), cfg)
    finally:
        os.close(fd)
        if hasattr(builtins, "_ke_reference_imported_here"):
            del builtins._ke_reference_imported_here
    assert own.result.verdict == V.VERDICT_INCORRECT, own.result
    assert "wrote its input 'y'" in own.result.validation_error
    assert own.result.correctness_status == V.CORRECTNESS_FAILED


COUNTING_MODEL = """
import builtins
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        builtins._ke_reference_runs = getattr(builtins, "_ke_reference_runs", 0) + 1
        return a + b
def get_inputs():
    return [torch.randn(4, 64), torch.randn(4, 64)]
def get_init_inputs():
    return []
"""


def _judged_ahead(
    engine_dir: Path,
    kernel_code: str,
    ends_without: bool = False,
    reference: str = COUNTING_MODEL,
    **options: float,
) -> tuple[Outcome, Outcome, int, int]:
    """A judge started ahead (the front end's JudgeRequest.ahead): judge_job is called before
    the kernel's report exists and gets it from `go`, as the runtime's JudgeGo gives it.
    Returns (the kernel's outcome, the judge's, the reference's runs before `go` was
    called, and in all). `ends_without`: the job ends without a report (go gives None)."""
    spec = job(source(TORCH, kernel_code), source(TORCH, reference), **options)
    fd = os.memfd_create("record")
    runs_before_go: list[int] = []
    clean = compare.compare_outputs
    try:
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT))
        own = run_job(spec, RecordingReporter(), cfg)
        compare.compare_outputs = clean  # what the kernel's code patched: another process
        builtins._ke_reference_runs = 0  # type: ignore[attr-defined]

        def go() -> tuple[V.EvalResult, bool, None, bool, bool] | None:
            runs_before_go.append(builtins._ke_reference_runs)  # type: ignore[attr-defined]
            return None if ends_without else (own.result, True, None, False, False)

        reporter = RecordingReporter()
        final = judge_job(
            spec, reporter, EngineConfig(work_dir=engine_dir), V.EvalResult(), fd, LIMIT, go=go
        )
        assert V.PHASE_VALIDATING in reporter.phases()
        return own, final, runs_before_go[0], builtins._ke_reference_runs  # type: ignore[attr-defined]
    finally:
        compare.compare_outputs = clean
        os.close(fd)
        if hasattr(builtins, "_ke_reference_runs"):
            del builtins._ke_reference_runs


def test_a_judge_started_ahead_runs_the_reference_before_the_kernels_report_is_in(
    engine_dir: Path,
) -> None:
    """Judge ahead: every correctness trial's reference run, and the float64 one of the
    lower-precision check, happen before `go` (while the kernel's process would still run),
    none after but the reference's timing, and the verdict is the same as a judge started
    after: OK for an honest kernel, with the kernel's time and the judge's own time of the
    reference."""
    own, final, before, runs = _judged_ahead(engine_dir, ADD_NEW, perf_trial_count=0)
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness, r
    assert before == runs == 5 + 1 and r.validation.trials_passed == 5  # none after
    assert not any("lower-precision check skipped" in n for n in r.notes), r.notes

    own, final, before, runs = _judged_ahead(engine_dir, ADD_NEW)  # timed: the reference too
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness, r
    assert before == 5 + 1 < runs
    assert r.runtime == own.result.runtime and r.reference_runtime.median_ms > 0


def test_a_judge_started_ahead_finds_a_forged_comparison_incorrect(engine_dir: Path) -> None:
    own, final, before, _runs = _judged_ahead(engine_dir, FORGED_COMPARE)
    assert own.result.verdict == V.VERDICT_OK  # its own process believed the forgery
    assert before == 5 + 1
    r = final.result
    assert r.verdict == V.VERDICT_INCORRECT and not r.correctness, r
    assert not r.HasField("runtime")


def test_a_judge_started_ahead_leaves_a_job_that_ended_without_its_report(
    engine_dir: Path,
) -> None:
    """The job ended before its kernel's outputs were in (a wrong kernel, a cancel, a
    timeout): the judge says nothing of it, raises nothing, and keeps nothing."""
    _own, final, before, runs = _judged_ahead(engine_dir, ADD_NEW, ends_without=True)
    r = final.result
    assert before == runs == 5 + 1
    assert r.verdict == V.VERDICT_UNSPECIFIED and not r.correctness and not r.HasField("error")
    assert any("not judged" in n for n in r.notes), r.notes


def test_a_judge_started_ahead_flags_a_kernel_in_lower_precision(engine_dir: Path) -> None:
    """The lower-precision check's float64 run is made ahead too: a float32 matmul computed
    in float16 still passes (advisory) and is flagged, as by a judge started after."""
    from kerneleval_server.engine import integrity
    from test_precision import KB_TOL, MATMUL, candidate

    body = "torch.matmul(a.half(), b.half()).float()"
    counting = MATMUL.replace(
        "        return torch.matmul(a, b)",
        "        import builtins\n"
        "        builtins._ke_reference_runs = getattr(builtins, '_ke_reference_runs', 0) + 1\n"
        "        return torch.matmul(a, b)",
    )
    assert counting != MATMUL
    _own, final, before, _runs = _judged_ahead(
        engine_dir, candidate(body), reference=counting, **KB_TOL
    )
    assert before == 5 + 1  # the float64 run among them
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness, r
    assert [f.rule_id for f in r.flags] == [integrity.LOWER_PRECISION], list(r.notes)


def test_a_standing_judge_prepares_a_next_job_with_the_same_inputs_from_the_last(
    engine_dir: Path,
) -> None:
    """A standing judge keeps what it prepared ahead (the inputs, the reference's outputs
    on them, its float64 run): the next job with the same reference, IOContract and options
    runs the reference nothing ahead and is judged as the first was (a forgery still
    INCORRECT); a job with another seed prepares afresh."""
    from kerneleval_server.engine import judge as judge_mod

    own, first, before, _ = _judged_ahead(engine_dir, ADD_NEW)
    assert first.result.verdict == V.VERDICT_OK and before == 5 + 1
    assert judge_mod._kept is not None
    _own, again, before, _ = _judged_ahead(engine_dir, ADD_NEW)
    assert before == 0  # nothing ran ahead: its last job's preparation
    assert again.result.verdict == V.VERDICT_OK and again.result.correctness
    assert again.result.validation.max_abs_error == first.result.validation.max_abs_error
    _own, forged, before, _ = _judged_ahead(engine_dir, FORGED_COMPARE)
    assert before == 0 and forged.result.verdict == V.VERDICT_INCORRECT, forged.result
    _own, other, before, _ = _judged_ahead(engine_dir, ADD_NEW, seed=7)
    assert before == 5 + 1 and other.result.verdict == V.VERDICT_OK


def test_a_recorded_output_stays_where_its_judge_compares_it() -> None:
    """A judge's recorded outputs of at most HOST_COMPARE_MAX elements stay on the host (the
    comparison and the precision check run there: no copy to the device and back); larger
    ones go to the job's device (here `meta`, which any host tensor can go to)."""
    from kerneleval_server.engine import record
    from kerneleval_server.engine.job_correctness import RecordedProgram, where_compared

    device = torch.device("meta")
    small = torch.ones(compare.HOST_COMPARE_MAX)
    large = torch.ones(compare.HOST_COMPARE_MAX + 1)
    assert where_compared(small, device).device.type == "cpu"
    assert where_compared(large, device).device.type == "meta"
    assert where_compared(3.5, device) == 3.5
    trial = record.Trial(0, False, False, 0, [small, large, None], 0, "")
    out = RecordedProgram([trial], device, launch=False).run(None)  # type: ignore[arg-type]
    assert [getattr(v, "device", None) for v in out] == [small.device, device, None]


# A reference that counts its runs in this (pytest's) process: the kernel's and the judge's
# engine calls share it here, as they do not in the service.
COUNTED_REF = ADD_MODEL.replace(
    "        return a + b",
    "        import builtins\n"
    "        builtins.KE_REF_RUNS = getattr(builtins, 'KE_REF_RUNS', 0) + 1\n"
    "        return a + b",
)


def _ref_runs() -> int:
    return int(getattr(builtins, "KE_REF_RUNS", 0))


def test_untimed_the_kernels_process_leaves_the_comparison_to_its_judge(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """perf_trial_count 0: the kernel's process records its outputs and neither runs the
    reference nor compares (the judge does both); a wrong kernel is the judge's INCORRECT.
    Timed, it compares first: an incorrect kernel is not timed."""
    monkeypatch.setattr(builtins, "KE_REF_RUNS", 0, raising=False)
    fd = os.memfd_create("record")
    try:
        spec = job(source(TORCH, ADD_NEW), source(TORCH, COUNTED_REF), perf_trial_count=0)
        cfg = EngineConfig(work_dir=engine_dir, recorder=Recorder(fd, LIMIT))
        own = run_job(spec, RecordingReporter(), cfg)
        assert own.result.verdict == V.VERDICT_OK, own.result
        assert _ref_runs() == 0
        assert own.result.correctness_status == V.CORRECTNESS_NOT_CHECKED  # here, that is
        assert own.result.validation.trial_count == 0
        final = judge_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT
        )
        assert final.result.verdict == V.VERDICT_OK and final.result.correctness, final.result
        assert final.result.validation.trials_passed == 5
        assert _ref_runs() >= 5  # its trials (and its float64 run for the precision check)
    finally:
        os.close(fd)

    wrong = ADD_NEW.replace("a + b", "a - b")
    own, final = judged(engine_dir, job(source(TORCH, wrong), source(TORCH, COUNTED_REF),
                                        perf_trial_count=0))  # fmt: skip
    assert own.result.verdict == V.VERDICT_OK  # nothing compared there
    assert final is not None and final.result.verdict == V.VERDICT_INCORRECT, final.result

    monkeypatch.setattr(builtins, "KE_REF_RUNS", 0)
    own, final = judged(engine_dir, job(source(TORCH, wrong), source(TORCH, COUNTED_REF)))
    assert own.result.verdict == V.VERDICT_INCORRECT and final is None  # compared, not timed
    assert _ref_runs() > 0 and not own.result.HasField("runtime")


def test_timed_by_its_judge_the_kernels_process_leaves_the_comparison_to_it(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timed by its judge, the kernel's process runs no reference either (its tensors took a
    third of a GB problem's process): the judge compares before it drives any timed call,
    so a wrong kernel is INCORRECT with no time (its process served nothing), and an honest
    one is judged and timed."""
    monkeypatch.setattr(builtins, "KE_REF_RUNS", 0, raising=False)
    wrong = ADD_NEW.replace("a + b", "a - b")
    spec = job(source(TORCH, wrong), source(TORCH, COUNTED_REF), perf_trial_count=3)
    fd = os.memfd_create("record")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        recorder = Recorder(fd, LIMIT, theirs.fileno(), LIMIT)
        cfg = EngineConfig(work_dir=engine_dir, recorder=recorder, timed_by_judge=True)
        own = run_job(spec, RecordingReporter(), cfg)
        assert own.result.verdict == V.VERDICT_OK and own.serve is not None, own.result
        assert _ref_runs() == 0 and own.result.validation.trial_count == 0
        final = judge_job(
            spec, RecordingReporter(), EngineConfig(work_dir=engine_dir), own.result, fd, LIMIT,
            share_fd=mine.fileno(), share_max_bytes=LIMIT, kernel_serves=True,
        )  # fmt: skip
        assert final.result.verdict == V.VERDICT_INCORRECT, final.result
        assert not final.result.HasField("runtime") and _ref_runs() > 0
    finally:
        os.close(fd)
        mine.close()
        theirs.close()
    monkeypatch.setattr(builtins, "KE_REF_RUNS", 0)
    honest = served_judge(engine_dir, job(source(TORCH, ADD_NEW), source(TORCH, COUNTED_REF),
                                          perf_trial_count=3), RecordingReporter())  # fmt: skip
    assert honest.result.verdict == V.VERDICT_OK and honest.result.runtime.timed_from_outside
    assert _ref_runs() > 0  # in its judge


# Correct, but computed into its input and handed back: the input itself.
IN_PLACE_NEW = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a.add_(b)
"""


def test_the_judge_flags_an_output_its_kernels_process_saw_alias_an_input(
    engine_dir: Path,
) -> None:
    """Untimed, the kernel's process says in the record which outputs share memory with an
    input; the judge flags them (output_aliases_input) unless its reference's do so too."""
    own, final = judged(engine_dir, job(source(TORCH, IN_PLACE_NEW), source(TORCH, ADD_MODEL),
                                        perf_trial_count=0))  # fmt: skip
    assert not own.result.flags  # not the untrusted process's call
    assert final is not None and final.result.verdict == V.VERDICT_OK, final.result
    assert [f.rule_id for f in final.result.flags] == ["output_aliases_input"]
    assert "output 0 shares memory with an input" in final.result.flags[0].message
    assert any("modified its input tensors in place" in n for n in final.result.notes)

    view_ref = ADD_MODEL.replace("return a + b", "return a.view(-1)")
    view_new = IN_PLACE_NEW.replace("return a.add_(b)", "return a.view(-1)")
    own, final = judged(engine_dir, job(source(TORCH, view_new), source(TORCH, view_ref),
                                        perf_trial_count=0))  # fmt: skip
    assert final is not None and final.result.verdict == V.VERDICT_OK, final.result
    assert not final.result.flags  # the reference hands back a view of its input too


def test_a_record_keeps_what_its_writer_said_of_aliasing() -> None:
    fd = os.memfd_create("record")
    try:
        r = Recorder(fd, LIMIT)
        assert r.record(0, [torch.zeros(4), torch.ones(2)], aliased={1, 7})  # 7: no such output
        assert r.record(1, [torch.zeros(4)])
        trials = rec.read(fd)
        assert [t.aliased for t in trials] == [frozenset({1}), frozenset()]
    finally:
        os.close(fd)
