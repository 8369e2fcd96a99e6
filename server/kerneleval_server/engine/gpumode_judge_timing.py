"""The judge's timing of a GPU MODE job: ref_kernel timed on each benchmark case's fresh data,
against the kernel's times; a kernel's process that was to serve its timed calls and timed
itself instead refused (a tampering); and, where it serves (issue 40), the kernel timed from
outside its process: one session of timed calls per benchmark case (timed_calls.Driver), each
call on data generate_input made here from a secret variant of the case's seed, a random
quarter checked with check_implementation, each case's time bounded by this process's clock
(time_bound.decide; docs/TRUST.md "GPU MODE tasks, timed from outside").

Methods of a class between the case machinery they use (gpumode.py's _GpuModeRun: _generate,
_judge, _side, _speedups) and the judge's verdict (gpumode_judge.py's _GpuModeJudge, which
calls them once the cases are judged).
"""

from __future__ import annotations

import json
import random
import secrets
from typing import Any

import torch
from kerneleval.v1 import job_pb2, kernel_pb2

from . import record, tamper, time_bound, timed_calls, timing
from .backends import gpumode as backend
from .gpumode import GENERATE, REF_KERNEL, _GpuModeRun, geometric_means
from .gpumode_cases import VARIANT_SEED_MASK, Case, seed_globals
from .gpumode_nest import Unshared, clone, rebuild, share_layout, unshared_reason
from .inputs import TrialArgs, mix_seed

MAX_VARIANT_DRAWS = 8  # a variant whose layout differs from the session's is drawn again


def _signature(leaves: list[Any], tree: Any) -> tuple[Any, ...]:
    """What must not change from one call's data to the next in a session: the nest, the
    scalars, each tensor's shape, dtype and device."""
    return (json.dumps(tree), *(
        ("T", tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor)
        else ("V", type(v).__name__, v)
        for v in leaves
    ))  # fmt: skip


def _leaf_args(leaves: list[Any]) -> TrialArgs:
    """The leaves as the driver takes a call's arguments."""
    n = len(leaves)
    role = kernel_pb2.ARG_ROLE_INPUT
    return TrialArgs(list(leaves), [f"leaf {i}" for i in range(n)], [role] * n, [False] * n)


class _JudgeTiming(_GpuModeRun):
    """The judge's timing methods (_GpuModeJudge's; see the module's docstring)."""

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
            job._flag([decision.flag(case.label)])
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
            seed_globals(mix_seed(draw, 1) & VARIANT_SEED_MASK)
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
