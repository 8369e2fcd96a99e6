"""A GPU MODE job's verdict in its judge (issue 13; engine/judge.py calls `judge`): the kernel's
process's record of its outputs checked (the task's cases, in order, each once; a case said to
be over the record's limits checked against ref_kernel's output), every case's data made again
from its seed and the recorded output rebuilt for the reference's check_implementation; then
the timing (gpumode_judge_timing.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from kerneleval.v1 import job_pb2

from . import record, tamper
from .backends import BuildContext
from .backends import gpumode as backend
from .gpumode import REF_KERNEL, Job
from .gpumode_cases import Case
from .gpumode_judge_timing import _JudgeTiming
from .gpumode_nest import StructureError, flatten, rebuild


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


class _GpuModeJudge(_JudgeTiming):
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
