"""A KERNEL_TYPE_GPU_MODE job, run as GPU MODE's harness runs one (its eval.py, "test" then
"benchmark" modes), inside the engine's guards:

- every test case: data = generate_input(**case); the kernel gets a copy, and the reference's
  check_implementation(data, output) judges its output (a failed case does not stop the
  others);
- every benchmark case: checked once in the same way, then timed (perf_trial_count trials after
  warmup_count warm-ups, the L2 flushed as for every job) on fresh data, and ref_kernel timed
  on the same data for the speedup.

What differs from GPU MODE's harness: a fixed number of timed trials (it stops early once the
mean's relative error is under 0.1%), the median as the number to compare (it reports the
mean), and a case's `seed` mixed with EvalOptions.seed when that is set (it mixes in a secret
seed with its own formula), the global generators (torch's, numpy's, Python's) seeded from
each case right before its generate_input (it seeds them once, with 42, per run: its data is
made once, where ours is made again in the judge), and the data's objects, not only its
tensors, copied for the kernel. The judge's verdict may be GPU MODE's (passed, message) pair
or its older error string (empty when it passed).

Judged in a judge process and timed by it (EngineConfig.timed_by_judge, issue 40), the
kernel's process times nothing: it serves its judge's timed calls (timed_calls.serve), one
session per benchmark case, each call `custom_kernel(data)` on data the judge made from a
secret variant of the case's seed and wrote into memory the two share; the judge checks a
random quarter of them with check_implementation and bounds each call with its own clock
(docs/TRUST.md "Times from outside"). A task whose data or output holds what cannot be
shared (share_layout) is timed in the kernel's process as before, and the result says so.

Here: the job in the kernel's process (`run`: every case checked, then timed in its process
or served to its judge's timed calls) and the case machinery its judge shares (_GpuModeRun:
the reference built, a case's data made, a call guarded, check_implementation's verdict).
Around it: gpumode_cases.py (the task's cases and their seeds), gpumode_nest.py (a case's data
and outputs as nests: copied, recorded, shared), gpumode_judge.py (the judge's verdict on the
record, `judge`, called from engine/judge.py) and gpumode_judge_timing.py (the judge's timing:
ref_kernel, and the kernel's timed calls driven from outside).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Collection
from typing import Any, NoReturn, Protocol

import torch
from kerneleval.v1 import job_pb2, kernel_pb2

from . import compare, timed_calls, timing
from .backends import BuildContext
from .backends import gpumode as backend
from .gpumode_cases import Case, cases, seed_globals
from .gpumode_nest import clone, flatten, share_rebuild, tensors_of, unshared_reason
from .options import Options
from .stops import ReporterError, SafeReporter, Stop, build_failure

JUDGE = "reference: check_implementation(): "
GENERATE = "reference: generate_input(): "
REF_KERNEL = "reference: ref_kernel(): "


class JudgeAnswerError(TypeError):
    """check_implementation answered something that is neither of GPU MODE's forms."""


def judgement(answer: Any) -> tuple[bool, str]:
    """(passed, message) from check_implementation's answer: GPU MODE's (bool, str) pair, or
    its older form, an error string (or a list of reasons) that is empty when it passed."""
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool):
        return answer[0], str(answer[1] or "")
    if isinstance(answer, bool):
        return answer, ""
    if answer is None:
        return True, ""
    if isinstance(answer, str):
        return answer == "", answer
    if isinstance(answer, list) and all(isinstance(x, str) for x in answer):
        return not answer, "; ".join(answer)
    raise JudgeAnswerError(
        f"check_implementation returned a {type(answer).__name__}: GPU MODE's judge returns "
        "(passed, message) or an error string"
    )


