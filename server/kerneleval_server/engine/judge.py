"""judge_job: a compared job's verdict, given in a process the kernel's code never ran in.

The kernel's own process ran it (run_job with a Recorder) and recorded its outputs of every
correctness trial and of the timed trial run on fresh inputs, in the record or, past its
limit, by descriptor on the record's socket (device_share.py). Here only the reference is
imported: it makes the same inputs from the seed, runs, and the engine's comparison, the
lower-precision check, the replay check and the reference's timing run on what was recorded.
The kernel's process can report its verdict, notes and time as it likes; from here only its
own flags are kept. Its time is this process's to take: with `kernel_serves`, the kernel's
process waits on the record's socket, and the judge drives each timed call there and bounds it
with its own clock (timed_calls.py); the reference is timed here through the same steps
(docs/TRUST.md "The judge", "Times from outside"). With EvalOptions.compile_baseline the
reference's Model is also compiled with torch.compile (before the timing window: its compile
time is outside it) and timed through the same steps, on the same inputs, as the eager one.
"""

from __future__ import annotations

import hashlib
import math
import random
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from kerneleval.v1 import job_pb2, kernel_pb2

from . import (
    compare,
    device_share,
    errors,
    gpumode_judge,
    integrity,
    loader,
    precision,
    record,
    tamper,
    time_bound,
    timed_calls,
    timing,
)
from .backends import Program
from .inputs import TrialArgs
from .job_correctness import RecordedProgram, where_compared
from .runner import Job as _Job
from .runner import preserved_torch_state
from .stops import REFERENCE_PREFIX, stopped_by_a_source, unexpected_error
from .stops import Abandoned as _Abandoned
from .stops import SafeReporter as _SafeReporter
from .stops import Stop as _Stop
from .types import EngineConfig, Outcome, PathMeasure, Reporter

MakeArgs = Callable[[int], TrialArgs]
SIDE_UNSPECIFIED = job_pb2.SIDE_UNSPECIFIED
# What the kernel's process sent at last, to a judge started ahead: its report, whether it
# has exited, and the reference's time from an earlier job with its age (or None). None: the
# job ended without it.
GivenTime = tuple[job_pb2.RuntimeStats, float]
# (the report, its process gone, the reference's given time, its process serves timed calls,
# it was given them to serve)
Go = Callable[[], "tuple[job_pb2.EvalResult, bool, GivenTime | None, bool, bool] | None"]
# A judge started ahead keeps the trials' inputs and the reference's outputs up to this many
# bytes; the trials past it run once the kernel's outputs are in, as without one.
AHEAD_MAX_BYTES = 256 << 20
# What a standing judge prepared ahead for its last job (the trials' inputs, the reference's
# outputs on them and its float64 run), kept up to this many bytes for its next job whose
# reference runs on the same inputs: the same reference code (all its jobs have it, byte for
# byte: jobs/judging.py reference_key), the same IOContract and options. Only this process's
# own results: no kernel runs in a judge. (H100, a tiny problem: the inputs, the reference's
# run and its float64 run took 2.1 ms of the 4.3 a judge took to prepare, after the kernel's
# 3.7: the verdict waited for the judge; bench/probe/timeline_probe.py.)
KEPT_MAX_BYTES = 64 << 20
_kept: tuple[bytes, dict[int, Any], Any] | None = None  # (inputs key, ahead, float64 run)
# The judge's own measures of a timed call's path (timed_calls.own_path_ns), each taken in a
# window with every other job process of the GPU frozen, by (device, lead, output sizes): what
# they measure is this process's and the GPU's, not a kernel's, so they serve all its jobs (the
# median of the last few).
_own_paths: dict[tuple[str, str, tuple[int, ...]], list[int]] = {}
OWN_PATH_MEASURES = 9  # the last ones kept, by key

# What the kernel's process says of itself and the judge says again.
JUDGED_FIELDS = (
    "verdict", "correctness", "correctness_status", "validation", "validation_error",
    "failed_side", "error", "speedup", "speedup_suspicious", "reference_runtime",
    "reference_runtime_age", "compiled_reference_runtime", "compiled_speedup", "compile_time",
)  # fmt: skip


