"""A job's correctness trials (PHASE_VALIDATING): methods of _JobCorrectness, the class
between job_base.py's _JobBase and job_timing.py's _JobTiming (runner.py's _Job runs them).

Evaluate runs the kernel once (`_run_once`); Compare runs its trials against the reference
(`_validate`), with the lower-precision check on the first (`_check_precision`; its float64 run
made here, or ahead by a judge: `_float64_ahead`); a job whose reference runs only in its judge
records the kernel's outputs and compares nothing (`_record_trials`). The kernel's output
arguments are poisoned before it runs, and what it did with its arguments is checked after: the
inputs it wrote, the outputs that share memory with an input (integrity.py). `_record` hands a
trial's outputs to the judge (record.py).

In the judge, the kernel is RecordedProgram, its outputs as its own process recorded them, which
`_validate` runs as it runs a kernel; where_compared puts a recorded output where the judge
compares it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from kerneleval.v1 import job_pb2, kernel_pb2

from . import compare, integrity, precision, record
from .backends import Program
from .inputs import TrialArgs
from .job_base import _JobBase
from .stops import REFERENCE_PREFIX
from .stops import Stop as _Stop


class _JobCorrectness(_JobBase):
    def _run_once(self, cand: Program, make_args: Callable[[int], TrialArgs]) -> None:
        args = make_args(0)
        self._poison_outputs(args, 0)
        out = self._run(cand, args, "")
        self._output_bytes = compare.nbytes_of(out)
        # It ran; nothing was compared (no reference): `correctness` stays true for old clients.
        self.result.correctness = True
        self.result.correctness_status = job_pb2.CORRECTNESS_NOT_CHECKED
        nan_outputs = [
            i
            for i, t in enumerate(out)
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and bool(t.isnan().any())
        ]
        if nan_outputs:
            self.notes.append(f"outputs {nan_outputs} contain NaN")
        self.reporter.progress(job_pb2.PHASE_VALIDATING, 1, 1)

    def _poison_outputs(self, args: TrialArgs, trial: int) -> None:
        for i, r in enumerate(args.roles):
            if r == kernel_pb2.ARG_ROLE_OUTPUT and isinstance(args.values[i], torch.Tensor):
                compare.poison(args.values[i], trial)

    def _validate(self, cand: Program, ref: Program, make_args: Callable[[int], TrialArgs]) -> None:
        report = self.result.validation
        trials = cand.count if isinstance(cand, RecordedProgram) else self.opts.correct_trials
        first_failure: compare.TrialCheck | None = None
        out_bytes = 0
        ref_seconds = 0.0  # the reference's first run: how long a float64 one may take
        wrote_inputs = False
        # A judge's kernel is its recorded outputs: nothing runs on its arguments here, so they
        # are neither copied nor poisoned, nor checked for writes (its own process did that).
        recorded = isinstance(cand, RecordedProgram)
        for t in range(trials):
            # Outputs its judge will compare (they fit the record so far), of a job that times
            # nothing or that its judge times: the reference does not run here, nor is
            # anything compared (the judge does both anyway, and checks before it times: an
            # incorrect kernel holds no window). A job that times itself compares here too:
            # an incorrect kernel is not timed (its window would hold the GPU for nothing).
            # (Run here as well, the reference's tensors took a third of a GB problem's
            # process, and the GPU's memory bounds how many jobs check at once: H200, the
            # RL step.)
            judged = (
                self.judged_elsewhere and not recorded
                and (self.opts.perf_trials == 0 or self._timed_by_judge())
            )  # fmt: skip
            ref_out: list[Any] | None = None
            ref_args: TrialArgs | None = None  # made when the reference runs here
            if t in self.ahead:
                pristine, ref_args, ref_out, ref_seconds = self.ahead.pop(t)
                cand_args = pristine if recorded else pristine.clone()
            else:
                pristine = make_args(t)
                cand_args = pristine if recorded else pristine.clone()
            if not recorded:
                self._poison_outputs(cand_args, t)
            if ref_out is None and t % 2 == 1 and not judged:
                # reference first; alive while the kernel runs
                ref_args = pristine.clone()
                ref_out = self._run(ref, ref_args, REFERENCE_PREFIX)
                out_bytes = compare.nbytes_of(ref_out)
            if cand.kind == "model":
                with self._guard("anti-cheat: "):
                    compare.poison_free_memory(
                        out_bytes or compare.nbytes_of(pristine.values), self.dev
                    )
            cand_out = self._run(cand, cand_args, "")
            inputs = _inputs_of(cand, cand_args)
            aliased = integrity.aliased_outputs(cand_out, inputs) if judged else set()
            if self._record(t, cand_out, aliased=aliased) and judged:
                wrote_inputs |= self._judged_trial(cand, pristine, cand_args, cand_out)
                self.reporter.progress(job_pb2.PHASE_VALIDATING, t + 1, trials)
                continue
            if ref_args is None:
                ref_args = pristine.clone()  # the kernel ran on a copy: pristine still
            if ref_out is None:
                ref_start = time.perf_counter()
                ref_out = self._run(ref, ref_args, REFERENCE_PREFIX)
                ref_seconds = time.perf_counter() - ref_start
                out_bytes = compare.nbytes_of(ref_out)
            names = self._output_names(cand, ref, pristine)
            self._output_bytes = out_bytes
            allowed = integrity.aliased_outputs(ref_out, _inputs_of(ref, ref_args))
            self._flag(integrity.aliasing(cand_out, names, inputs, ref_out, allowed))
            if isinstance(cand, RecordedProgram):  # what the kernel's process saw of them
                self._flag(integrity.input_aliases(cand.aliased() - allowed, names))
            check = compare.compare_outputs(
                cand_out, ref_out, names, self.opts.atol, self.opts.rtol
            )
            if (
                t == 0 and check.ok and ref.kind == "model" and self.opts.check_precision
                and not self.judged_elsewhere
            ):  # fmt: skip
                self._check_precision(ref, pristine, cand_out, ref_out, names, ref_seconds)
            written = [] if recorded else self._written_inputs(pristine, cand_args)
            if written and cand.kind == "launch" and check.ok:
                check.ok = False
                check.message = _wrote_input_message(written[0])
                check.output_name = written[0]
            elif written and cand.kind == "model":
                wrote_inputs = True
            report.trial_count = t + 1
            report.max_abs_error = max(report.max_abs_error, check.max_abs)
            report.max_rel_error = max(report.max_rel_error, check.max_rel)
            report.atol, report.rtol = check.atol, check.rtol
            if check.ok:
                report.trials_passed += 1
            elif first_failure is None:
                first_failure = check
            self.reporter.progress(job_pb2.PHASE_VALIDATING, t + 1, trials)
        if wrote_inputs:
            self.notes.append("the kernel modified its input tensors in place")
        if first_failure is not None:
            report.mismatch_count = first_failure.mismatches
            report.element_count = first_failure.elements
            report.first_mismatch_index.extend(first_failure.first_index)
            report.output_name = first_failure.output_name
            self.result.validation_error = (
                f"{report.trials_passed} of {report.trial_count} trials passed; "
                f"{first_failure.message}"
            )
            self.result.verdict = job_pb2.VERDICT_INCORRECT
            self.result.failed_side = job_pb2.SIDE_KERNEL
            self.result.correctness = False
            self.result.correctness_status = job_pb2.CORRECTNESS_FAILED
            self.notes.append("incorrect: not timed")
            raise _Stop
        self.result.correctness = True
        self.result.correctness_status = (
            job_pb2.CORRECTNESS_PASSED
            if report.trial_count or not trials
            else job_pb2.CORRECTNESS_NOT_CHECKED  # every trial went to its judge
        )

    def _judged_trial(
        self, cand: Program, pristine: TrialArgs, args: TrialArgs, out: list[Any]
    ) -> bool:
        """A trial whose outputs went to the judge, which compares them: whether the kernel
        wrote its inputs (a launch's declared ARG_ROLE_INPUT ends the job here)."""
        self._output_bytes = compare.nbytes_of(out)
        written = self._written_inputs(pristine, args)
        if written and cand.kind == "launch":
            self._wrote_input(written[0])
        return bool(written)

    def _wrote_input(self, name: str) -> NoReturn:
        self.result.validation_error = _wrote_input_message(name)
        self.result.verdict = job_pb2.VERDICT_INCORRECT
        self.result.failed_side = job_pb2.SIDE_KERNEL
        self.result.correctness_status = job_pb2.CORRECTNESS_FAILED
        raise _Stop

    def _record_trials(self, cand: Program, make_args: Callable[[int], TrialArgs]) -> None:
        """The correctness trials with the reference judged elsewhere: each one's outputs
        recorded for the judge, nothing compared here. Inputs the kernel wrote (it declared
        them ARG_ROLE_INPUT) end it here."""
        for t in range(self.opts.correct_trials):
            pristine = make_args(t)
            args = pristine.clone()
            self._poison_outputs(args, t)
            out = self._run(cand, args, "")
            self._record(t, out, replay=False)
            names = self._output_names(cand, None, pristine)
            self._flag(integrity.aliasing(out, names, _inputs_of(cand, args), []))
            self._judged_trial(cand, pristine, args, out)
            self.reporter.progress(job_pb2.PHASE_VALIDATING, t + 1, self.opts.correct_trials)

    def _check_precision(
        self, ref: Program, pristine: TrialArgs, cand_out: list[Any], ref_out: list[Any],
        names: list[str], ref_seconds: float,
    ) -> None:  # fmt: skip
        """lower_precision (precision.py), on the inputs before anything ran; never fails.
        Its float64 run is the one a judge started ahead made, if it did."""
        try:
            gold = self.ahead_gold or self._float64_run(ref, pristine, ref_out, ref_seconds)
            with torch.no_grad():
                c = precision.judged(gold, cand_out, ref_out, names)
        except Exception as e:  # noqa: BLE001 - a bug here must not cost the job its verdict
            c = precision.Check(note=f"lower-precision check failed: {type(e).__name__}: {e}")
        self._flag([c.flag] if c.flag is not None else [])
        if c.note:
            self.notes.append(c.note)

    def _float64_budget(self) -> int:
        """The most a float64 run of the reference may take (precision.py)."""
        return min(precision.MAX_BYTES, self.config.limits.max_total_tensor_bytes)

    def _float64_run(
        self, ref: Program, pristine: TrialArgs, ref_out: list[Any], ref_seconds: float
    ) -> precision.Gold:
        with self._cpu_shim(), torch.no_grad():
            return precision.float64_run(
                getattr(ref, "instance", None), pristine.model_inputs(), ref_out,
                max_bytes=self._float64_budget(), device=self.dev, ref_seconds=ref_seconds,
                sync=self._sync,
            )  # fmt: skip

    def _float64_ahead(
        self, ref: Program, pristine: TrialArgs, ref_out: list[Any], ref_seconds: float
    ) -> None:
        """A judge started ahead: the first trial's float64 reference run for the
        lower-precision check, made before the kernel's outputs are in (a failure here is
        the check's, run again then)."""
        if ref.kind != "model" or not self.opts.check_precision or self.judged_elsewhere:
            return
        try:
            self.ahead_gold = self._float64_run(ref, pristine, ref_out, ref_seconds)
        except Exception:  # noqa: BLE001 - the check after says what failed
            self.ahead_gold = None

    @staticmethod
    def _output_names(cand: Program, ref: Program | None, args: TrialArgs) -> list[str]:
        launched = ref is not None and ref.kind == "launch"
        if cand.kind == "launch" or launched or getattr(cand, "launch", False):
            return [args.names[i] for i in args.output_indices()]
        return []

    @staticmethod
    def _written_inputs(pristine: TrialArgs, after: TrialArgs) -> list[str]:
        out = []
        for name, role, a, b in zip(
            pristine.names, pristine.roles, pristine.values, after.values, strict=False
        ):
            if role == kernel_pb2.ARG_ROLE_INPUT and isinstance(a, torch.Tensor):
                if (
                    isinstance(b, torch.Tensor)
                    and not torch.equal(a, b)
                    and not (
                        a.dtype.is_floating_point
                        and torch.equal(a.isnan(), b.isnan())
                        and torch.equal(a.nan_to_num(), b.nan_to_num())
                    )
                ):
                    out.append(name)
        return out

    def _record(
        self, trial: int, outputs: list[Any], replay: bool = False, structure: str = "",
        aliased: Collection[int] = (),
    ) -> bool:  # fmt: skip
        """The kernel's outputs of a trial, for its judge (record.py; `aliased`: the outputs
        sharing memory with an input, for the judge to flag). Handing them over by descriptor
        copies them on the GPU: out of memory there is the job's OUT_OF_MEMORY (a job that
        shared its GPU runs again with the GPU to itself)."""
        if self.recorder is None:
            return False
        with self._guard("handing the outputs to the judge: ", side=job_pb2.SIDE_KERNEL):
            recorded = bool(self.recorder.record(trial, outputs, replay, structure, aliased))
        if not recorded and self.reference_judged:  # the front end sends none such here
            self.result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
            self.result.error.exception_type = "OutputsTooLarge"
            self.result.error.message = (
                f"the kernel's outputs ({record.trial_bytes(outputs)} bytes a trial) are over "
                "the judge's limits, and its reference runs only in the judge"
            )
            raise _Stop
        return recorded


@dataclass
class RecordedProgram:
    """The kernel's outputs as its own process recorded them (record.py): the judge's
    stand-in for the kernel, whose code never runs there. Each run() hands back the next
    correctness trial's outputs where they are compared (`where_compared`; `_validate` runs
    it once a trial, in order)."""

    trials: list[record.Trial]  # the correctness trials, in order
    device: torch.device
    launch: bool  # the kernel is launched from its IOContract: outputs named by its args
    module: Any = None
    kind: str = "recorded"
    done: int = 0

    @property
    def count(self) -> int:
        return len(self.trials)

    def run(self, args: TrialArgs) -> list[Any]:
        trial = self.trials[self.done]
        self.done += 1
        return [where_compared(v, self.device) for v in trial.values]

    def aliased(self) -> frozenset[int]:
        """The last run trial's outputs that its process saw share memory with an input."""
        return self.trials[self.done - 1].aliased if self.done else frozenset()


def _wrote_input_message(name: str) -> str:
    """Why a launch that wrote an input it declared ARG_ROLE_INPUT is incorrect."""
    return f"the kernel wrote its input {name!r} (declared ARG_ROLE_INPUT)"


def where_compared(value: Any, device: torch.device) -> Any:
    """A recorded output where its judge compares it: one of at most HOST_COMPARE_MAX
    elements stays on the host, where the comparison and the precision check take it anyway
    (a copy to the device and two back saved: 0.15-0.2 ms of a tiny job's judge on an H100),
    a larger one goes to the device."""
    if isinstance(value, torch.Tensor) and value.numel() > compare.HOST_COMPARE_MAX:
        return value.to(device)
    return value


def _inputs_of(prog: Program, args: TrialArgs) -> list[Any]:
    """What the program reads and must not hand back: a model's forward arguments; a launched
    kernel's non-output args (its OUTPUT and INOUT args are its outputs)."""
    if prog.kind == "model":
        return args.model_inputs()
    outputs = set(args.output_indices())
    return [v for i, v in enumerate(args.values) if i not in outputs]
