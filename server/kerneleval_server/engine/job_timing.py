"""A job's timing (PHASE_PROFILING): methods of _JobTiming, the class between
job_correctness.py's _JobCorrectness and runner.py's _Job (which times through them, as do
judge.py's _Judge and gpumode.py).

In this process: the kernel's timed trials and the reference's (`_time`, `_measure`), one of the
kernel's, drawn at random, on new inputs and checked (_ReplayCheck), the memory-bandwidth floor
(`_memory_floor`), the speedup judged (`_judge_speedup`), and with EvalOptions.compile_baseline
the reference under torch.compile. Where its judge times the kernel (EngineConfig.timed_by_judge)
instead: what the kernel rewrote of the timing ends the job first (`_refuse_rewritten_timers`),
and after the outcome this process serves the judge's timed calls (`serve_timed_calls`).

The timing this module calls (timing.measure, tamper.check_timers) is bound when it is imported,
before any job code runs (`_measure`'s defaults, `_timing_measure`): a candidate that replaces
them changes nothing here (tamper.py).
"""

from __future__ import annotations

import gc
import math
import os
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from kerneleval.v1 import job_pb2, kernel_pb2

from . import compare, errors, integrity, tamper, timed_calls, timing
from .backends import Program
from .backends.base import ModelProgram
from .inputs import TrialArgs
from .job_correctness import _JobCorrectness
from .stops import REFERENCE_PREFIX
from .stops import ReporterError as _ReporterError
from .stops import Stop as _Stop

SUSPICIOUS_SPEEDUP = 10.0
CPU_TIMES_NOTE = (
    "timed on the CPU with the host's monotonic clock (no GPU): host wall-clock times, which "
    "other processes on its cores and the OS move; not comparable with GPU times"
)
_timing_measure = timing.measure  # bound at import, as _measure's defaults are (tamper.py)