def judge_job(
    spec: kernel_pb2.JobSpec,
    reporter: Reporter,
    config: EngineConfig,
    candidate: job_pb2.EvalResult,
    record_fd: int,
    record_max_bytes: int,
    share_fd: int = -1,
    share_max_bytes: int = 0,
    kernel_gone: bool = False,
    reference_time: tuple[job_pb2.RuntimeStats, float] | None = None,
    go: Go | None = None,
    kernel_serves: bool = False,
    kernel_must_serve: bool = False,
    path_measures: Sequence[PathMeasure] = (),
) -> Outcome:
    """The job's final result: `candidate` (the kernel's process's report, verdict OK) with
    every verdict replaced by this process's. Never raises for what either source does.
    `share_fd`: the record's socket (its outputs past the record, by descriptor), read only
    when `kernel_gone` (the front end says the kernel's process has exited).
    `reference_time`: the reference's time from an earlier job, and its age in seconds (the
    front end's --reference-time-reuse-s): given instead of timing the reference again.
    `go`: judge ahead (the kernel's process runs meanwhile): the reference runs on the
    trials' inputs first, then `go()` waits for the kernel's report (`candidate`, `kernel_gone`
    and `reference_time` are its), after which nothing differs.
    `kernel_serves`: the kernel's process serves its timed calls (it said so);
    `kernel_must_serve`: it was given them to serve (JudgeRequest.kernel_timed_by_judge).
    `path_measures`: earlier judges' measures of their own path on this GPU for this
    reference (the front end keeps them: JudgeRequest.path_measures); with those that fit,
    this judge takes none (Outcome.path_measures: those it took)."""
    job = _Judge(spec, _SafeReporter(reporter), config)
    job.start_from(candidate)
    job.record_max = record_max_bytes
    job.share_fd, job.share_max, job.kernel_gone = share_fd, share_max_bytes, kernel_gone
    job.reference_time = reference_time
    job.go = go
    job.kernel_serves = kernel_serves
    job.kernel_must_serve = kernel_must_serve
    job.share_room = 0
    job.validating = False
    job.given_paths = list(path_measures)
    job.taken_paths = []
    timed_calls.reset_made()
    try:
        with preserved_torch_state(), loader.forgetting_modules():
            job.judge(candidate, record_fd)
    except _Abandoned:
        pass
    except _Stop as e:
        if not job.result.verdict:  # only the reference's code stops without one
            stopped_by_a_source(job.result, e, job.files_of)
    except Exception as e:  # the reference's object, the memory, or a bug here
        unexpected_error(job.result, e, job.files_of)
    if job.opts.compile_baseline:
        _forget_compiled()
    if job.result.verdict != job_pb2.VERDICT_OK:
        job.result.ClearField("runtime")  # a time is only given with a verdict of OK
    job.result.notes.extend(n for n in job.notes if n not in job.result.notes)  # once each
    return Outcome(
        result=job.result, context_poisoned=job.poisoned, path_measures=job.taken_paths,
        outside_allocator_bytes=timed_calls.made_peak_bytes(),
    )  # fmt: skip


def _inputs_key(spec: kernel_pb2.JobSpec) -> bytes:
    """What fixes the reference's inputs and outputs of a job: its reference (source and
    I/O), the kernel's IOContract (the inputs come from it when it has one) and the options
    (the seed, the trials, the lower-precision check)."""
    h = hashlib.sha256()
    for part in (spec.reference, spec.kernel.io, spec.options):
        h.update(part.SerializeToString(deterministic=True))
        h.update(b"\0")
    return h.digest()


def forget_kept() -> None:
    """Drops what the last job prepared ahead and the measures of its own path (the tests:
    each starts as a fresh judge)."""
    global _kept
    _kept = None
    _own_paths.clear()


def _timed_trial() -> int:
    """A trial number for a timed call's inputs, past the correctness trials' and drawn from
    the OS's randomness: the kernel cannot have its outputs ready."""
    return secrets.randbelow(1 << 40) + (1 << 20)