class Job(Protocol):
    """What a GPU MODE job uses of the job that runs it (runner.Job, judge.py's _Judge)."""

    spec: kernel_pb2.JobSpec
    reporter: SafeReporter
    result: job_pb2.EvalResult
    poisoned: bool
    notes: list[str]
    opts: Options
    dev: torch.device
    source_files: tuple[str, ...]
    serves_cases: Callable[[int], None] | None  # the judge's timed calls, one session a case

    @property
    def judged_elsewhere(self) -> bool: ...
    def _timed_by_judge(self) -> bool: ...
    def _refuse_rewritten_timers(self, timers_changed: Callable[..., list[str]] = ...) -> None: ...
    def _guard(
        self, who: str = "", side: job_pb2.Side | None = None
    ) -> contextlib.AbstractContextManager[None]: ...
    def _cpu_shim(self) -> contextlib.AbstractContextManager[None]: ...
    def _sync(self) -> None: ...
    def _record(
        self,
        trial: int,
        outputs: list[Any],
        replay: bool = False,
        structure: str = "",
        aliased: Collection[int] = (),
    ) -> bool: ...
    def _tampered(self, message: str, who: str = "") -> NoReturn: ...
    def _cpu_times_note(self) -> None: ...
    def _judge_speedup(self) -> None: ...
    def _progress(self, done: int, total: int) -> None: ...
    def _measure(
        self,
        run: Callable[[], object],
        who: str,
        progress: Callable[[int], None],
        check: timing.TrialCheck | None = None,
        measure: Callable[..., timing.Timing] = ...,
        timers_changed: Callable[..., list[str]] = ...,
    ) -> job_pb2.RuntimeStats: ...


def run(job: Job, ctx: BuildContext) -> None:
    """The job's whole evaluation; ends with a verdict in job.result (or raises _Stop)."""
    _GpuModeRun(job, ctx).run()


