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
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from . import (
    compare,
    device,
    errors,
    gpumode,
    integrity,
    loader,
    precision,
    preflight,
    record,
    tamper,
    timed_calls,
    timing,
)  # fmt: skip
from .backends import BuildContext, NoDeviceError, Program, build, is_triton_launch
from .backends.base import LaunchProgram, ModelProgram
from .backends.model import to_device
from .backends.prebuilt import build_prebuilt
from .backends.triton_launch import TritonLaunch
from .inputs import FORWARD, TrialArgs, build_args, mix_seed, seed_all
from .options import Options
from .stops import (
    REFERENCE_PREFIX,
    build_failure,
    cannot_run_here,
    invalid_spec,
    set_compiled,
    side_of,
    stopped_by_a_source,
    unexpected_error,
)
from .stops import ReporterError as _ReporterError
from .stops import SafeReporter as _SafeReporter
from .stops import Stop as _Stop
from .stops import resource_limit as _resource_limit
from .types import EngineConfig, Outcome, Reporter

SUSPICIOUS_SPEEDUP = 10.0
CPU_TIMES_NOTE = (
    "timed on the CPU with the host's monotonic clock (no GPU): host wall-clock times, which "
    "other processes on its cores and the OS move; not comparable with GPU times"
)
_timing_measure = timing.measure  # bound at import, as _Job._measure's (tamper.py)


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