class _Judge(_Job):
    # Set by judge_job (instance attributes only: tamper.check_timers refuses any that hides
    # one of the class's).
    record_max: int
    share_fd: int
    share_max: int
    kernel_gone: bool
    share_room: int  # what the shares' limit had left after what was handed over
    validating: bool  # the gated phase was asked for (the shares' copies needed it)
    reference_time: tuple[job_pb2.RuntimeStats, float] | None  # an earlier job's, its age
    go: Go | None  # started ahead: waits for the kernel's report
    kernel_serves: bool  # the kernel's process waits for its timed calls (timed_calls.py)
    given_paths: list[PathMeasure]  # earlier judges' measures of their path (the front end's)
    taken_paths: list[PathMeasure]  # this job's own
    kernel_must_serve: bool  # it was given them to serve (the front end's assignment)
    spent: _Stopwatch  # where its timed phase's time went (said in the result's notes)

    def start_from(self, candidate: job_pb2.EvalResult) -> None:
        self.result.CopyFrom(candidate)
        for name in JUDGED_FIELDS:
            self.result.ClearField(name)

    def judge(self, candidate: job_pb2.EvalResult, fd: int) -> None:
        self.reporter.phase(job_pb2.PHASE_COMPILING)
        ctx = self._context()
        if self.spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE:
            if self.go is not None:  # the front end starts none ahead: nothing to prepare
                candidate = self._await_go()
            if self.opts.compile_baseline:
                self.notes.append(
                    "compile_baseline: a GPU MODE task's reference is no Model: "
                    "no torch.compile baseline"
                )
            gpumode_judge.judge(self, ctx, lambda: self._read(fd), self._fitted)
            return
        ref = self._build(self.spec.reference, "reference", ctx)
        self.notes.extend(ctx.notes)
        self.source_files = tuple(ctx.source_files)
        launch = len(self.spec.kernel.io.args) > 0 and self.spec.kernel.type in (
            kernel_pb2.KERNEL_TYPE_TRITON,
            kernel_pb2.KERNEL_TYPE_CUDA,
        )
        if self.go is not None:
            candidate = self._prepare_ahead(RecordedProgram([], self.dev, launch), ref, ctx)
        trials = self._read(fd)
        # At most the trials the options ask for: a record of thousands would hold the GPU.
        checked = [t for t in trials if not t.replay and not t.over_limit]
        checked = checked[: self.opts.correct_trials]
        replay = next((t for t in trials if t.replay and not t.over_limit), None)
        over = next((t for t in trials if t.over_limit), None)
        cand = RecordedProgram(checked, self.dev, launch)
        make_args = self._input_source(cand, ref)
        if self.go is None:  # ahead, it ran before
            self._preflight_triton(cand, ref, make_args, ctx)
        if not self.validating:
            self.reporter.phase(job_pb2.PHASE_VALIDATING)
        if not checked:
            self._nothing_recorded(candidate, ref, make_args, over)
            return
        self._validate(cand, ref, make_args)  # INCORRECT ends it here
        if over is not None:
            self._check_over_claim(over, len(checked), ref, make_args)
        wanted = self.opts.correct_trials
        if len(checked) < wanted:
            self.notes.append(
                f"{len(checked)} of {wanted} correctness trials judged outside the kernel's "
                f"process (its outputs are over {self._limits()}); the rest only in it"
            )
        # A correctness trial over the record's limits is the one reason not to serve: a
        # replay trial over them is recorded only by a process that timed itself already.
        if not any(t.over_limit and not t.replay for t in trials):
            self._refuse_self_timed(candidate)
        if self.kernel_serves and self.opts.perf_trials > 0:
            base = _timed_trial()  # trials the kernel cannot foresee
            # torch.compile's baseline compiles here, before the timing window is asked for.
            compiled = self._compile_reference(ref, make_args(base))
            # The reference first, in a window with the kernel's process frozen (nothing it
            # leaves running can slow it); then the kernel's calls, that process running.
            self.spent = _Stopwatch()
            first = make_args(base)
            ref_out = self._run(ref, first.clone(), REFERENCE_PREFIX)  # the first call's check
            flush = timed_calls.L2Flush(self.dev, self.opts.flush_l2)
            outs = [o for o in ref_out if isinstance(o, torch.Tensor)]
            sizes = tuple(o.numel() * o.element_size() for o in outs)
            path_key = (str(self.dev), flush.lead_kind, sizes)
            measures = _own_paths.setdefault(path_key, [])
            given = [m.ns for m in self.given_paths if (m.lead, m.output_bytes) == path_key[1:]]
            if given:  # the front end's are every judge's of the reference here, this one's too
                measures[:] = given[-OWN_PATH_MEASURES:]
            self.spent.lap("reference")
            reference, compiled_times = self._reference_calls(
                ref, make_args, base, compiled, measure_path=not measures
            )
            self.spent.lap("reference")
            if not measures or self.reference_time is None or compiled is not None:
                # The cap on the path's cost, measured in the reference's window: the kernel's
                # process is frozen (running, it could take the cores or the GPU while it is
                # measured). A standing judge keeps its measures for its later jobs, whose
                # reference times may be reused (no window of their own for it), and takes
                # their median: one taken while the host was busy (builds, another service)
                # does not stand for the rest of its life.
                measures.append(timed_calls.own_path_ns(self.dev, outs, flush.lead))
                del measures[:-OWN_PATH_MEASURES]
                self.taken_paths.append(PathMeasure(flush.lead_kind, sizes, measures[-1]))
                self.spent.lap("calibration")
            own_path = int(statistics.median(measures))
            del outs  # only the outputs' shapes from here (_time_kernel_outside)
            self._time_kernel_outside(
                cand, ref, first, ref_out, flush, own_path, make_args, self.spent
            )
            self._time_reference(self.result, ref, make_args, reference, compiled_times)
        elif candidate.HasField("runtime") and candidate.runtime.median_ms > 0:
            if over is None:  # with a full record it was checked in the kernel's process
                self._check_replay(cand, ref, make_args, replay)
            compiled = self._compile_reference(ref, make_args(0))
            self._time_reference(candidate, ref, make_args, compiled=compiled)
        self.result.verdict = job_pb2.VERDICT_OK

    def _time_kernel_outside(
        self, cand: RecordedProgram, ref: Program, first: TrialArgs, ref_out: list[Any],
        flush: timed_calls.L2Flush, own_path: int, make_args: MakeArgs, spent: _Stopwatch,
    ) -> None:  # fmt: skip
        """The kernel's timed calls, driven in its process from here (timed_calls.py): each
        on inputs made here from trial numbers it cannot foresee, written into the shared
        arguments after the last call was answered; a share of them, picked at random,
        checked against the reference on the same inputs; its time its own claim only where
        that agrees with this process's clock, else that clock's bound (flagged).
        `ref_out` is emptied: only its shapes are needed, and a GB problem's judge held each
        of its tensors several times over (H200: 61 GB at the median for 6.4 GB tensors)."""
        self.reporter.drive_kernel()
        spent.lap("waiting for the window")
        n = self.opts.perf_trials
        names = self._output_names(cand, ref, first)
        checked = min(n, max(timed_calls.CHECKED_MIN, n // 4))
        picked = set(random.SystemRandom().sample(range(n), checked))
        inside: list[int] = []
        outside: list[int] = []
        try:
            likes = [timed_calls.shape_of(_like(o)) for o in ref_out]
            ref_out.clear()
            driver = timed_calls.Driver(
                self.share_fd, first, likes, self.dev, prepare=flush.enqueue,
                lead=flush.lead_kind,
            )  # fmt: skip
        except timed_calls.TimedCallError as e:
            self._kernel_failed_timed(str(e))
        spent.lap("buffers")
        try:
            calibration = time_bound.calibrate(driver, first)
            spent.lap("calibration")
            timed_calls.warm_up(lambda: driver.call(first).outside_ns / 1e6, self.opts.warmup)
            spent.lap("warmup")
            for i in range(n):
                # Each call's trial drawn on its own: a call's inputs (and the seed it runs
                # under, which says its trial) tell nothing of the next call's, whose outputs
                # could otherwise be made ahead between calls, untimed.
                args = make_args(_timed_trial())
                spent.lap("inputs")
                call = driver.call(args)
                # Its inputs are this process's own (the call had copies of them), so the
                # check needs no copy made before the go: one would make a checked call's
                # go come later, and tell the kernel which calls are checked.
                pristine = args if i in picked else None
                inside.append(call.inside_ns)
                outside.append(call.outside_ns)
                spent.lap("calls")
                if pristine is not None:
                    first_checked = i == min(picked)
                    self._check_timed_call(i, call.outputs, ref, pristine, names, first_checked)
                    spent.lap("checks")
                del args, pristine  # before the next call's are made, not after
                self._progress(i + 1, n)
        except timed_calls.TimedCallError as e:
            self._kernel_failed_timed(str(e))
        finally:
            driver.close()
        spent.lap("buffers")
        decision = time_bound.decide(
            inside, outside, calibration, cpu=self.dev.type != "cuda", own_path_ns=own_path
        )
        source = (
            job_pb2.TIMING_SOURCE_OUTSIDE_BOUND if decision.flagged
            else job_pb2.TIMING_SOURCE_CUDA_EVENTS if self.dev.type == "cuda"
            else job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK
        )  # fmt: skip
        self.result.runtime.CopyFrom(
            timing.stats(
                decision.times_ms, source, flushed=self.opts.flush_l2 and self.dev.type == "cuda"
            )
        )
        self.result.runtime.timed_from_outside = True
        said = (
            f"timed from outside its process: {n} calls driven by its judge on fresh inputs "
            f"({len(picked)} checked against the reference), the path's own cost "
            f"{decision.calibration_us:.1f} us a call, the kernel's clock within "
            f"{decision.gap_us:.1f} us of the judge's (tolerance {decision.tolerance_us:.1f} us; "
            f"its calls of no work took {decision.calibration_measured_us:.1f} us, the judge's "
            f"own measure of their work {own_path / 1e3:.1f} us); "
            f"the judge's timed phase: {spent}"
        )
        if decision.calibration_capped:
            said += (
                "; its calls of no work took longer than the judge's own measure of their "
                "work allows: taken at that measure"
            )
        if decision.flagged:
            self._flag([decision.flag()])
        self.notes.append(said)

    def _check_timed_call(
        self, i: int, outputs: list[Any], ref: Program, args: TrialArgs, names: list[str],
        precision_too: bool = False,
    ) -> None:  # fmt: skip
        """A timed call's outputs against the reference on its inputs; `precision_too` (the
        first call checked): the lower-precision check as well, as on the first correctness
        trial (a kernel may compute in lower precision only once its check is over)."""
        precision_too = (
            precision_too and ref.kind == "model" and self.opts.check_precision
            and self._float64_fits(ref, args, outputs)
        )  # fmt: skip
        pristine = args.clone() if precision_too else None  # the reference may write them
        ref_start = time.perf_counter()
        ref_out = self._run(ref, args, REFERENCE_PREFIX)
        ref_seconds = time.perf_counter() - ref_start
        got = [where_compared(v, self.dev) for v in outputs]
        check = compare.compare_outputs(got, ref_out, names, self.opts.atol, self.opts.rtol)
        if check.ok and pristine is not None:
            flagged = {f.rule_id for f in self.result.flags}
            if integrity.LOWER_PRECISION not in flagged:
                self._check_timed_precision(ref, pristine, got, ref_out, names, ref_seconds)
        if not check.ok:
            self._replayed_incorrect(
                f"timed call {i + 1}, on new inputs the judge wrote, returned outputs that do "
                f"not match the reference on them ({check.message}): not computed from them "
                "(a cache, a lazy or an unfinished result, or memory read before it was "
                "written, such as torch.empty's)"
            )

    def _float64_fits(self, ref: Program, args: TrialArgs, outputs: list[Any]) -> bool:
        """Whether a float64 run of the reference on these inputs is within the
        lower-precision check's budget (precision.py), so that the inputs' copy it runs on
        is worth making (over it, a GB problem's judge held one more copy for nothing)."""
        instance = getattr(ref, "instance", None)
        if not isinstance(instance, torch.nn.Module):
            return True  # the check says why it is skipped
        need = precision.float64_bytes(instance, args.model_inputs(), outputs)
        return need <= self._float64_budget()

    def _check_timed_precision(
        self, ref: Program, pristine: TrialArgs, got: list[Any], ref_out: list[Any],
        names: list[str], ref_seconds: float,
    ) -> None:  # fmt: skip
        """lower_precision on a timed call's outputs (job_correctness._check_precision on a
        float64 run of these inputs, not the first trial's); never fails the job. A skip
        already said in the check is not said again."""
        try:
            gold = self._float64_run(ref, pristine, ref_out, ref_seconds)
            with torch.no_grad():
                c = precision.judged(gold, got, ref_out, names)
        except Exception as e:  # noqa: BLE001 - a bug here must not cost the job its verdict
            c = precision.Check(note=f"lower-precision check failed: {type(e).__name__}: {e}")
        if c.flag is not None:
            c.flag.message = f"in a timed call: {c.flag.message}"
            self._flag([c.flag])
        if c.note and not any(n.startswith("lower-precision check") for n in self.notes):
            self.notes.append(c.note + " (a timed call's)")

    def _refuse_self_timed(self, candidate: job_pb2.EvalResult) -> None:
        """A kernel's process given its timed calls to serve, whose outputs all fit the
        record (so it had no reason not to), that timed itself instead: it chose the clock
        its time is read from. Its times are not taken: a tampering."""
        if (
            self.kernel_must_serve
            and not self.kernel_serves
            and self.opts.perf_trials > 0
            and candidate.runtime.median_ms > 0
        ):
            self._tampered(
                f"{tamper.PREFIX}the kernel's process was to serve its timed calls to its "
                "judge and timed itself instead: its times are not taken"
            )

    def _kernel_failed_timed(self, why: str) -> NoReturn:
        """The kernel's process failed its timed calls: what it said, or its silence."""
        f = errors.classify(RuntimeError(why))
        if f.verdict == job_pb2.VERDICT_RUNTIME_ERROR:
            f.error.exception_type = "TimedCallFailed"
        self._fail(f, "", job_pb2.SIDE_KERNEL)
        raise _Stop

    def _prepare_ahead(
        self, placeholder: RecordedProgram, ref: Program, ctx: Any
    ) -> job_pb2.EvalResult:
        """Judge ahead: while the kernel's process runs, the reference runs on each
        correctness trial's inputs (kept, up to AHEAD_MAX_BYTES, for _validate), then the
        kernel's report is awaited and returned. The inputs are the reference's or the
        contract's, never the kernel's: nothing here needs its outputs yet."""
        global _kept
        make_args = self._input_source(placeholder, ref)
        self._preflight_triton(placeholder, ref, make_args, ctx)
        self.reporter.phase(job_pb2.PHASE_VALIDATING)
        key = _inputs_key(self.spec)
        if _kept is not None and _kept[0] == key:  # its last job's: nothing to run again
            self.ahead, self.ahead_gold = dict(_kept[1]), _kept[2]
            return self._await_go()
        _kept = None
        kept = 0
        for t in range(self.opts.correct_trials):
            pristine = make_args(t)
            ref_args = pristine.clone()
            began = time.perf_counter()
            ref_out = self._run(ref, ref_args, REFERENCE_PREFIX)
            seconds = time.perf_counter() - began
            self.ahead[t] = (pristine, ref_args, ref_out, seconds)
            if t == 0:
                self._float64_ahead(ref, pristine, ref_out, seconds)
            kept += 2 * compare.nbytes_of(pristine.values) + compare.nbytes_of(ref_out)
            if kept > AHEAD_MAX_BYTES:
                break
        if kept <= KEPT_MAX_BYTES and len(self.ahead) == self.opts.correct_trials:
            _kept = (key, dict(self.ahead), self.ahead_gold)
        return self._await_go()

    def _await_go(self) -> job_pb2.EvalResult:
        """The kernel's report (the front end sends it once its record is sealed); the job
        ends here when it ended without one."""
        assert self.go is not None
        got = self.go()
        if got is None:
            self.ahead.clear()
            self.ahead_gold = None
            self.notes.append("the job ended before its kernel's outputs were in: not judged")
            raise _Abandoned
        candidate, self.kernel_gone, self.reference_time, self.kernel_serves = got[:4]
        self.kernel_must_serve = got[4]
        self.start_from(candidate)
        self.validating = False  # the gated phase is asked for again: its grant was let go
        return candidate

    def _read(self, fd: int) -> list[record.Trial]:
        """The record's trials, with what was handed over by descriptor loaded (the gated
        phase asked first: copying them takes GPU memory). A record no recorder writes is
        tampering."""
        got: list[device_share.Share] = []
        try:
            got = self._received()
            if got:
                self.reporter.phase(job_pb2.PHASE_VALIDATING)
                self.validating = True
            return record.read(fd, self._load(got))
        except (record.RecordError, device_share.ShareError) as e:
            why = f"the kernel's process left a malformed record of its outputs: {e}"
            self._tampered(tamper.PREFIX + why)
        finally:
            device_share.close(got)

    def _fitted(self, at: int, outputs: list[Any]) -> bool:
        """Whether outputs said to be over the limit would have fitted where the record
        stopped (in the file, or in what the shares' limit had left)."""
        return record.fits_after(at, outputs, self.record_max, self.share_room)

    def _received(self) -> list[device_share.Share]:
        """What the kernel's process handed over by descriptor, checked (no GPU work yet);
        read to its end only once that process is gone."""
        if self.share_fd < 0:
            return []
        got = device_share.receive(self.share_fd, self.share_max, until_end=self.kernel_gone)
        # A kernel's process that serves its timed calls is there still: everything it
        # handed over was sent before its outcome, so it is queued.
        if got and not self.kernel_gone and not self.kernel_serves:
            device_share.close(got)
            raise device_share.ShareError(
                "it handed outputs over by descriptor and said it handed over none"
            )
        self.share_room = self.share_max - sum(s.size for s in got)
        return got

    def _load(self, got: list[device_share.Share]) -> dict[int, Any]:
        """Each share's bytes, slot -> a copy on this process's device."""
        loaded: dict[int, Any] = {}
        try:
            for share in got:
                loaded[share.slot] = device_share.load(share, self.dev)
        except torch.OutOfMemoryError as e:  # the GPU is crowded: not the kernel's doing
            self._fail(errors.classify(e), "reading the kernel's outputs: ", SIDE_UNSPECIFIED)
            raise _Stop from None
        return loaded

    def _limits(self) -> str:
        limits = f"the record's limit of {self.record_max} bytes"
        if self.share_fd >= 0:
            limits += f" and the limit of {self.share_max} bytes handed over by descriptor"
        return limits

    def _check_over_claim(
        self, over: record.Trial, index: int, ref: Program, make_args: MakeArgs
    ) -> list[Any]:
        """A trial said to be over the limit: the reference's outputs on its inputs (returned)
        must not have fitted where the record stopped, else the kernel chose what to show."""
        args = make_args(self.opts.correct_trials + 1 if over.replay else index)
        ref_out = self._run(ref, args, REFERENCE_PREFIX)
        if self._fitted(over.at, ref_out):
            which = "the timed trial on fresh inputs" if over.replay else f"trial {index + 1}"
            first = index == 0 and not over.replay
            self._tampered(
                f"{tamper.PREFIX}the kernel's process "
                f"{'recorded none of its outputs: it ' if first else ''}"
                f"called {which} over the record's limit, where the reference's outputs fit"
            )
        return ref_out

    def _nothing_recorded(
        self, candidate: job_pb2.EvalResult, ref: Program, make_args: MakeArgs,
        over: record.Trial | None,
    ) -> None:  # fmt: skip
        """No correctness trial was recorded: fine only when the reference's outputs are over
        the limit too; the kernel's process then judged itself, as it reports."""
        if over is None or over.replay:  # the correctness trials come first
            self._tampered(tamper.PREFIX + "the kernel's process recorded none of its outputs")
        ref_out = self._check_over_claim(over, 0, ref, make_args)
        self.result.CopyFrom(candidate)
        self.notes.append(
            f"judged in the kernel's own process: its outputs "
            f"({record.trial_bytes(ref_out) - record.MAX_HEADER} bytes) are over "
            f"{self._limits()}"
        )

    def _check_replay(
        self, cand: RecordedProgram, ref: Program, make_args: MakeArgs, replay: record.Trial | None
    ) -> None:
        """The timed trial that ran on fresh inputs: its recorded outputs against the
        reference on those inputs (job_timing._ReplayCheck writes them in the kernel's process)."""
        if self.opts.perf_trials < 2:
            return
        if replay is None:
            self._tampered(tamper.PREFIX + "the timed trial on fresh inputs was not recorded")
        fresh = make_args(self.opts.correct_trials + 1)
        ref_out = self._run(ref, fresh.clone(), REFERENCE_PREFIX)
        names = self._output_names(cand, ref, fresh)
        out = [where_compared(v, self.dev) for v in replay.values]
        check = compare.compare_outputs(out, ref_out, names, self.opts.atol, self.opts.rtol)
        if not check.ok:
            why = (
                "a timed trial on new inputs written in place before it did not match the "
                f"reference on them ({check.message}): results computed earlier were handed back"
            )
            self._replayed_incorrect(why)

    def _reference_calls(
        self, ref: Program, make_args: MakeArgs, base: int, compiled: Program | None = None,
        measure_path: bool = False,
    ) -> tuple[job_pb2.RuntimeStats | None, job_pb2.RuntimeStats | None]:  # fmt: skip
        """The reference through the same steps as the kernel's calls, here: its arguments
        written in place, the L2 flushed, the call on an idle GPU, its outputs copied; its
        time the device time around the call (the kernel's claim, where it is taken). Then
        torch.compile's baseline (`compiled`, compiled already) through exactly the same
        steps on the same inputs. (eager, compiled): eager None when an earlier job's time of
        it is given, compiled None when not asked for or it failed (a note). The window is
        asked for even with an earlier job's time of it where `measure_path`: the judge's own
        measure of the path is taken in it next, the kernel's process frozen."""
        reused = self.reference_time is not None and compiled is None
        if reused and not measure_path:
            return None, None
        self.reporter.phase(job_pb2.PHASE_PROFILING)
        self.spent.lap("waiting for the window")
        if reused:
            return None, None
        eager = None
        if self.reference_time is None:
            with self._guard(REFERENCE_PREFIX):
                eager = self._calls(ref, make_args, base, progress=True)
        if compiled is None:
            return eager, None
        try:
            with self._cpu_shim(), torch.no_grad():
                return eager, self._calls(compiled, make_args, base, progress=False)
        except (_Stop, KeyboardInterrupt):
            raise
        except Exception as e:  # torch.compile's code: a note, never the job's failure
            self._baseline_failed("timing", e)
            return eager, None

    def _calls(
        self, prog: Program, make_args: MakeArgs, base: int, progress: bool
    ) -> job_pb2.RuntimeStats:
        """`prog` timed call by call (_reference_calls), on trials base + 1 ... + n."""
        n = self.opts.perf_trials
        args = make_args(base)
        flush = timed_calls.L2Flush(self.dev, self.opts.flush_l2)
        cuda = self.dev.type == "cuda"
        times: list[float] = []

        def warm_up_call() -> float:
            t0 = time.perf_counter()
            prog.run(args)
            if cuda:
                torch.cuda.synchronize(self.dev)
            return (time.perf_counter() - t0) * 1e3

        timed_calls.warm_up(warm_up_call, self.opts.warmup)
        for i in range(n):
            fresh = make_args(base + 1 + i)
            for dst, src in zip(args.values, fresh.values, strict=True):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            if cuda:
                start, end = _timing_event(), _timing_event()
                flush.enqueue()  # after the inputs' write: they are not left in the L2
                torch.cuda.synchronize(self.dev)
                flush.lead()  # as the kernel's server does before its start event
                start.record()
                out = prog.run(args)
                end.record()
                [o.clone() for o in out if isinstance(o, torch.Tensor)]
                torch.cuda.synchronize(self.dev)
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter_ns()
                prog.run(args)
                times.append((time.perf_counter_ns() - t0) / 1e6)
            if progress:
                self._progress(i + 1, n)
        source = job_pb2.TIMING_SOURCE_CUDA_EVENTS if cuda else job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK
        return timing.stats(times, source, flushed=self.opts.flush_l2 and cuda)

    def _time_reference(
        self, candidate: job_pb2.EvalResult, ref: Program, make_args: MakeArgs,
        timed: job_pb2.RuntimeStats | None = None,
        compiled_timed: job_pb2.RuntimeStats | None = None,
        compiled: Program | None = None,
    ) -> None:  # fmt: skip
        """The reference's time and the speedup: `timed` (call by call, as the kernel was),
        else an earlier job's given time, else measured here as the kernel's process timed
        the kernel (timing.measure). torch.compile's baseline likewise: `compiled_timed`, or
        `compiled` measured here the same way as the eager reference, on the same inputs."""
        args: TrialArgs | None = None
        if self.reference_time is not None:
            # No timing window of its own: the GPU times one kernel more in that time.
            stats, age = self.reference_time
            self.result.reference_runtime_age.FromNanoseconds(int(max(age, 0.0) * 1e9))
            self.notes.append(
                f"the reference's time is an earlier job's of this reference, inputs and timing "
                f"settings on this GPU, {age:.1f} s ago (the service's --reference-time-reuse-s; "
                "bypass_cache times it again)"
            )
        elif timed is not None:  # timed call by call, as the kernel was
            stats = timed
        else:
            self.reporter.phase(job_pb2.PHASE_PROFILING)
            args = eager_args = make_args(0)
            n = self.opts.perf_trials
            stats = self._measure(
                lambda: ref.run(eager_args), REFERENCE_PREFIX, lambda d: self._progress(d, n)
            )
        self.result.reference_runtime.CopyFrom(stats)
        kernel_ms = candidate.runtime.median_ms
        if math.isfinite(stats.median_ms) and kernel_ms > 0:
            self.result.speedup = stats.median_ms / kernel_ms
            self._judge_speedup()
        if compiled_timed is None and compiled is not None:
            if args is None:  # an earlier job's eager time: this process's window now
                self.reporter.phase(job_pb2.PHASE_PROFILING)
                args = make_args(0)
            compiled_timed = self._measure_compiled(compiled, args)
        if compiled_timed is not None:
            self._compiled_baseline(compiled_timed, kernel_ms)
        self._memory_floor(kernel_ms)


def _forget_compiled() -> None:
    """torch.compile's caches of the reference (its code, guards), dropped before a standing
    judge's next job."""
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - a cache not dropped costs memory, not a verdict
        pass


def _like(value: Any) -> torch.Tensor:
    """A shared output's shape and dtype: the reference's output (a tensor, or refused)."""
    if not isinstance(value, torch.Tensor):
        raise timed_calls.TimedCallError(
            f"the reference returns a {type(value).__name__}: only tensors are shared"
        )
    return value


def _timing_event() -> Any:
    return timing._Event(enable_timing=True)


class _Stopwatch:
    """Where a timed phase's time went, by part (said in the job's notes: a window costs the
    GPU to every other job, so its parts are worth seeing)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self.last
        self.last = now

    def __str__(self) -> str:
        total = sum(self.parts.values())
        each = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in self.parts.items())
        return f"{total * 1e3:.0f} ms ({each})"