class _JobTiming(_JobCorrectness):
    def _refuse_rewritten_timers(
        self, timers_changed: Callable[..., list[str]] = tamper.check_timers
    ) -> None:
        """Before the judge times the kernel: what its code rewrote of the engine's timing
        so far ends the job as a tampering, as after its own timed trials (a defence that
        costs nothing; its time does not depend on it: the judge's bound does)."""
        changed = timers_changed(self)
        if changed:
            self._timer_tampered(changed, "")

    def serve_timed_calls(self, share_fd: int) -> None:
        """After the outcome: the judge's timed calls of the kernel, on views of its shared
        arguments, until it stops them (timed_calls.serve). Whatever this process claims of
        their time is checked against the judge's own clock."""
        cand = self.serves
        assert cand is not None

        def make_args(values: list[Any], layout: dict[str, Any]) -> TrialArgs:
            return TrialArgs(
                values, list(layout["names"]), list(layout["roles"]), list(layout["is_meta"]),
                bool(layout["from_get_inputs"]),
            )  # fmt: skip

        if self.dev.type == "cuda":  # its checks' tensors are gone: their memory too
            gc.collect()
            torch.cuda.empty_cache()
        with self._cpu_shim(), torch.no_grad():
            timed_calls.serve(share_fd, cand.run, make_args, self.dev)

    # -- timing --------------------------------------------------------------------------
    def _time(
        self, cand: Program, ref: Program | None, make_args: Callable[[int], TrialArgs]
    ) -> None:
        # The reference is timed here unless a judge times it (a 17 GB KernelBench input
        # cloned for nothing ran one out of memory on the H100).
        timed_ref = ref is not None and not self.judged_elsewhere
        total = self.opts.perf_trials * (2 if timed_ref else 1)
        cand_args = make_args(0)
        ref_args = cand_args.clone() if timed_ref else None
        self.reporter.phase(job_pb2.PHASE_PROFILING)
        replay = (
            _ReplayCheck(self, cand, ref, cand_args, make_args)
            if ref is not None or self.reference_judged
            else None
        )
        run = replay.run if replay is not None else (lambda: cand.run(cand_args))
        check = replay.trial_check() if replay is not None else None
        stats = self._measure(run, "", lambda d: self._progress(d, total), check)
        if replay is not None and replay.failed is not None:
            self._replayed(replay)
        self.result.runtime.CopyFrom(stats)
        self._memory_floor(stats.median_ms)
        if ref is not None and ref_args is not None:
            n = self.opts.perf_trials
            rstats = self._measure(
                lambda: ref.run(ref_args), REFERENCE_PREFIX, lambda d: self._progress(n + d, total)
            )
            self.result.reference_runtime.CopyFrom(rstats)
            if stats.median_ms > 0:
                self.result.speedup = rstats.median_ms / stats.median_ms
                self._judge_speedup()
            compiled = self._compile_reference(ref, ref_args)
            if compiled is not None:
                cstats = self._measure_compiled(compiled, ref_args)
                if cstats is not None:
                    self._compiled_baseline(cstats, stats.median_ms)
        if self.dev.type == "cpu":
            self._cpu_times_note()

    # -- the torch.compile baseline (EvalOptions.compile_baseline) ----------------------
    def _compile_reference(self, ref: Program, args: TrialArgs) -> Program | None:
        """The reference's Model under torch.compile, compiled by a first call on a copy of
        `args`, here, so that its compile time (EvalResult.compile_time) stays outside any
        timed call. None, with a note, when it is not asked for, the reference is no Model,
        or it does not compile or run: never a failure of the job."""
        if not self.opts.compile_baseline:
            return None
        if not isinstance(ref, ModelProgram):
            self.notes.append(
                "compile_baseline: the reference is not a Model (KernelBench's format): "
                "no torch.compile baseline"
            )
            return None
        began = time.perf_counter()
        try:
            with self._cpu_shim(), torch.no_grad():
                compiled = ModelProgram(instance=torch.compile(ref.instance), module=ref.module)
                compiled.run(args.clone())
                self._sync()
        except (_Stop, _ReporterError, KeyboardInterrupt):
            raise
        except Exception as e:
            self._baseline_failed("compiling", e)
            return None
        took = time.perf_counter() - began
        self.result.compile_time.FromNanoseconds(int(took * 1e9))
        self.notes.append(
            f"compile_baseline: the reference compiled with torch.compile in {took:.1f} s "
            "(its first call, before and outside the timed calls)"
        )
        return compiled

    def _measure_compiled(self, compiled: Program, args: TrialArgs) -> job_pb2.RuntimeStats | None:
        """The compiled reference timed as _measure times the eager one, on the same
        arguments; a failure is a note (None)."""
        try:
            with self._cpu_shim(), torch.no_grad():
                t = _timing_measure(
                    lambda: compiled.run(args),
                    trials=self.opts.perf_trials,
                    warmup=self.opts.warmup,
                    flush_l2=self.opts.flush_l2,
                    device=self.dev,
                )
        except (_Stop, _ReporterError, KeyboardInterrupt):
            raise
        except Exception as e:
            self._baseline_failed("timing", e)
            return None
        return t.stats

    def _baseline_failed(self, doing: str, e: BaseException) -> None:
        """torch.compile's baseline failed: a note. One that poisoned the CUDA context
        leaves nothing to time the kernel with: the job ends as the reference's failure
        (never the kernel's), and the process exits after it."""
        f = errors.classify(e)
        if f.context_poisoned:
            self._fail(f, REFERENCE_PREFIX + "torch.compile's baseline: ", job_pb2.SIDE_REFERENCE)
            raise _Stop from None
        first = (str(e).strip().splitlines() or [""])[0][:300]
        self.notes.append(
            f"compile_baseline: torch.compile of the reference failed {doing} it "
            f"({type(e).__name__}: {first}): no torch.compile baseline"
        )
        self.result.ClearField("compiled_reference_runtime")
        self.result.compiled_speedup = 0.0

    def _compiled_baseline(self, stats: job_pb2.RuntimeStats, kernel_ms: float) -> None:
        """The compiled reference's time and the kernel's speedup over it."""
        self.result.compiled_reference_runtime.CopyFrom(stats)
        if math.isfinite(stats.median_ms) and stats.median_ms > 0 and kernel_ms > 0:
            self.result.compiled_speedup = stats.median_ms / kernel_ms

    def _replayed(self, replay: _ReplayCheck) -> NoReturn:
        """A timed trial's outputs were not what the reference computes from the inputs
        written before it: results computed earlier, handed back (or a kernel that reads
        more than its inputs). Incorrect, and flagged."""
        failed = replay.failed
        assert failed is not None
        why = (
            f"timed trial {replay.trial + 1}: new inputs were written in place before it and "
            f"its outputs did not match the reference on them ({failed.message}): results "
            "computed earlier were handed back"
        )
        self._replayed_incorrect(why)

    def _memory_floor(self, kernel_ms: float) -> None:
        """faster_than_memory: the kernel's median under what its outputs take to write at
        the GPU's peak bandwidth (here, or in the judge with the kernel's reported median)."""
        if self.dev.type == "cuda":
            bandwidth = integrity.peak_bandwidth(self.dev.index or 0)
            l2 = int(getattr(torch.cuda.get_device_properties(self.dev), "L2_cache_size", 0))
            floor = integrity.memory_floor(kernel_ms, self._output_bytes, bandwidth, l2)
            self._flag([floor] if floor is not None else [])

    def _replayed_incorrect(self, why: str) -> NoReturn:
        """Ends the job INCORRECT with the replayed_outputs flag (here, or in the judge)."""
        self._flag([integrity.flag(integrity.REPLAYED_OUTPUTS, why)])
        self.result.validation_error = why
        self.result.verdict = job_pb2.VERDICT_INCORRECT
        self.result.failed_side = job_pb2.SIDE_KERNEL
        self.result.correctness = False
        self.result.correctness_status = job_pb2.CORRECTNESS_FAILED
        raise _Stop

    def _timer_tampered(self, changed: list[str], who: str) -> NoReturn:
        """The timing was rewritten while the job ran (tamper.check_timers): no time is
        believed, and the job says why."""
        message = tamper.message(changed)
        self._flag([integrity.flag(tamper.TIMER_TAMPERED, message)])
        self._tampered(message, who)

    def _cpu_times_note(self) -> None:
        if CPU_TIMES_NOTE not in self.notes:
            self.notes.append(CPU_TIMES_NOTE)

    def _judge_speedup(self) -> None:
        if self.dev.type != "cuda":
            # Host wall-clock times of identical code read 437x, 0.004x and 3.6x on a CPU host
            # (issue 41): a speedup there is no evidence of a timing hack, only of noise.
            self.result.speedup_suspicious = False
            self._cpu_times_note()
            if self.result.speedup > SUSPICIOUS_SPEEDUP:
                self.notes.append(
                    f"speedup {self.result.speedup:.1f}x is over {SUSPICIOUS_SPEEDUP:g}x but not "
                    "flagged (speedup_suspicious): CPU times are host wall-clock, which noise "
                    "moves by more than that; time it on a GPU to tell"
                )
            return
        self.result.speedup_suspicious = self.result.speedup > SUSPICIOUS_SPEEDUP
        if self.result.speedup_suspicious:
            self.notes.append(
                f"speedup {self.result.speedup:.1f}x is over {SUSPICIOUS_SPEEDUP:g}x: "
                "worth a second look"
            )

    def _progress(self, done: int, total: int) -> None:
        self.reporter.progress(job_pb2.PHASE_PROFILING, done, total)

    def _measure(
        self,
        run: Callable[[], object],
        who: str,
        progress: Callable[[int], None],
        check: timing.TrialCheck | None = None,
        measure: Callable[..., timing.Timing] = timing.measure,
        timers_changed: Callable[..., list[str]] = tamper.check_timers,
    ) -> job_pb2.RuntimeStats:
        """`measure` and `timers_changed` are bound when this module is imported, before any
        job code runs: a candidate that replaces timing.measure or tamper.check_timers changes
        neither (tamper.py)."""
        with self._guard(who):
            t = measure(
                run,
                trials=self.opts.perf_trials,
                warmup=self.opts.warmup,
                flush_l2=self.opts.flush_l2,
                device=self.dev,
                progress=lambda done, _total: progress(done),
                check=check,
            )
            changed = timers_changed(self)
            if changed:
                self._timer_tampered(changed, who)
            if t.persisting_l2_bytes and who == "":
                self._flag([integrity.persisting_l2(t.persisting_l2_bytes, t.persisting_l2_resets)])
            elif t.persisting_l2_bytes:
                self.notes.append(f"{who}set aside persisting L2; reset before its timed trials")
            if t.note and t.note not in self.notes:
                self.notes.append(t.note)
            if t.side_stream_trials:
                self.notes.append(
                    f"{who or 'kernel: '}work on another stream outlasted the launching stream "
                    f"in {t.side_stream_trials} trials; counted up to a device-wide synchronize"
                )
            if not math.isfinite(t.stats.median_ms):
                self.notes.append(f"{who}timing produced no finite median")
            return t.stats
        raise AssertionError("unreachable")


