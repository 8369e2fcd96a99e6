"""TORCH, TORCH_CUDA and TRITON-with-ModelNew sources: import, find the class, construct it
with get_init_inputs() seeded as KernelBench does, move it to the device."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from kerneleval.v1 import kernel_pb2

from .. import loader
from ..inputs import seed_all
from .base import BuildContext, ModelProgram, NoDeviceError


def build_model(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> ModelProgram:
    defaults = ("ModelNew", "Model")
    with _extension_env(ctx, k.type):
        module = loader.import_source(ctx.work_dir, role, k.source_code)
    ctx.source_files.append(str(module.__file__))
    cls = loader.find_class(module, k.entry_point, defaults)
    init_inputs: list[Any] = []
    get_init = getattr(module, "get_init_inputs", None)
    with loader.cpu_as_device():
        if callable(get_init):
            seed_all(ctx.seed)
            init_inputs = list(get_init())
        init_inputs = [to_device(v, ctx.device) for v in init_inputs]
        # Seeded right before construction so Model and ModelNew get the same weights.
        seed_all(ctx.seed)
        instance = cls(*init_inputs)
    if isinstance(instance, torch.nn.Module):
        instance = instance.to(ctx.device)
    return ModelProgram(instance=instance, module=module)


def to_device(v: Any, device: torch.device) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, (list, tuple)):
        return type(v)(to_device(x, device) for x in v)
    return v


@contextlib.contextmanager
def _extension_env(ctx: BuildContext, kind: int) -> Iterator[None]:
    """load_inline builds into the job's work folder; without CUDA in torch it is recorded
    and replaced by a module whose functions say that they cannot run here."""
    ext_dir = ctx.work_dir / "torch_extensions"
    ext_dir.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    import torch.utils.cpp_extension as cpp_ext

    real = cpp_ext.load_inline
    cuda_build = torch.version.cuda is not None and torch.cuda.is_available()
    if ctx.extension_builder is not None:
        cpp_ext.load_inline = _service_load_inline(ctx, real, ext_dir, cuda_build)
    elif not cuda_build:
        cpp_ext.load_inline = _no_cuda_load_inline(ctx)
    try:
        yield
    finally:
        cpp_ext.load_inline = real
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved


def _service_load_inline(ctx: BuildContext, real: Any, ext_dir: Path, cuda_build: bool) -> Any:
    """load_inline through the service (fast_build/extension.py): the service builds the call in
    a build process, or takes it from its build cache, and sends the library; it is imported
    as torch would import its own build. A call the service does not take builds here."""
    no_cuda = _no_cuda_load_inline(ctx)

    def load_inline(*args: Any, **kwargs: Any) -> Any:
        from kerneleval_server.fast_build import extension

        try:
            call = extension.normalize_call(real, args, kwargs)
        except (ValueError, TypeError):
            return real(*args, **kwargs)  # torch says what is wrong with the call
        if call.get("cuda_sources") and not cuda_build:
            return no_cuda(*args, **kwargs)
        answer = ctx.extension_builder(json.dumps(call, sort_keys=True))
        if answer is None or answer.build_here:
            return real(*args, **kwargs)
        name = call["name"]
        took = answer.build_time.ToNanoseconds() / 1e9
        how = "from the build cache" if answer.cache_hit else f"built in {took:.1f} s"
        ctx.log(f"load_inline({name!r}): {how}" + (" (fast build)" if answer.fast else ""))
        if answer.error:
            if answer.log:
                ctx.log(answer.log)
            raise RuntimeError(answer.error)
        folder = ext_dir / f"{name}-{hashlib.sha256(answer.library).hexdigest()[:16]}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.so").write_bytes(answer.library)
        from torch.utils.cpp_extension import _import_module_from_library

        return _import_module_from_library(name, str(folder), call.get("is_python_module", True))

    return load_inline


def _no_cuda_load_inline(ctx: BuildContext) -> Any:
    def load_inline(name: str, *args: Any, **kwargs: Any) -> Any:
        cuda_sources = kwargs.get("cuda_sources") or (args[1] if len(args) > 1 else None)
        if not cuda_sources:
            from torch.utils.cpp_extension import load_inline as real  # a CPU extension builds

            return real(name, *args, **kwargs)
        ctx.notes.append(
            f"load_inline({name!r}) needs a CUDA build of torch and a GPU; this machine has "
            "neither, so its CUDA sources were not compiled and cannot run"
        )
        return _Unrunnable(name)

    return load_inline


class _Unrunnable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            raise NoDeviceError(
                f"no CUDA device: {self._name}.{attr} is a CUDA extension and cannot run here"
            )

        return call
