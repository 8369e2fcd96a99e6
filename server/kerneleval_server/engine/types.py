"""The engine's seams (docs/INTERNALS.md): Reporter, EngineConfig, Outcome."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from kerneleval.v1 import job_pb2

from kerneleval_server.spec import validation

from .device import DeviceLimits


class Reporter(Protocol):
    def phase(self, phase: int) -> None: ...  # job_pb2.Phase; PROFILING may block

    # Optional: ask_ahead(phase) asks for a gated phase's grant before phase(phase) enters it.

    def progress(self, phase: int, done: int, total: int) -> None: ...

    def log(self, text: str) -> None: ...


@dataclass
class EngineConfig:
    work_dir: Path  # private and writable: sources, Triton files, extension builds
    # Re-checked before anything runs; KERNELEVAL_LIMIT_* variables match the front end's.
    limits: validation.Limits = field(default_factory=validation.Limits.from_env)
    # Pre-flight limits instead of the GPU's own (tests use fake ones; None asks the GPU).
    device_limits: DeviceLimits | None = None
    # A job process's way to have the service build a load_inline call (the arguments as
    # JSON -> an ExtensionBuilt, None when the service is gone); None: load_inline builds here.
    extension_builder: Callable[[str], Any] | None = None
    # A record.Recorder: the kernel's outputs go to the job's judge process (issue 13), which
    # then compares and times the reference; None: this process judges (no judge follows).
    recorder: Any = None
    # With a recorder: the reference is never built here, its judge runs it (a launch process
    # never loads a job's host code). The kernel's IOContract gives the inputs.
    reference_judged: bool = False
    # With a recorder: the kernel's timed calls are its judge's to drive and time, from a
    # process that never loads its code (timed_calls.py); this process serves them after its
    # outcome (Outcome.serve) instead of timing itself.
    timed_by_judge: bool = False


class PathMeasure(NamedTuple):
    """A judge's measure of what a call of no work costs its own process on its GPU
    (timed_calls.own_path_ns), for outputs of these sizes after this lead (the internal
    channel's PathMeasure)."""

    lead: str
    output_bytes: tuple[int, ...]
    ns: int


@dataclass
class Outcome:
    result: job_pb2.EvalResult
    context_poisoned: bool  # sticky CUDA error: the worker must exit after reporting
    # Peak device memory, where the engine knows better than torch's allocator; 0: the job
    # process reads the allocator's.
    peak_memory_bytes: int = 0
    # Device memory the engine made outside torch's allocator at most at once (a judge's
    # timed-call buffers: gigabytes where the inputs are): the job process adds it to the
    # peak it reports, as it does a record's shared bytes.
    outside_allocator_bytes: int = 0
    # The kernel checked, its timed calls its judge's (EngineConfig.timed_by_judge): serves
    # them on the record's socket (its descriptor the argument) until the judge stops it.
    serve: Callable[[int], None] | None = None
    # A judge's measures of its own path taken for this job: the front end keeps them for
    # the reference's next judges on the GPU (judge_job's `path_measures`).
    path_measures: list[PathMeasure] = field(default_factory=list)


class NullReporter:
    """Drops every event (the isolated child, scripts)."""

    def phase(self, phase: int) -> None:
        pass

    def progress(self, phase: int, done: int, total: int) -> None:
        pass

    def log(self, text: str) -> None:
        pass