class _ReplayCheck:
    """One timed trial, picked at random, runs on new inputs written in place into the
    arguments every trial uses (before its timed span), and its outputs are checked against
    the reference's on those inputs (after it): a kernel that hands back results it computed
    earlier (after a few honest calls, keyed by the tensors' addresses, ...) for the timed
    trials shows there. The trial is drawn from the OS, not from the job's seed."""

    def __init__(
        self,
        job: _JobTiming,
        cand: Program,
        ref: Program | None,  # None: recorded for the judge only (reference_judged)
        args: TrialArgs,
        make_args: Callable[[int], TrialArgs],
    ) -> None:
        self.job, self.cand, self.ref, self.args, self.make_args = job, cand, ref, args, make_args
        trials = job.opts.perf_trials
        self.trial = 1 + int.from_bytes(os.urandom(4)) % (trials - 1) if trials > 1 else -1
        self.keep = False
        self.out: list[Any] | None = None
        self.fresh: TrialArgs | None = None
        self.failed: compare.TrialCheck | None = None

    def trial_check(self) -> timing.TrialCheck | None:
        if self.trial < 0:
            return None
        return timing.TrialCheck(self.trial, self.before, self.after)

    def run(self) -> object:
        out = self.cand.run(self.args)
        if self.keep:
            self.out, self.keep = out, False
        return out

    def before(self) -> None:
        # inputs no correctness trial used (a trial index past them), written into the very
        # tensors the timed trials pass
        fresh = self.make_args(self.job.opts.correct_trials + 1)
        for i, (dst, src) in enumerate(zip(self.args.values, fresh.values, strict=True)):
            written = self.args.roles[i] != kernel_pb2.ARG_ROLE_OUTPUT
            if written and isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                dst.copy_(src)
        self.fresh, self.keep = fresh, True

    def after(self) -> None:
        assert self.fresh is not None
        cand_out, self.out = self.out, None
        if cand_out is None:
            return
        self.job._record(self.job.opts.correct_trials + 1, cand_out, replay=True)
        fresh, self.fresh = self.fresh, None
        if self.ref is None:
            return
        ref_out = self.job._run(self.ref, fresh.clone(), REFERENCE_PREFIX)
        names = self.job._output_names(self.cand, self.ref, fresh)
        check = compare.compare_outputs(
            cand_out, ref_out, names, self.job.opts.atol, self.job.opts.rtol
        )
        if not check.ok:
            self.failed = check