class _Job:
    def __init__(
        self,
        spec: kernel_pb2.JobSpec,
        reporter: _SafeReporter,
        config: EngineConfig,
        prebuilt: Sequence[job_channel_pb2.KernelArtifact] = (),
    ):
        self.spec = spec
        self.prebuilt = {a.role: a for a in prebuilt}
        self.reporter = reporter
        self.config = config
        self.result = job_pb2.EvalResult(device=device.device_info())
        self.poisoned = False
        self.notes: list[str] = []
        self.opts = Options.of(spec.options)
        self.dev = device.device()
        self.compare_mode = spec.HasField("reference")
        self.nvtx = os.environ.get("KERNELEVAL_NVTX") == "1"
        self._output_bytes = 0  # what the kernel must write: the memory-bandwidth floor
        self.inputs_side: job_pb2.Side = job_pb2.SIDE_KERNEL  # who gives get_inputs()
        self.recorder = config.recorder if self.compare_mode else None
        # A judge started ahead (judge.py): by trial, the pristine inputs, the reference's
        # copy of them, its outputs and its run's seconds, made before the kernel's were in.
        self.ahead: dict[int, tuple[TrialArgs, TrialArgs, list[Any], float]] = {}
        self.ahead_gold: precision.Gold | None = None  # and trial 0's float64 run
        # Each imported source file -> its side: whose code raised what reached run_job.
        self.files_of: dict[str, job_pb2.Side] = {}
        self.serves: Program | None = None  # the kernel, for its judge's timed calls
        # A GPU MODE job's server of its judge's timed calls, one session a case (gpumode.py)
        self.serves_cases: Callable[[int], None] | None = None

    @property
    def judged_elsewhere(self) -> bool:
        """The kernel's outputs are recorded for a judge process, which checks their
        precision and times the reference: not done twice here."""
        return self.recorder is not None and not self.recorder.full

    @property
    def reference_judged(self) -> bool:
        """The reference runs only in the judge (EngineConfig.reference_judged): this process
        records the kernel's outputs on the IOContract's inputs, and its judge compares."""
        return self.compare_mode and self.config.reference_judged

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

    def _refuse_rewritten_timers(
        self, timers_changed: Callable[..., list[str]] = tamper.check_timers
    ) -> None:
        """Before the judge times the kernel: what its code rewrote of the engine's timing
        so far ends the job as a tampering, as after its own timed trials (a defence that
        costs nothing; its time does not depend on it: the judge's bound does)."""
        changed = timers_changed(self)
        if changed:
            self._timer_tampered(changed, "")

    def _timed_by_judge(self) -> bool:
        """The judge drives and times the kernel's calls (EngineConfig.timed_by_judge):
        only while its outputs reach the judge (a full record: it judges and times itself)."""
        return self.config.timed_by_judge and self.judged_elsewhere

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

    def _fail(self, f: errors.Failure, who: str = "", side: job_pb2.Side | None = None) -> None:
        self.result.verdict = f.verdict
        self.result.failed_side = side_of(who) if side is None else side
        f.error.message = who + f.error.message
        self.result.error.CopyFrom(f.error)
        self.poisoned = self.poisoned or f.context_poisoned

    @contextlib.contextmanager
    def _guard(self, who: str = "", side: job_pb2.Side | None = None) -> Iterator[None]:
        """Runs a source's code: any exception becomes the job's verdict, blamed on `side`
        (by default the source `who` names: side_of)."""
        blamed = side_of(who) if side is None else side
        try:
            with self._cpu_shim(), torch.no_grad():  # inference, as KernelBench evaluates
                yield
        except (_Stop, _ReporterError, KeyboardInterrupt):
            raise
        except preflight.ResourceLimitError as e:
            _resource_limit(self.result, who + str(e), blamed)
            raise _Stop from None
        except NoDeviceError as e:
            cannot_run_here(self.result, e, who, self.notes)
            self.result.failed_side = blamed
            raise _Stop from None
        except BaseException as e:  # SystemExit from kernel code is its failure too
            if type(e).__name__ == "CompilationError":  # Triton compiles at the first launch
                set_compiled(self.result, blamed, False)
                self.result.failed_side = blamed
                self.result.verdict = job_pb2.VERDICT_COMPILE_ERROR
                self.result.compilation_error = who + str(e)[-32000:]
            else:
                self._fail(errors.classify(e, getattr(self, "source_files", ())), who, blamed)
            raise _Stop from None

    def _cpu_shim(self) -> contextlib.AbstractContextManager[None]:
        return loader.cpu_as_device() if self.dev.type == "cpu" else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

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

    # -- correctness ---------------------------------------------------------------------
    def _run(self, prog: Program, args: TrialArgs, who: str) -> list[Any]:
        with self._guard(who):
            if args.seed is not None:
                seed_all(args.seed)
            if self.nvtx and who == "":
                torch.cuda.nvtx.range_push("kerneleval_kernel")
            out = prog.run(args)
            self._sync()
            if self.nvtx and who == "":
                torch.cuda.nvtx.range_pop()
            return out
        raise AssertionError("unreachable")

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

    def _float64_run(
        self, ref: Program, pristine: TrialArgs, ref_out: list[Any], ref_seconds: float
    ) -> precision.Gold:
        with self._cpu_shim(), torch.no_grad():
            return precision.float64_run(
                getattr(ref, "instance", None), pristine.model_inputs(), ref_out,
                max_bytes=min(precision.MAX_BYTES, self.config.limits.max_total_tensor_bytes),
                device=self.dev, ref_seconds=ref_seconds, sync=self._sync,
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

    def _tampered(self, message: str, who: str = "") -> NoReturn:
        """Ends the job VERDICT_RUNTIME_ERROR for tampering (`message` says what), blamed on
        the source `who` names (the kernel by default)."""
        self.result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
        self.result.failed_side = side_of(who)
        self.result.error.CopyFrom(job_pb2.ErrorInfo(message=message, exception_type="Tampering"))
        raise _Stop

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

    def _flag(self, flags: list[job_pb2.IntegrityFlag]) -> None:
        """Runtime integrity flags, each rule once (the first trial that shows it)."""
        seen = {f.rule_id for f in self.result.flags}
        for f in flags:
            if f.rule_id not in seen:
                seen.add(f.rule_id)
                self.result.flags.append(f)
                self.notes.append(f"integrity flag {f.rule_id}: {f.message}")

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
        job: _Job,
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


Job = _Job  # its public name (judge.py's _Judge is one)

__all__ = ["LaunchProgram", "Options", "is_triton_launch", "run_job"]


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
