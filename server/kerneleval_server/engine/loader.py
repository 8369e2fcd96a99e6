"""Writes a kernel's source into the work folder and imports it (Triton needs a real file to
read its kernels' source), then finds the entry point."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import itertools
import os
import sys
import traceback
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

_counter = itertools.count()


_loaded: list[str] = []


@contextlib.contextmanager
def forgetting_modules() -> Iterator[None]:
    """Drops the job's modules from sys.modules afterwards, so that what they hold (weights,
    cached tensors) is freed rather than kept for the worker's lifetime."""
    start = len(_loaded)
    try:
        yield
    finally:
        for name in _loaded[start:]:
            sys.modules.pop(name, None)
        del _loaded[start:]


class CompileError(Exception):
    """The source did not build or lacks its entry point; the message is for the user."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log or message


def write_source(work_dir: Path, role: str, source: str, suffix: str = ".py") -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    folder = work_dir / "sources"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ke_{role}_{os.getpid()}_{next(_counter)}_{digest}{suffix}"
    path.write_text(source)
    return path


def import_source(work_dir: Path, role: str, source: str) -> types.ModuleType:
    """Imports the source as a fresh module; any failure is a CompileError with the traceback."""
    path = write_source(work_dir, role, source)
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton and dataclasses look modules up by name
    _loaded.append(name)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        text = (e.text or "").rstrip()
        raise CompileError(f"syntax error at {where}: {e.msg}\n{text}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit from the source is a failed import too
        sys.modules.pop(name, None)
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        raise _import_failure(e, tb) from None
    return module


def _import_failure(e: BaseException, tb: str) -> Exception:
    """Build failures of load_inline carry the compiler log; anything else keeps its traceback.
    CUDA errors and OOM raised at import time are returned as-is for the caller to classify."""
    msg = str(e)
    if "Error building extension" in msg or "ninja" in msg.lower():
        return CompileError(f"building the CUDA extension failed: {msg[:4000]}", tb)
    from .errors import find_cuda_error

    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or find_cuda_error(msg):
        return e if isinstance(e, Exception) else RuntimeError(msg)
    return CompileError(f"importing the source raised {type(e).__name__}: {msg[:4000]}", tb)


def find_class(module: types.ModuleType, entry_point: str, defaults: tuple[str, ...]) -> type:
    names = (entry_point,) if entry_point else defaults
    for n in names:
        obj = getattr(module, n, None)
        if isinstance(obj, type):
            return obj
        if obj is not None:
            raise CompileError(f"{n} in the source is a {type(obj).__name__}, not a class")
    raise CompileError(f"no class {' or '.join(names)} in the source")


def find_function(module: types.ModuleType, name: str) -> Any:
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise CompileError(f"no function {name}() in the source")
    return fn


def triton_kernels(module: types.ModuleType) -> dict[str, Any]:
    """The @triton.jit (and autotuned/heuristics) kernels defined in the module itself."""
    from triton.runtime.jit import JITFunction, KernelInterface

    out: dict[str, Any] = {}
    for name, obj in vars(module).items():
        if isinstance(obj, KernelInterface):
            base = obj
            while not isinstance(base, JITFunction) and hasattr(base, "fn"):
                base = base.fn
            if getattr(getattr(base, "fn", None), "__module__", module.__name__) == module.__name__:
                out[name] = obj
    return out


def find_triton_kernel(module: types.ModuleType, entry_point: str) -> Any:
    kernels = triton_kernels(module)
    if entry_point:
        if entry_point not in kernels:
            raise CompileError(f"no @triton.jit function {entry_point} in the source")
        return kernels[entry_point]
    if not kernels:
        raise CompileError("no @triton.jit function in the source")
    if len(kernels) > 1:
        raise CompileError(
            f"the source defines {len(kernels)} @triton.jit functions ({', '.join(kernels)}): "
            "set entry_point to the one to launch"
        )
    return next(iter(kernels.values()))


def signature_names(fn: Any) -> list[str]:
    base = fn
    while hasattr(base, "fn") and not inspect.isfunction(base):
        base = base.fn
    return list(inspect.signature(base).parameters)


@contextlib.contextmanager
def cpu_as_device(force: bool = False) -> Iterator[None]:
    """Without a GPU, KernelBench sources that call .cuda() or check .is_cuda run on the CPU
    unchanged: .cuda() returns the CPU tensor or module and is_cuda reads True. `force`: the
    caller knows there is no GPU (CUDA is not asked)."""
    if not force and torch.cuda.is_available():
        yield
        return
    saved = (torch.Tensor.cuda, torch.nn.Module.cuda, torch.Tensor.__dict__.get("is_cuda"))

    def tensor_cuda(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        return self

    def module_cuda(self: torch.nn.Module, *a: Any, **k: Any) -> torch.nn.Module:
        return self

    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign,assignment]
    torch.nn.Module.cuda = module_cuda  # type: ignore[method-assign,assignment]
    torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved[0]  # type: ignore[method-assign]
        torch.nn.Module.cuda = saved[1]  # type: ignore[method-assign]
        if saved[2] is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = saved[2]
