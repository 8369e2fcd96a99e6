"""What every backend builds: a Program that runs one trial's arguments and returns outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ..device import DeviceLimits
from ..inputs import TrialArgs


class NoDeviceError(RuntimeError):
    """The kernel cannot run on this machine: it has no GPU (or torch has no CUDA).
    `compiled`: its sources were compiled all the same (nvcc, a build process); the default
    False is for sources that were not (load_inline without a CUDA build of torch)."""

    def __init__(self, message: str, *, compiled: bool = False) -> None:
        super().__init__(message)
        self.compiled = compiled


@dataclass
class BuildContext:
    work_dir: Path
    seed: int
    device: torch.device
    limits: DeviceLimits | None  # None: no GPU and no fake limits, pre-flight is skipped
    log: Any  # Callable[[str], None]
    notes: list[str] = field(default_factory=list)
    source_files: list[str] = field(default_factory=list)
    extension_builder: Any = None  # EngineConfig.extension_builder


class Program(Protocol):
    kind: str  # "model": forward(*inputs) returns outputs; "launch": writes OUTPUT/INOUT args
    module: Any  # the imported module (get_inputs lives there), None for raw CUDA

    def run(self, args: TrialArgs) -> list[Any]: ...


def as_outputs(result: Any) -> list[Any]:
    """A forward's return value as a list of outputs."""
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


@dataclass
class ModelProgram:
    """A Model or ModelNew instance: KernelBench's format."""

    instance: Any
    module: Any
    kind: str = "model"

    def run(self, args: TrialArgs) -> list[Any]:
        return as_outputs(self.instance(*args.model_inputs()))


@dataclass
class LaunchProgram:
    """A kernel launched directly from the IOContract: outputs are its OUTPUT/INOUT args."""

    launch: Any  # Callable[[TrialArgs], None]
    module: Any = None
    kind: str = "launch"

    def run(self, args: TrialArgs) -> list[Any]:
        self.launch(args)
        return [args.values[i] for i in args.output_indices()]
