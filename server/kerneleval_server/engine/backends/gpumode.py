"""GPU MODE's format: a reference module (`generate_input`, `ref_kernel`, the judge
`check_implementation`) and a submission (`custom_kernel`), each imported with its own copy of
the task's shared modules (task.py, utils.py), so that the submission cannot change what the
reference's judge calls by patching a module they share."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kerneleval.v1 import kernel_pb2

from .. import loader
from .base import BuildContext
from .model import _extension_env  # load_inline without CUDA: recorded, runs as "cannot run"

DEFAULT_ENTRY_POINT = "custom_kernel"
REFERENCE_FUNCTIONS = ("generate_input", "ref_kernel", "check_implementation")

_counter = itertools.count()


@dataclass(frozen=True)
class GpuModeReference:
    module: Any
    generate_input: Callable[..., Any]
    ref_kernel: Callable[[Any], Any]
    check_implementation: Callable[[Any, Any], Any]


@dataclass(frozen=True)
class GpuModeSubmission:
    module: Any
    custom_kernel: Callable[[Any], Any]


def module_name(file_name: str) -> str:
    return file_name.removesuffix(".py")


class SharedModules:
    """Each side's own copies of the task's modules: while a side's code runs (`side`), its
    copies are the ones in sys.modules, so that an import inside a function finds them too;
    between, none is."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.copies: dict[str, dict[str, Any]] = {"reference": {}, "kernel": {}}

    @contextlib.contextmanager
    def side(self, role: str) -> Iterator[None]:
        mine = self.copies[role]
        self._drop()
        sys.modules.update(mine)
        try:
            yield
        finally:
            mine.clear()
            mine.update({n: sys.modules[n] for n in self.names if n in sys.modules})
            self._drop()

    def _drop(self) -> None:
        for n in self.names:
            sys.modules.pop(n, None)


@contextlib.contextmanager
def shared_modules(
    work_dir: Path, files: Sequence[kernel_pb2.SourceFile]
) -> Iterator[SharedModules]:
    """The task's modules, importable by name (`from utils import ...`) for the whole job;
    afterwards gone from sys.path and sys.modules, and any module of the worker that had one
    of their names is back."""
    folder = work_dir / "gpumode" / f"{os.getpid()}_{next(_counter)}"
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f.name).write_text(f.content)
    names = [module_name(f.name) for f in files]
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    modules = SharedModules(names)
    try:
        yield modules
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))
        modules._drop()
        sys.modules.update(saved)


def build_reference(k: kernel_pb2.KernelSource, ctx: BuildContext) -> GpuModeReference:
    module = loader.import_source(ctx.work_dir, "reference", k.source_code)
    ctx.source_files.append(str(module.__file__))
    generate_input, ref_kernel, check = (
        loader.find_function(module, name) for name in REFERENCE_FUNCTIONS
    )
    return GpuModeReference(module, generate_input, ref_kernel, check)


def build_submission(k: kernel_pb2.KernelSource, ctx: BuildContext) -> GpuModeSubmission:
    with _extension_env(ctx, k.type):
        module = loader.import_source(ctx.work_dir, "kernel", k.source_code)
    ctx.source_files.append(str(module.__file__))
    return GpuModeSubmission(
        module, loader.find_function(module, k.entry_point or DEFAULT_ENTRY_POINT)
    )
