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
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import random
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import numpy as np
import torch
from kerneleval.v1 import job_pb2, kernel_pb2

from . import compare, integrity, record, tamper, time_bound, timed_calls, timing
from .backends import BuildContext
from .backends import gpumode as backend
from .inputs import TrialArgs, mix_seed, seed_all
from .options import Options
from .stops import ReporterError, SafeReporter, Stop, build_failure

JUDGE = "reference: check_implementation(): "
GENERATE = "reference: generate_input(): "
REF_KERNEL = "reference: ref_kernel(): "


@dataclass(frozen=True)
class Case:
    """One test or benchmark case: its label and generate_input's keyword arguments."""

    label: str  # "test 2" or "benchmark 0"
    spec: str  # "size: 127; seed: 4242", the seed as used
    kwargs: dict[str, Any]
    # What the global generators (torch's, numpy's, Python's) are seeded with right before
    # generate_input, on every side that makes the case's data (_seed_globals).
    global_seed: int = 0


GLOBAL_SEED = 0x474C4F42  # mixed into a case's global_seed


def cases(label: str, given: Iterable[kernel_pb2.TaskCase], seed: int | None) -> list[Case]:
    out = []
    for i, c in enumerate(given):
        kwargs: dict[str, Any] = {}
        for a in c.args:
            value = task_value(a)
            if a.name == "seed" and seed is not None and type(value) is int:
                value = mix_seed(value, seed)
            kwargs[a.name] = value
        spec = "; ".join(f"{k}: {spec_text(v)}" for k, v in kwargs.items())
        own = kwargs.get("seed")
        parts = [GLOBAL_SEED, label == "benchmark", i, seed or 0]
        parts += [own] if type(own) is int else []
        glob = mix_seed(*parts) & VARIANT_SEED_MASK
        out.append(Case(f"{label} {i}", spec, kwargs, glob))
    return out


def _seed_globals(seed: int) -> None:
    """The generators a generate_input may draw from without seeding them (bioml/trimul's
    torch.distributions draws from torch's): seeded alike wherever the case's data is made,
    the kernel's process and its judge, which makes it again."""
    seed_all(seed)
    random.seed(seed)
    np.random.seed(seed)


def task_value(v: kernel_pb2.TaskArg | kernel_pb2.TaskValue) -> Any:
    """A case's value as generate_input gets it: a list as a tuple (GPU MODE's harness parses
    `m: [96, 128]` into one), a mapping as a dict in the task's order, a scalar as itself."""
    which = v.WhichOneof("value")
    if which == "list_value":
        return tuple(task_value(x) for x in v.list_value.values)
    if which == "map_value":
        return {e.key: task_value(e.value) for e in v.map_value.entries}
    return getattr(v, which or "int_value")


