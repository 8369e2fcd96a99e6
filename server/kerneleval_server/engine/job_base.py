"""What every step of a job in the kernel's process stands on: the job's state (its spec,
options, device, result and notes; where its outputs are judged and its time taken), the guard a
source's code runs in, which turns whatever that code raises into the job's verdict, and the
verdict's helpers (`_fail`, `_tampered`, `_flag`).

runner.py's _Job is built on four classes, one concern a module, each on the one below it and
importing only that one: _JobBase here; job_correctness.py's _JobCorrectness (the correctness
trials and the outputs recorded for a judge); job_timing.py's _JobTiming (the timing); runner.py's
_Job (the steps: the build, the inputs, then those). judge.py's _Judge is a _Job.
tamper.check_timers reports an instance attribute that hides a method of any of them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from . import device, errors, loader, precision, preflight
from .backends import NoDeviceError, Program
from .inputs import TrialArgs, seed_all
from .options import Options
from .stops import ReporterError as _ReporterError
from .stops import SafeReporter as _SafeReporter
from .stops import Stop as _Stop
from .stops import cannot_run_here, set_compiled, side_of
from .stops import resource_limit as _resource_limit
from .types import EngineConfig


class _JobBase:
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

    def _timed_by_judge(self) -> bool:
        """The judge drives and times the kernel's calls (EngineConfig.timed_by_judge):
        only while its outputs reach the judge (a full record: it judges and times itself)."""
        return self.config.timed_by_judge and self.judged_elsewhere

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

    def _flag(self, flags: list[job_pb2.IntegrityFlag]) -> None:
        """Runtime integrity flags, each rule once (the first trial that shows it)."""
        seen = {f.rule_id for f in self.result.flags}
        for f in flags:
            if f.rule_id not in seen:
                seen.add(f.rule_id)
                self.result.flags.append(f)
                self.notes.append(f"integrity flag {f.rule_id}: {f.message}")

    def _tampered(self, message: str, who: str = "") -> NoReturn:
        """Ends the job VERDICT_RUNTIME_ERROR for tampering (`message` says what), blamed on
        the source `who` names (the kernel by default)."""
        self.result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
        self.result.failed_side = side_of(who)
        self.result.error.CopyFrom(job_pb2.ErrorInfo(message=message, exception_type="Tampering"))
        raise _Stop
