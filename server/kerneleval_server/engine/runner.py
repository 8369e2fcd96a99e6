"""run_job: compile, check and time one JobSpec, reporting phases as it goes.

Defaults (EvalOptions fields left unset): correct_trial_count 5, perf_trial_count 100 (0 skips
timing), warmup_count 10, atol/rtol 1e-4 for float32/float64 and 1e-2 for float16/bfloat16,
exact for integers and booleans, seed 42, flush_l2 true, check_precision true,
compile_baseline false. The timeout
(120 s) is enforced by the front end, which kills the worker.

Compare runs `correct_trial_count` trials on fresh inputs; trial 0 (and every even trial) runs
the candidate before the reference. Evaluate runs the kernel once (nothing is checked:
correctness_status NOT_CHECKED), then times it. An INCORRECT kernel is not timed. GPU_MODE
jobs follow GPU MODE's harness instead (gpumode.py).

Every failure says whose it is (EvalResult.failed_side): the kernel's, or the reference's
(its source, the inputs it provides, its run); a kernel that needs a GPU this host lacks ends
VERDICT_CANNOT_RUN_HERE, `compiled` saying whether its sources were compiled.

The job is _Job. Its steps are here (`run`: the build, the inputs, then the checks and the
timing); what they call is in the classes it is built on, one concern a module: job_timing.py's
_JobTiming (the timing), job_correctness.py's _JobCorrectness (the correctness trials, the
outputs recorded for a judge), job_base.py's _JobBase (the job's state, the guard a source's
code runs in).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from . import compare, device, errors, gpumode, loader
from .backends import BuildContext, Program, build, is_triton_launch
from .backends.base import LaunchProgram
from .backends.model import to_device
from .backends.prebuilt import build_prebuilt
from .backends.triton_launch import TritonLaunch
from .inputs import FORWARD, TrialArgs, build_args, mix_seed, seed_all
from .job_timing import _JobTiming
from .options import Options
from .stops import (
    REFERENCE_PREFIX,
    build_failure,
    invalid_spec,
    stopped_by_a_source,
    unexpected_error,
)
from .stops import ReporterError as _ReporterError
from .stops import SafeReporter as _SafeReporter
from .stops import Stop as _Stop
from .types import EngineConfig, Outcome, Reporter


def run_job(
    spec: kernel_pb2.JobSpec,
    reporter: Reporter,
    config: EngineConfig,
    prebuilt: Sequence[job_channel_pb2.KernelArtifact] = (),
) -> Outcome:
    """Evaluates (no reference) or compares (reference set) one job; never raises for anything
    the kernel does: every failure is a verdict in the returned Outcome.

    `prebuilt`: kernels a build process compiled (build_job); a source with an artifact of its
    role is neither imported nor compiled here, its cubin is launched."""
    from . import isolated

    job = _Job(spec, _SafeReporter(reporter), config, prebuilt)
    try:
        if job.prebuilt:
            # The debug aids run the job in a child that imports the sources: not for
            # kernels launched from what a build process made.
            o = spec.options
            if o.launch_blocking or o.device_side_assertions or o.sanitize or o.device_metrics:
                job.notes.append("debug aids are not applied to kernels built ahead")
        else:
            isolated_outcome = isolated.maybe_run_isolated(spec, config, job.result, job.reporter)
            if isolated_outcome is not None:
                return isolated_outcome
        with preserved_torch_state(), loader.forgetting_modules():
            job.run()
    except _Stop as e:
        if not job.result.verdict:  # the engine says why before it stops; a source did not
            stopped_by_a_source(job.result, e, job.files_of)
    except _ReporterError as e:
        raise (e.__cause__ or e) from None
    except Exception as e:  # a source's object, the memory, or a bug in the engine
        unexpected_error(job.result, e, job.files_of)
        job.poisoned = job.poisoned or errors.context_dead()
    if job.notes:
        job.result.notes.extend(job.notes)
    outcome = Outcome(result=job.result, context_poisoned=job.poisoned)
    serve = job.serve_timed_calls if job.serves is not None else job.serves_cases
    if serve is not None and job.result.verdict == job_pb2.VERDICT_OK and not job.poisoned:
        outcome.serve = serve
    return outcome


@contextlib.contextmanager
def preserved_torch_state() -> Iterator[None]:
    """Global settings a kernel may change (TF32, cuDNN, default dtype) are restored after the
    job, so they do not leak into the next job of this worker."""
    cuda_matmul = torch.backends.cuda.matmul
    cudnn = torch.backends.cudnn
    saved = (
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
        cuda_matmul.allow_tf32,
        cuda_matmul.allow_fp16_reduced_precision_reduction,
        cudnn.allow_tf32,
        cudnn.benchmark,
        cudnn.deterministic,
    )
    try:
        yield
    finally:
        torch.set_default_dtype(saved[0])
        torch.set_float32_matmul_precision(saved[1])
        cuda_matmul.allow_tf32 = saved[2]
        cuda_matmul.allow_fp16_reduced_precision_reduction = saved[3]
        cudnn.allow_tf32, cudnn.benchmark, cudnn.deterministic = saved[4:]


class _Job(_JobTiming):
    """A job in the kernel's process (judge.py's _Judge, in its judge's): what it runs, in
    order, and what it runs first, its build and its inputs."""

    # -- the steps -----------------------------------------------------------------------
    def run(self) -> None:
        if invalid_spec(self.spec, self.config, self.result):
            raise _Stop
        if self.reference_judged and (self.recorder is None or not self.spec.kernel.io.args):
            raise RuntimeError("reference_judged needs a recorder and the kernel's IOContract")
        self.reporter.phase(job_pb2.PHASE_COMPILING)
        ctx = self._context()
        if self.spec.kernel.type == kernel_pb2.KERNEL_TYPE_GPU_MODE:
            gpumode.run(self, ctx)
            return
        cand = self._build(self.spec.kernel, "kernel", ctx)
        self.result.compiled = True
        # The candidate's own code has run (its import, its build): what is left before its
        # checks (the reference's import, the inputs) is short. The GPU's grant for them is
        # asked for now, and comes while that runs (a round trip saved).
        self.reporter.ask_ahead(job_pb2.PHASE_VALIDATING)
        ref = None
        if self.compare_mode and not self.reference_judged:
            ref = self._build(self.spec.reference, "reference", ctx)
        self.notes.extend(ctx.notes)
        self.source_files = tuple(ctx.source_files)
        make_args = self._input_source(cand, ref)
        self._preflight_triton(cand, ref, make_args, ctx)

        self.reporter.phase(job_pb2.PHASE_VALIDATING)
        if self.reference_judged:
            self._record_trials(cand, make_args)
        elif ref is None:
            self._run_once(cand, make_args)
        else:
            self._validate(cand, ref, make_args)
        if self.opts.compile_baseline and not self.compare_mode:
            self.notes.append("compile_baseline: no reference to compile (Evaluate)")
        if self.opts.perf_trials > 0 and self._timed_by_judge():
            self._refuse_rewritten_timers()
            self.serves = cand  # timed after the outcome, by the judge (serve_timed_calls)
        elif self.opts.perf_trials > 0:
            self._time(cand, ref, make_args)
        else:
            self.notes.append("perf_trial_count is 0: not timed")
        self.result.verdict = job_pb2.VERDICT_OK

    def _context(self) -> BuildContext:
        limits = self.config.device_limits or device.gpu_limits()
        return BuildContext(
            work_dir=self.config.work_dir,
            seed=self.opts.seed,
            device=self.dev,
            limits=limits,
            log=self.reporter.log,
            extension_builder=self.config.extension_builder,
        )

    def _build(self, k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> Program:
        who = "" if role == "kernel" else REFERENCE_PREFIX
        before = len(ctx.source_files)
        try:
            with self._cpu_shim():
                artifact = self.prebuilt.get(role)
                if artifact is not None:  # compiled by a build process: nothing to import
                    return build_prebuilt(artifact, k, ctx)
                return build(k, role, ctx)
        except (_Stop, _ReporterError, KeyboardInterrupt):
            raise
        except BaseException as e:
            poisoned = build_failure(e, who, self.result, ctx, self.notes)
            self.poisoned = self.poisoned or poisoned
        finally:
            side = job_pb2.SIDE_KERNEL if role == "kernel" else job_pb2.SIDE_REFERENCE
            for path in ctx.source_files[before:]:
                self.files_of.setdefault(path, side)
        raise _Stop

    # -- inputs --------------------------------------------------------------------------
    def _input_source(self, cand: Program, ref: Program | None) -> Callable[[int], TrialArgs]:
        io = None
        io_side = job_pb2.SIDE_KERNEL
        if len(self.spec.kernel.io.args) > 0:
            io = self.spec.kernel.io
        elif ref is not None and len(self.spec.reference.io.args) > 0:
            io, io_side = self.spec.reference.io, job_pb2.SIDE_REFERENCE
        if io is not None:
            contract = io
            seed = self.opts.seed

            def from_contract(trial: int) -> TrialArgs:
                with self._guard("inputs: ", io_side):
                    args = build_args(contract, seed, trial, self.dev)
                    args.seed = mix_seed(seed, trial, FORWARD)
                    return args
                raise AssertionError("unreachable")

            return from_contract
        # The inputs are the reference's to give (the kernel's only when there is none).
        module = ref.module if ref is not None else cand.module
        self.inputs_side = job_pb2.SIDE_REFERENCE if ref is not None else job_pb2.SIDE_KERNEL
        get_inputs = getattr(module, "get_inputs", None)
        if not callable(get_inputs):
            self._no_get_inputs(cand, ref)

        def from_get_inputs(trial: int) -> TrialArgs:
            with self._guard("get_inputs(): ", self.inputs_side), torch.device(self.dev):
                # Factory calls default to the device: KernelBench's torch.rand(4096, 393216)
                # takes 20 s on the host and milliseconds on an H200.
                seed_all(mix_seed(self.opts.seed, trial))
                values = [to_device(v, self.dev) for v in get_inputs()]
            self._check_input_size(values)
            n = len(values)
            roles = [int(kernel_pb2.ARG_ROLE_INPUT)] * n
            return TrialArgs(
                values, [f"input[{i}]" for i in range(n)], roles, [False] * n, True,
                seed=mix_seed(self.opts.seed, trial, FORWARD),
            )  # fmt: skip

        return from_get_inputs

    def _no_get_inputs(self, cand: Program, ref: Program | None) -> NoReturn:
        """Ends the job: the source that gives the inputs lacks get_inputs()."""
        self.result.verdict = job_pb2.VERDICT_COMPILE_ERROR
        self.result.failed_side = self.inputs_side
        if ref is None:
            self.result.compiled = False
            self.result.compilation_error = (
                "no function get_inputs() in the source and no IOContract args: the inputs "
                "are unknown"
            )
            raise _Stop
        hint = ""
        if callable(getattr(cand.module, "get_inputs", None)):
            hint = (
                " (the kernel's source defines get_inputs(): are the kernel and the reference "
                "swapped?)"
            )
        self.result.compilation_error = (
            "reference: no function get_inputs() in the reference and no IOContract args: the "
            "inputs are unknown" + hint
        )
        raise _Stop

    def _check_input_size(self, values: list[Any]) -> None:
        """get_inputs() sizes are only known once it ran: hold them to the same byte limit."""
        total = compare.nbytes_of(values)
        limit = self.config.limits.max_total_tensor_bytes
        if total > limit:
            self.result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
            self.result.failed_side = self.inputs_side
            self.result.error.exception_type = "InvalidArgument"
            self.result.error.message = (
                f"get_inputs() made {total} bytes of tensors, over the limit of {limit} bytes: "
                "give smaller shapes through the IOContract"
            )
            raise _Stop

    def _preflight_triton(
        self,
        cand: Program,
        ref: Program | None,
        make_args: Callable[[int], TrialArgs],
        ctx: BuildContext,
    ) -> None:
        for prog, who in ((cand, ""), (ref, REFERENCE_PREFIX)):
            launch = getattr(prog, "launch", None)
            if isinstance(launch, TritonLaunch) and self.dev.type == "cuda":
                with self._guard(who):
                    launch.compile_and_check(make_args(0), ctx)


Job = _Job  # its public name (judge.py's _Judge is one)

__all__ = ["LaunchProgram", "Options", "is_triton_launch", "run_job"]