def spec_text(value: Any) -> str:
    """A value as GPU MODE's test files write it: `[96, 128]` for a list."""
    if isinstance(value, tuple):
        return "[" + ", ".join(spec_text(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {spec_text(x)}" for k, x in value.items()) + "}"
    return str(value)


def clone(data: Any) -> Any:
    """A deep copy of the data: the tensors in a nest of tuples, lists and dicts cloned, any
    other object copied whole (copy.deepcopy: amd/mla-decode's KVCache module, which a call
    writes into, and its Config of weights), shared only where it cannot be copied."""
    if isinstance(data, torch.Tensor):
        return data.clone()
    if isinstance(data, (tuple, list)):
        return type(data)(clone(x) for x in data)
    if isinstance(data, dict):
        return {k: clone(v) for k, v in data.items()}
    if data is None or isinstance(data, (bool, int, float, complex, str, bytes)):
        return data
    try:
        return copy.deepcopy(data)
    except Exception:  # noqa: BLE001 - not copyable (a lock, a handle): shared, as before
        return data


def tensors_of(data: Any) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    if isinstance(data, (tuple, list)):
        return [t for x in data for t in tensors_of(x)]
    if isinstance(data, dict):
        return [t for x in data.values() for t in tensors_of(x)]
    return []


MAX_STRUCTURE = 1 << 16  # characters of a recorded output's nest (RecordedTrial.structure)
MAX_DEPTH = 32


def flatten(output: Any) -> tuple[list[Any], str]:
    """A submission's output as the record holds it: its values in order and the nest of
    tuples and lists around them ("t" a value: "t", "(t,t)", "[t,(t,t)]"). Anything else (a
    dict, ...) is one value, which the record keeps as a stand-in that no check passes."""
    leaves: list[Any] = []
    return leaves, _flatten_into(output, 0, leaves)


# The walks over a nest below are module functions, not nested ones: a nested function that
# calls itself is a reference cycle (it holds its own cell) and keeps what it closes over,
# the nest's tensors, alive until the cyclic collector runs. A judge timing a GPU MODE task
# whose data is gigabytes held 65 GB of them after ~15 calls and ran out of GPU memory.
def _flatten_into(x: Any, depth: int, leaves: list[Any]) -> str:
    if isinstance(x, (tuple, list)) and depth < MAX_DEPTH:
        inner = ",".join(_flatten_into(v, depth + 1, leaves) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    leaves.append(x)
    return "t"


class StructureError(ValueError):
    """A recorded nest that flatten never writes (a hostile kernel's process)."""


def rebuild(leaves: list[Any], structure: str) -> Any:
    """flatten's inverse; StructureError for a nest that is not one, or not of these values."""
    if not structure or len(structure) > MAX_STRUCTURE:
        raise StructureError(f"an output nest of {len(structure)} characters")
    parser = _NestParser(leaves, structure)
    out = parser.parse(0)
    if parser.pos != len(structure) or parser.used != len(leaves):
        raise StructureError("an output nest that does not hold exactly the values recorded")
    return out


class _NestParser:
    """rebuild's walk over a nest (a class, not a nested function: see _flatten_into)."""

    def __init__(self, leaves: list[Any], structure: str) -> None:
        self.leaves, self.structure = leaves, structure
        self.pos = self.used = 0

    def parse(self, depth: int) -> Any:
        structure = self.structure
        if depth > MAX_DEPTH or self.pos >= len(structure):
            raise StructureError("an output nest too deep or cut short")
        c = structure[self.pos]
        if c == "t":
            self.pos += 1
            if self.used >= len(self.leaves):
                raise StructureError("an output nest with more values than were recorded")
            self.used += 1
            return self.leaves[self.used - 1]
        close = {"(": ")", "[": "]"}.get(c)
        if close is None:
            raise StructureError(f"an output nest with {c!r} at {self.pos}")
        self.pos += 1
        items: list[Any] = []
        while self.pos < len(structure) and structure[self.pos] != close:
            if items:
                if structure[self.pos] != ",":
                    raise StructureError(f"an output nest without a comma at {self.pos}")
                self.pos += 1
            items.append(self.parse(depth + 1))
        if self.pos >= len(structure):
            raise StructureError("an output nest left open")
        self.pos += 1
        return tuple(items) if c == "(" else items


# -- a case's data shared with the kernel's process (timed from outside, issue 40) ---------


class Unshared(ValueError):
    """A case's data or output holds what the timed calls cannot share (the message says)."""


def share_layout(data: Any) -> tuple[list[Any], Any]:
    """The data's leaves (tensors, shared by the driver; scalars, sent as they are) and its
    nest as JSON ("t" a leaf; {"tuple"|"list": [...]}; {"dict": [[key, ...], ...]}).
    Unshared for anything else: an object, a dict with other than string keys, a tensor
    that is not dense and contiguous (its strides would not survive), of a dtype the calls
    do not carry, on another device than the job's or the host, or that shares memory with
    another (the kernel would see them apart)."""
    leaves: list[Any] = []
    tree = _layout_into(data, 0, leaves)
    seen: set[int] = set()
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                raise Unshared("tensors of its data share memory")
            seen.add(ptr)
    return leaves, tree


def _layout_into(x: Any, depth: int, leaves: list[Any]) -> Any:
    """share_layout's walk (a module function: see _flatten_into)."""
    if depth > MAX_DEPTH:
        raise Unshared("its data is nested too deep")
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or not x.is_contiguous():
            raise Unshared("a tensor of its data is not dense and contiguous")
        if not timed_calls.shareable_dtype(x.dtype):
            raise Unshared(f"a tensor of its data is of {x.dtype}")
        leaves.append(x)
        return "t"
    if x is None or type(x) in (bool, int, float, str):
        leaves.append(x)
        return "t"
    if type(x) in (tuple, list):
        return {type(x).__name__: [_layout_into(v, depth + 1, leaves) for v in x]}
    if type(x) is dict and all(type(k) is str for k in x):
        return {"dict": [[k, _layout_into(v, depth + 1, leaves)] for k, v in x.items()]}
    raise Unshared(f"its data holds a {type(x).__name__}")


def share_rebuild(values: list[Any], tree: Any) -> Any:
    """share_layout's inverse: the data from its leaves, in the nest `tree` describes."""
    it = iter(values)
    out = _build(tree, it)
    if next(it, it) is not it:
        raise Unshared("more values than the nest holds")
    return out


def _build(node: Any, it: Iterator[Any]) -> Any:
    """share_rebuild's walk (a module function: see _flatten_into)."""
    if node == "t":
        return next(it)
    ((kind, items),) = node.items()
    if kind == "dict":
        return {k: _build(v, it) for k, v in items}
    built = [_build(v, it) for v in items]
    return tuple(built) if kind == "tuple" else built


def _signature(leaves: list[Any], tree: Any) -> tuple[Any, ...]:
    """What must not change from one call's data to the next in a session: the nest, the
    scalars, each tensor's shape, dtype and device."""
    return (json.dumps(tree), *(
        ("T", tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor)
        else ("V", type(v).__name__, v)
        for v in leaves
    ))  # fmt: skip


def unshared_reason(data: Any, output_leaves: list[Any], device: torch.device) -> str:
    """Why a benchmark case cannot be timed from outside ("" when it can): its data (as
    share_layout) or its output's leaves (the kernel's, as recorded: tensors only)."""
    try:
        leaves, _ = share_layout(data)
    except Unshared as e:
        return str(e)
    for v in leaves:
        if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", device.type):
            return f"a tensor of its data is on {v.device.type}"
    for v in output_leaves:
        if not isinstance(v, torch.Tensor):
            return f"its output holds a {type(v).__name__}"
        if not timed_calls.shareable_dtype(v.dtype):
            return f"its output holds a tensor of {v.dtype}"
    if not output_leaves:
        return "its output holds no tensor"
    return ""


def _leaf_args(leaves: list[Any]) -> TrialArgs:
    """The leaves as the driver takes a call's arguments."""
    n = len(leaves)
    role = kernel_pb2.ARG_ROLE_INPUT
    return TrialArgs(list(leaves), [f"leaf {i}" for i in range(n)], [role] * n, [False] * n)


# A variant of a case's seed: in 31 bits, as tasks seed numpy's and Python's generators too.
VARIANT_SEED_MASK = (1 << 31) - 1
MAX_VARIANT_DRAWS = 8  # a variant whose layout differs from the session's is drawn again


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
            _seed_globals(case.global_seed)
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


# -- the judge: the submission's outputs from its process's record (issue 13) -----------------


def judge(
    job: Job,
    ctx: BuildContext,
    read_record: Callable[[], list[record.Trial]],
    fitted: Callable[[int, list[Any]], bool],
) -> None:
    """A GPU MODE job's verdict in its judge (engine/judge.py): every case's data made again
    from its seed, the recorded output rebuilt (flatten's nest), the reference's
    check_implementation on them; then ref_kernel timed on each benchmark case. The kernel's
    times, per case and overall, are its process's. `read_record`: the record's trials;
    `fitted(at, outputs)`: whether outputs said to be over the limit would have fitted."""
    _GpuModeJudge(job, ctx).judge(read_record, fitted)


class _GpuModeJudge(_GpuModeRun):
    def judge(
        self,
        read_record: Callable[[], list[record.Trial]],
        fitted: Callable[[int, list[Any]], bool],
    ) -> None:
        job, r = self.job, self.result
        records = [*r.test_cases, *r.benchmark_cases]
        with backend.shared_modules(self.ctx.work_dir, job.spec.gpu_mode.files) as self.modules:
            ref = self._build(lambda: backend.build_reference(job.spec.reference, self.ctx), True)
            job.notes.extend(self.ctx.notes)
            job.source_files = tuple(self.ctx.source_files)
            trials = read_record()
            if not getattr(job, "validating", False):
                job.reporter.phase(job_pb2.PHASE_VALIDATING)
            cases = [*self.tests, *self.benchmarks]
            checked = [t for t in trials if not t.replay and not t.over_limit]
            over = next((t for t in trials if t.over_limit), None)
            self._check_record(cases, records, checked, over)
            for c in records[: len(checked)]:  # the kernel's process's claims
                for name in ("passed", "message", "reference_runtime", "speedup"):
                    c.ClearField(name)
            if over is not None:
                self._check_over_claim(ref, cases[over.trial], over, fitted)
            first_failure: tuple[Case, str] | None = None
            for i, case in enumerate(cases):
                if i < len(checked):  # else judged in the kernel's process (over the limit)
                    records[i].passed, records[i].message = self._judge_recorded(
                        ref, case, checked[i]
                    )
                r.validation.trial_count = i + 1
                if records[i].passed:
                    r.validation.trials_passed += 1
                elif first_failure is None:
                    first_failure = (case, records[i].message)
                job.reporter.progress(job_pb2.PHASE_VALIDATING, i + 1, len(cases))
            self._conclude(first_failure)
            if over is not None:
                job.notes.append(
                    f"{len(checked)} of {len(cases)} cases judged outside the kernel's process "
                    "(its outputs are over the record's limits); the rest, and the reference's "
                    "times, only in it"
                )
            elif self.benchmarks and getattr(job, "kernel_serves", False):
                self._time_outside(ref, checked[len(self.tests) :])
            elif self.benchmarks and r.runtime.median_ms > 0:
                self._refuse_self_timed(ref, checked[len(self.tests) :])
                self._time_reference(ref)
        r.verdict = job_pb2.VERDICT_OK

    def _refuse_self_timed(
        self, ref: backend.GpuModeReference, recorded: list[record.Trial]
    ) -> None:
        """A kernel's process given its timed calls to serve that timed itself instead, where
        every benchmark case could be timed from outside (unshared_reason finds nothing here
        either): it chose the clock its time is read from, a tampering."""
        job: Any = self.job
        if not getattr(job, "kernel_must_serve", False) or getattr(job, "kernel_serves", False):
            return
        for case, trial in zip(self.benchmarks, recorded, strict=False):
            outs = [v.to(job.dev) if isinstance(v, torch.Tensor) else v for v in trial.values]
            if unshared_reason(self._generate(ref, case), outs, job.dev):
                return  # a case that cannot be shared: its process's times, as its note says
        job._tampered(
            f"{tamper.PREFIX}the kernel's process was to serve its timed calls to its judge "
            "and timed itself instead: its times are not taken"
        )

    def _check_record(
        self, cases: list[Case], records: list[Any], checked: list[record.Trial],
        over: record.Trial | None,
    ) -> None:  # fmt: skip
        """The record holds the task's cases in order, each once, up to one over the limit
        (after which the kernel's process judged the rest itself, as it reports)."""
        job = self.job
        if len(records) != len(cases):
            job._tampered(
                f"{tamper.PREFIX}the kernel's process reported {len(records)} cases of "
                f"a task with {len(cases)}"
            )
        if [t.trial for t in checked] != list(range(len(checked))):
            job._tampered(f"{tamper.PREFIX}the kernel's process recorded the cases "
                          "out of order")  # fmt: skip
        end = over.trial if over is not None else len(cases)
        if len(checked) != end or end > len(cases):
            job._tampered(
                f"{tamper.PREFIX}the kernel's process recorded {len(checked)} of the "
                f"task's {len(cases)} cases"
            )

    def _check_over_claim(
        self, ref: backend.GpuModeReference, case: Case, over: record.Trial,
        fitted: Callable[[int, list[Any]], bool],
    ) -> None:  # fmt: skip
        """A case said to be over the record's limits: ref_kernel's output on its data must
        not have fitted where the record stopped, else the kernel chose what to show."""
        data = self._generate(ref, case)
        own = self._call(lambda: ref.ref_kernel(data), REF_KERNEL)
        if fitted(over.at, flatten(own)[0]):
            self.job._tampered(
                f"{tamper.PREFIX}the kernel's process called {case.label} over the "
                "record's limit, where the reference's output fits"
            )

    def _judge_recorded(
        self, ref: backend.GpuModeReference, case: Case, trial: record.Trial
    ) -> tuple[bool, str]:
        data = self._generate(ref, case)
        values = [v.to(self.job.dev) if isinstance(v, torch.Tensor) else v for v in trial.values]
        try:
            output = rebuild(values, trial.structure)
        except StructureError as e:
            self.job._tampered(f"{tamper.PREFIX}the kernel's process recorded {e}")
        return self._judge(ref, data, output)

    def _time_reference(self, ref: backend.GpuModeReference) -> None:
        """ref_kernel timed on each benchmark case's fresh data, against the kernel's time its
        process measured on the same case."""
        job, r = self.job, self.result
        n = job.opts.perf_trials
        job.reporter.phase(job_pb2.PHASE_PROFILING)
        for i, case in enumerate(self.benchmarks):
            self._time_case_reference(ref, case, r.benchmark_cases[i], n * i)
        self._speedups()

    def _time_case_reference(
        self, ref: backend.GpuModeReference, case: Case, result: job_pb2.CaseResult, done: int
    ) -> None:
        job = self.job
        total = job.opts.perf_trials * len(self.benchmarks)
        data = self._generate(ref, case)
        with self._side(REF_KERNEL):
            result.reference_runtime.CopyFrom(
                job._measure(
                    lambda: ref.ref_kernel(data), REF_KERNEL,
                    lambda d: job._progress(done + d, total),
                )
            )  # fmt: skip
        if result.runtime.median_ms > 0:
            result.speedup = result.reference_runtime.median_ms / result.runtime.median_ms

    # -- the kernel timed from outside its process (issue 40) ----------------------------
    def _time_outside(self, ref: backend.GpuModeReference, recorded: list[record.Trial]) -> None:
        """ref_kernel timed per case as before (the kernel's process frozen in this window);
        then, per benchmark case, a session of the kernel's timed calls driven from here
        (_drive_case); each case's time its own claim only where that agrees with this
        process's bound, else the bound (flagged); the speedups as before."""
        job: Any = self.job
        r = self.result
        for c in [r, *r.benchmark_cases]:  # the kernel's process's claims: not believed
            c.ClearField("runtime")
        layouts = []
        for case, trial in zip(self.benchmarks, recorded, strict=True):
            outs = [v.to(job.dev) if isinstance(v, torch.Tensor) else v for v in trial.values]
            why = unshared_reason(self._generate(ref, case), outs, job.dev)
            if why:  # the kernel's process found otherwise: its data is not what it was here
                timed_calls.end_sessions(job.share_fd)
                job.notes.append(f"not timed: {case.label} cannot be timed from outside ({why}), "
                                 "and the kernel's process timed nothing")  # fmt: skip
                return
            layouts.append((outs, trial.structure))
        n = job.opts.perf_trials
        job.reporter.phase(job_pb2.PHASE_PROFILING)
        for i, case in enumerate(self.benchmarks):
            self._time_case_reference(ref, case, r.benchmark_cases[i], n * i)
        # The cap on each case's path cost, measured in this window: the kernel's process is
        # frozen (running, it could take the cores or the GPU while it is measured).
        lead = timed_calls.L2Flush(job.dev, job.opts.flush_l2).lead
        own_paths = [
            timed_calls.own_path_ns(job.dev, [o for o in outs if isinstance(o, torch.Tensor)], lead)
            for outs, _ in layouts
        ]
        job.reporter.drive_kernel()
        said = []
        for i, case in enumerate(self.benchmarks):
            outs, structure = layouts[i]
            last = i == len(self.benchmarks) - 1
            said.append(self._drive_case(
                ref, case, r.benchmark_cases[i], outs, structure, last, own_paths[i]
            ))  # fmt: skip
        stats = [c.runtime for c in r.benchmark_cases]
        r.runtime.CopyFrom(geometric_means(stats))
        if any(s.source == job_pb2.TIMING_SOURCE_OUTSIDE_BOUND for s in stats):
            r.runtime.source = job_pb2.TIMING_SOURCE_OUTSIDE_BOUND
        for c in r.benchmark_cases:
            if c.runtime.median_ms > 0:
                c.speedup = c.reference_runtime.median_ms / c.runtime.median_ms
        self._speedups()
        job.notes.append(
            f"timed from outside its process: per benchmark case, {n} calls driven by its "
            "judge, each on data generate_input made in the judge from a secret variant of the "
            "case's seed, a random quarter (at least 3) checked with check_implementation; "
            + "; ".join(said)
        )

    def _drive_case(
        self, ref: backend.GpuModeReference, case: Case, result: job_pb2.CaseResult,
        outs: list[torch.Tensor], structure: str, last: bool, own_path: int,
    ) -> str:  # fmt: skip
        """One benchmark case's session (timed_calls.Driver): its shared data laid out as a
        first variant's, the shared outputs as the kernel's recorded output on the case;
        calibration, warm-up, then each call on the data of a fresh variant written into the
        shared leaves; the case's time (time_bound.decide) into `result`. What it says."""

        job: Any = self.job
        n = job.opts.perf_trials
        first = self._variant(ref, case)
        leaves, tree = share_layout(first)
        signature = _signature(leaves, tree)
        picked = set(random.SystemRandom().sample(range(n), min(n, max(timed_calls.CHECKED_MIN,
                                                                        n // 4))))  # fmt: skip
        flush = timed_calls.L2Flush(job.dev, job.opts.flush_l2)
        total = n * len(self.benchmarks)
        done = n * self.benchmarks.index(case)
        try:
            driver = timed_calls.Driver(
                job.share_fd, _leaf_args(leaves), outs, job.dev, prepare=flush.enqueue,
                lead=flush.lead_kind, extra={"tree": tree},
            )  # fmt: skip
        except timed_calls.TimedCallError as e:
            job._kernel_failed_timed(f"{case.label}: {e}")
        inside: list[int] = []
        outside: list[int] = []
        reused = 0
        finished = False
        try:
            base = _leaf_args(leaves)
            calibration = time_bound.calibrate(driver, base)
            timed_calls.warm_up(lambda: driver.call(base).outside_ns / 1e6, job.opts.warmup)
            for k in range(n):
                data = self._matching_variant(ref, case, signature)
                if data is None:
                    data, reused = first, reused + 1
                driver.settle()  # generate_input's GPU work is behind it
                call = driver.call(_leaf_args(share_layout(data)[0]))
                # Copied after the call (its data is this process's own; the call had copies):
                # a copy before the go would make a checked call's go come later, and tell
                # the kernel which calls are checked.
                pristine = clone(data) if k in picked else None
                inside.append(call.inside_ns)
                outside.append(call.outside_ns)
                if pristine is not None:
                    self._check_timed_call(ref, case, k, call.outputs, structure, pristine)
                job._progress(done + k + 1, total)
            finished = True
        except timed_calls.TimedCallError as e:
            job._kernel_failed_timed(f"{case.label}: {e}")
        finally:
            driver.close(more=finished and not last)
        decision = time_bound.decide(
            inside, outside, calibration, cpu=job.dev.type != "cuda", own_path_ns=own_path
        )
        cuda = job.dev.type == "cuda"
        source = (
            job_pb2.TIMING_SOURCE_OUTSIDE_BOUND if decision.flagged
            else job_pb2.TIMING_SOURCE_CUDA_EVENTS if cuda
            else job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK
        )  # fmt: skip
        result.runtime.CopyFrom(
            timing.stats(decision.times_ms, source, flushed=job.opts.flush_l2 and cuda)
        )
        result.runtime.timed_from_outside = True
        if decision.flagged:
            job._flag([integrity.flag(
                integrity.TIME_OUTSIDE_BOUND,
                f"{case.label}: its own times were {decision.gap_us:.1f} us a call under the "
                f"judge's bound (tolerance {decision.tolerance_us:.1f} us): timed by that bound",
            )])  # fmt: skip
        said = (
            f"{case.label}: the path's own cost {decision.calibration_us:.1f} us a call, the "
            f"kernel's clock within {decision.gap_us:.1f} us of the judge's (tolerance "
            f"{decision.tolerance_us:.1f} us; its calls of no work took "
            f"{decision.calibration_measured_us:.1f} us, the judge's own measure of their work "
            f"{own_path / 1e3:.1f} us)"
        )
        if decision.calibration_capped:
            said += ", its calls of no work over what that measure allows: taken at it"
        if reused:
            said += (
                f", {reused} of its calls on its first variant's data again (generate_input "
                "gave other shapes or values for the other variants drawn)"
            )
        return said

    def _variant(self, ref: backend.GpuModeReference, case: Case) -> Any:
        """The case's data from a secret variant of its seed (the kernel knows task.yml's
        seeds and could have outputs ready for them); the generators' global state seeded
        with another secret too, for a generate_input without a seed, or one that draws from
        them besides."""
        draw = secrets.randbelow(1 << 62)
        kwargs = dict(case.kwargs)
        if type(kwargs.get("seed")) is int:
            kwargs["seed"] = mix_seed(kwargs["seed"], draw) & VARIANT_SEED_MASK
        job = self.job
        with job._guard(GENERATE), self._side(GENERATE), torch.device(job.dev):
            _seed_globals(mix_seed(draw, 1) & VARIANT_SEED_MASK)
            return ref.generate_input(**kwargs)
        raise AssertionError("unreachable")

    def _matching_variant(
        self, ref: backend.GpuModeReference, case: Case, signature: tuple[Any, ...]
    ) -> Any:
        """A fresh variant's data laid out as the session's (None: none of
        MAX_VARIANT_DRAWS drawn was)."""
        for _ in range(MAX_VARIANT_DRAWS):
            data = self._variant(ref, case)
            try:
                if _signature(*share_layout(data)) == signature:
                    return data
            except Unshared:
                pass
        return None

    def _check_timed_call(
        self, ref: backend.GpuModeReference, case: Case, k: int, outputs: list[Any],
        structure: str, pristine: Any,
    ) -> None:  # fmt: skip
        """A timed call's output (the judge's copy of the shared outputs, in the recorded
        nest) judged by check_implementation on the data the judge wrote for it."""
        passed, message = self._judge(ref, pristine, rebuild(list(outputs), structure))
        if not passed:
            job: Any = self.job
            job._replayed_incorrect(
                f"{case.label}: timed call {k + 1}, on data the judge made from a secret "
                f"variant of its seed, returned an output check_implementation fails "
                f"({message or 'no message'}): not computed from that data (a cache, a lazy "
                "or an unfinished result, or memory read before it was written, such as "
                "torch.empty's)"
            )