class _GpuModeRun:
    """The job in the kernel's process, and the case machinery its judge's classes derive
    (gpumode_judge_timing.py's _JudgeTiming, then gpumode_judge.py's _GpuModeJudge)."""

    modules: backend.SharedModules  # set for the time of run()
    index = 0  # the case being checked, in the order tests then benchmarks

    def __init__(self, job: Job, ctx: BuildContext) -> None:
        self.job = job
        self.ctx = ctx
        self.result = job.result
        o = job.spec.options
        seed = o.seed if o.HasField("seed") else None
        task = job.spec.gpu_mode
        self.tests = cases("test", task.tests, seed)
        # perf_trial_count 0: not timed, and the benchmark cases are not run at all.
        self.benchmarks = cases("benchmark", task.benchmarks, seed)
        if job.opts.perf_trials <= 0:
            self.benchmarks = []
        # By benchmark case, why its judge could not time it from outside ("": it can).
        self.unshared: dict[int, str] = {}

    def run(self) -> None:
        job = self.job
        files = job.spec.gpu_mode.files
        with backend.shared_modules(self.ctx.work_dir, files) as self.modules:
            # The reference first; the submission then imports its own copies of the modules.
            ref = self._build(lambda: backend.build_reference(job.spec.reference, self.ctx), True)
            cand = self._build(lambda: backend.build_submission(job.spec.kernel, self.ctx), False)
            job.result.compiled = True
            job.notes.extend(self.ctx.notes)
            job.source_files = tuple(self.ctx.source_files)
            job.reporter.phase(job_pb2.PHASE_VALIDATING)
            self._check_all(ref, cand)
            if self.benchmarks:
                self._time_all(ref, cand)
            elif job.opts.perf_trials <= 0:
                job.notes.append("perf_trial_count is 0: not timed")
            else:
                job.notes.append("the task has no benchmarks: not timed")
        if job.dev.type == "cpu" and self.benchmarks:
            job._cpu_times_note()
        self.result.verdict = job_pb2.VERDICT_OK

    def _build(self, make: Callable[[], Any], reference: bool) -> Any:
        who = "reference: " if reference else ""
        try:
            with self.job._cpu_shim(), self._side(who):
                return make()
        except (Stop, ReporterError, KeyboardInterrupt):
            raise
        except BaseException as e:
            poisoned = build_failure(e, who, self.result, self.ctx, self.job.notes)
            self.job.poisoned = self.job.poisoned or poisoned
        raise Stop

    # -- correctness ---------------------------------------------------------------------
    def _check_all(self, ref: backend.GpuModeReference, cand: backend.GpuModeSubmission) -> None:
        r = self.result
        checks = [(c, r.test_cases) for c in self.tests]
        checks += [(c, r.benchmark_cases) for c in self.benchmarks]
        first_failure: tuple[Case, str] | None = None
        for i, (case, into) in enumerate(checks):
            record = into.add(spec=case.spec)
            self.index = i
            passed, message = self._check(ref, cand, case, record)
            record.passed, record.message = passed, message
            r.validation.trial_count = i + 1
            if passed:
                r.validation.trials_passed += 1
            elif first_failure is None:
                first_failure = (case, message)
            self.job.reporter.progress(job_pb2.PHASE_VALIDATING, i + 1, len(checks))
        self._conclude(first_failure)

    def _conclude(self, first_failure: tuple[Case, str] | None) -> None:
        """INCORRECT for the first case that failed (ends the job), else passed."""
        r = self.result
        if first_failure is not None:
            case, message = first_failure
            v = r.validation
            r.validation_error = (
                f"{v.trials_passed} of {v.trial_count} cases passed; {case.label} "
                f"({case.spec}): {message or 'check_implementation failed it'}"
            )
            r.verdict = job_pb2.VERDICT_INCORRECT
            r.failed_side = job_pb2.SIDE_KERNEL
            r.correctness = False
            r.correctness_status = job_pb2.CORRECTNESS_FAILED
            self.job.notes.append("incorrect: not timed")
            raise Stop
        r.correctness = True
        r.correctness_status = job_pb2.CORRECTNESS_PASSED

    def _check(
        self,
        ref: backend.GpuModeReference,
        cand: backend.GpuModeSubmission,
        case: Case,
        record: job_pb2.CaseResult,
    ) -> tuple[bool, str]:
        """Runs one case: the kernel on a copy of the data, the reference's judge on the rest.
        A failure that ends the job is written into `record` before it does."""
        job = self.job
        try:
            data = self._generate(ref, case)
            kernel_data = clone(data)
            with job._guard("anti-cheat: "):
                # An unwritten torch.empty() output must not find an earlier result there.
                compare.poison_free_memory(compare.nbytes_of(tensors_of(data)), job.dev)
            output = self._call(lambda: cand.custom_kernel(kernel_data), "")
            if self.job.judged_elsewhere:
                leaves, structure = flatten(output)
                at = self.index - len(self.tests)
                if at >= 0:  # a benchmark case: whether its judge can time it from outside
                    self.unshared[at] = unshared_reason(data, leaves, job.dev)
                if self.job._record(self.index, leaves, structure=structure):
                    return True, ""  # not this process's to say: its judge's
            return self._judge(ref, data, output)
        except Stop:
            record.message = self.result.error.message or self.result.compilation_error
            raise

    def _side(self, who: str) -> contextlib.AbstractContextManager[None]:
        """The shared modules of the source `who` names, for the time its code runs."""
        return self.modules.side("reference" if who.startswith("reference: ") else "kernel")

    def _generate(self, ref: backend.GpuModeReference, case: Case) -> Any:
        with self.job._guard(GENERATE), self._side(GENERATE), torch.device(self.job.dev):
            seed_globals(case.global_seed)
            return ref.generate_input(**case.kwargs)
        raise AssertionError("unreachable")

    def _call(self, fn: Callable[[], Any], who: str) -> Any:
        with self.job._guard(who), self._side(who):
            out = fn()
            self.job._sync()
            return out
        raise AssertionError("unreachable")

    def _judge(self, ref: backend.GpuModeReference, data: Any, output: Any) -> tuple[bool, str]:
        """check_implementation's verdict. Should it raise on the kernel's output, it is asked
        about ref_kernel's own: raising there too is the reference's failure, not the
        kernel's; otherwise the kernel's output is what it could not judge (INCORRECT)."""
        pristine = clone(data)
        try:
            with self.job._cpu_shim(), torch.no_grad(), self._side(JUDGE):
                return judgement(ref.check_implementation(data, output))
        except JudgeAnswerError as e:
            self._reference_failure(e)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # whose fault it is is found out below
            own = self._call(lambda: ref.ref_kernel(clone(pristine)), REF_KERNEL)
            with self.job._guard(JUDGE), self._side(JUDGE):
                judgement(ref.check_implementation(pristine, own))
            return False, f"check_implementation raised {type(e).__name__} on it: {e}"
        raise AssertionError("unreachable")

    def _reference_failure(self, e: Exception) -> None:
        with self.job._guard(JUDGE):
            raise e

    # -- timing --------------------------------------------------------------------------
    def _time_all(self, ref: backend.GpuModeReference, cand: backend.GpuModeSubmission) -> None:
        job, r = self.job, self.result
        n = job.opts.perf_trials
        if job._timed_by_judge():
            why = next((f"{self.benchmarks[i].label}: {w}"
                        for i, w in sorted(self.unshared.items()) if w), "")  # fmt: skip
            if not why and len(self.unshared) == len(self.benchmarks):
                job._refuse_rewritten_timers()
                job.serves_cases = lambda share_fd: self._serve(cand, share_fd)
                return  # timed after the outcome, by the judge (_serve)
            job.notes.append(
                f"timed in its own process, not from outside: {why or 'not every case recorded'}"
            )
        # Judged elsewhere, this process times the kernel alone (its judge, the reference):
        # n steps a case; else the kernel's n and ref_kernel's n, case by case.
        per_case = n if job.judged_elsewhere else 2 * n
        total = per_case * len(self.benchmarks)
        job.reporter.phase(job_pb2.PHASE_PROFILING)
        for i, case in enumerate(self.benchmarks):
            self._time_case(ref, cand, case, r.benchmark_cases[i], per_case * i, total)
        r.runtime.CopyFrom(geometric_means([c.runtime for c in r.benchmark_cases]))
        if not job.judged_elsewhere:
            self._speedups()

    def _serve(self, cand: backend.GpuModeSubmission, share_fd: int) -> None:
        """After the outcome: the judge's timed calls, one session per benchmark case, each
        call custom_kernel on the case's data rebuilt from the shared leaves, its output's
        leaves copied into the shared outputs (timed_calls.serve)."""
        job = self.job

        def make_data(values: list[Any], layout: dict[str, Any]) -> Any:
            return share_rebuild(values, layout["tree"])

        def call(data: Any) -> list[Any]:
            return flatten(cand.custom_kernel(data))[0]

        if job.dev.type == "cuda":  # its checks' tensors are gone: their memory too
            gc.collect()
            torch.cuda.empty_cache()
        with job._cpu_shim(), torch.no_grad(), self._side(""):
            timed_calls.serve(share_fd, call, make_data, job.dev)

    def _speedups(self) -> None:
        r = self.result
        r.reference_runtime.CopyFrom(
            geometric_means([c.reference_runtime for c in r.benchmark_cases])
        )
        speedups = [c.speedup for c in r.benchmark_cases]
        if all(s > 0 for s in speedups):
            r.speedup = geometric_mean(speedups)
            self.job._judge_speedup()

    def _time_case(
        self,
        ref: backend.GpuModeReference,
        cand: backend.GpuModeSubmission,
        case: Case,
        record: job_pb2.CaseResult,
        done: int,
        total: int,
    ) -> None:
        """The kernel, then ref_kernel, each on its copy of the case's fresh data."""
        job, n = self.job, self.job.opts.perf_trials
        data = self._generate(ref, case)
        kernel_data = clone(data)
        with self._side(""):
            record.runtime.CopyFrom(
                job._measure(
                    lambda: cand.custom_kernel(kernel_data),
                    "",
                    lambda d: job._progress(done + d, total),
                )
            )
        if self.job.judged_elsewhere:
            return  # its judge times ref_kernel, once this process is gone
        who = REF_KERNEL
        with self._side(who):
            record.reference_runtime.CopyFrom(
                job._measure(
                    lambda: ref.ref_kernel(data), who, lambda d: job._progress(done + n + d, total)
                )
            )
        if record.runtime.median_ms > 0:
            record.speedup = record.reference_runtime.median_ms / record.runtime.median_ms


_STATS = ("mean_ms", "median_ms", "std_ms", "min_ms", "max_ms", "p95_ms", "p99_ms")


def geometric_mean(values: list[float]) -> float:
    if not values or any(v <= 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geometric_means(stats: list[job_pb2.RuntimeStats]) -> job_pb2.RuntimeStats:
    """Per statistic, the geometric mean over the cases (GPU MODE ranks by it); trial_count
    is the trials of one case."""
    out = job_pb2.RuntimeStats()
    if not stats:
        return out
    for name in _STATS:
        setattr(out, name, geometric_mean([getattr(s, name) for s in stats]))
    out.trial_count = stats[0].trial_count
    out.source = stats[0].source
    out.l2_flushed = stats[0].l2_flushed
    out.timed_from_outside = all(s.timed_from_outside for s in stats)
    return out
