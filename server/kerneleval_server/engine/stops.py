"""How a job stops early, and how what stopped it becomes its verdict: the engine's stop
exceptions, the reporter that tells the reporter's own failures apart, and the verdicts of a
failed build, an unexpected error or an invalid spec. Shared by the paths that run a job
(runner.py and its job's classes, gpumode.py, judge.py, build.py), below all of them."""

from __future__ import annotations

import traceback
from collections.abc import Callable

from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.spec import validation

from . import errors, loader, preflight
from .backends import BuildContext, NoDeviceError
from .types import EngineConfig, Reporter


class Stop(Exception):
    """Ends the job early with the result as filled so far (its verdict filled in first)."""


class Abandoned(Stop):
    """The job left this process before it had anything to judge (a judge started ahead):
    the one stop with no verdict, which is not this process's to give."""


class ReporterError(Exception):
    """The reporter failed (e.g. the job was cancelled): not the kernel's doing, re-raised."""


class SafeReporter:
    def __init__(self, inner: Reporter) -> None:
        self.inner = inner

    def _call(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:
            raise ReporterError() from e

    def phase(self, phase: int) -> None:
        self._call(lambda: self.inner.phase(phase))

    def ask_ahead(self, phase: int) -> None:
        ask = getattr(self.inner, "ask_ahead", None)
        if ask is not None:
            self._call(lambda: ask(phase))

    def drive_kernel(self) -> None:
        """A judge's timing of its kernel's calls: a timing window in which the kernel's
        process runs beside it (a reporter without it: the plain timing phase)."""
        drive = getattr(self.inner, "drive_kernel", None)
        if drive is not None:
            self._call(drive)
        else:
            self._call(lambda: self.inner.phase(job_pb2.PHASE_PROFILING))

    def progress(self, phase: int, done: int, total: int) -> None:
        self._call(lambda: self.inner.progress(phase, done, total))

    def log(self, text: str) -> None:
        self._call(lambda: self.inner.log(text))


def _raised_by(e: BaseException, files_of: dict[str, job_pb2.Side]) -> job_pb2.Side:
    """The side whose source file holds the innermost frame of `e`'s traceback that is in
    one (SIDE_UNSPECIFIED: none is)."""
    frames = traceback.extract_tb(e.__traceback__)
    for frame in reversed(frames):
        side = files_of.get(frame.filename)
        if side is not None:
            return side
    return job_pb2.SIDE_UNSPECIFIED


def stopped_by_a_source(
    result: job_pb2.EvalResult, e: BaseException, files_of: dict[str, job_pb2.Side]
) -> None:
    """The engine's stop reached run_job without a verdict: the engine fills one in before
    every stop of its own, so a source's code raised it (it can import the engine). A
    failure of that source (of the kernel, when no frame says which)."""
    side = _raised_by(e, files_of) or job_pb2.SIDE_KERNEL
    who = "the reference's" if side == job_pb2.SIDE_REFERENCE else "the kernel's"
    result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
    result.failed_side = side
    result.error.CopyFrom(
        job_pb2.ErrorInfo(
            message=f"{who} code raised the engine's own stop exception before any verdict",
            exception_type=type(e).__name__,
            traceback=traceback.format_exc()[-8000:],
        )
    )


def unexpected_error(
    result: job_pb2.EvalResult, e: BaseException, files_of: dict[str, job_pb2.Side]
) -> None:
    """An exception outside a source's guarded code: the memory or the device ran out or
    failed (their verdicts), a source's object raised inside the engine (a tensor subclass,
    an output's method: a failure of that source), else a bug in the engine."""
    f = errors.classify(e, tuple(files_of))
    if f.verdict in (
        job_pb2.VERDICT_OUT_OF_MEMORY,
        job_pb2.VERDICT_DEVICE_FAULT,
        job_pb2.VERDICT_RESOURCE_LIMIT,
        job_pb2.VERDICT_CANNOT_RUN_HERE,
    ):
        result.verdict = f.verdict
        result.error.CopyFrom(f.error)
        return
    side = _raised_by(e, files_of)
    if side == job_pb2.SIDE_UNSPECIFIED:
        internal_error(result, e)
        return
    who = "reference's" if side == job_pb2.SIDE_REFERENCE else "kernel's"
    result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
    result.failed_side = side
    f.error.message = f"the {who} code raised inside the engine: {type(e).__name__}: {e}"[:8000]
    result.error.CopyFrom(f.error)


def internal_error(result: job_pb2.EvalResult, e: BaseException) -> None:
    result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
    result.error.CopyFrom(
        job_pb2.ErrorInfo(
            message=f"internal engine error: {e}",
            exception_type=type(e).__name__,
            traceback=traceback.format_exc()[-8000:],
        )
    )


def invalid_spec(
    spec: kernel_pb2.JobSpec, config: EngineConfig, result: job_pb2.EvalResult
) -> bool:
    """Re-checks the spec against config.limits; fills result and returns True when invalid."""
    violations = validation.validate_spec(spec, config.limits)
    if not violations:
        return False
    result.verdict = job_pb2.VERDICT_RUNTIME_ERROR
    result.error.exception_type = "InvalidArgument"
    result.error.message = "invalid job: " + "; ".join(
        f"{v.field}: {v.description}" for v in violations
    )
    return True


REFERENCE_PREFIX = "reference: "


def side_of(who: str) -> job_pb2.Side:
    """The source a message prefix speaks of: "" is the kernel, "reference: ..." the
    reference; anything else (the service's own steps) neither."""
    if who == "":
        return job_pb2.SIDE_KERNEL
    if who.startswith(REFERENCE_PREFIX):
        return job_pb2.SIDE_REFERENCE
    return job_pb2.SIDE_UNSPECIFIED


def set_compiled(result: job_pb2.EvalResult, side: job_pb2.Side, compiled: bool) -> None:
    """`compiled` is the kernel's: a failure of the reference leaves it as it was."""
    if side == job_pb2.SIDE_KERNEL:
        result.compiled = compiled


def build_failure(
    e: BaseException,
    who: str,
    result: job_pb2.EvalResult,
    ctx: BuildContext,
    notes: list[str],
) -> bool:
    """Fills result for an exception raised while a source was imported or compiled (here or
    in a build process); returns whether the CUDA context is now poisoned."""
    side = side_of(who)
    result.failed_side = side
    if isinstance(e, loader.CompileError) and errors.needs_missing_cuda(str(e)):
        set_compiled(result, side, False)
        result.verdict = job_pb2.VERDICT_CANNOT_RUN_HERE
        result.error.message = who + str(e)[:8000]
        result.error.exception_type = "NoDeviceError"
        notes.append("no CUDA on this worker: the source asked for it while it was imported")
    elif isinstance(e, loader.CompileError):
        result.verdict = job_pb2.VERDICT_COMPILE_ERROR
        set_compiled(result, side, False)
        log = e.log if e.log != str(e) else ""
        result.compilation_error = (who + str(e) + ("\n" + log if log else ""))[-32000:]
    elif isinstance(e, NoDeviceError):
        cannot_run_here(result, e, who, notes)
        notes.extend(ctx.notes)
    elif isinstance(e, preflight.ResourceLimitError):
        resource_limit(result, who + str(e), side)
    elif type(e).__name__ == "CompilationError":  # Triton's
        result.verdict = job_pb2.VERDICT_COMPILE_ERROR
        set_compiled(result, side, False)
        result.compilation_error = who + str(e)[-32000:]
    else:
        set_compiled(result, side, True)
        f = errors.classify(e, tuple(ctx.source_files))
        result.verdict = f.verdict
        f.error.message = who + f.error.message
        result.error.CopyFrom(f.error)
        return f.context_poisoned
    return False


def cannot_run_here(
    result: job_pb2.EvalResult, e: NoDeviceError, who: str, notes: list[str]
) -> None:
    """A source that needs a GPU on a host without one: its own verdict, not a crash."""
    side = side_of(who)
    result.failed_side = side
    result.verdict = job_pb2.VERDICT_CANNOT_RUN_HERE
    set_compiled(result, side, e.compiled)
    result.error.message = who + str(e)
    result.error.exception_type = "NoDeviceError"
    whose = "the reference" if side == job_pb2.SIDE_REFERENCE else "the kernel"
    if e.compiled:
        notes.append(f"no CUDA device on this worker: {whose} compiled but cannot run")
    else:
        notes.append(f"no CUDA on this worker: {whose}'s CUDA sources were not compiled")


def resource_limit(
    result: job_pb2.EvalResult, message: str, side: job_pb2.Side = job_pb2.SIDE_KERNEL
) -> None:
    set_compiled(result, side, True)
    result.failed_side = side
    result.verdict = job_pb2.VERDICT_RESOURCE_LIMIT
    result.error.message = message
    result.error.exception_type = "ResourceLimit"
