"""Launches a compiled cubin through the CUDA driver API (ctypes, no extra Python package) on
torch's current stream: raw CUDA kernels (grid, block and shared memory from the IOContract)
and Triton kernels compiled ahead of time (block = 32 * num_warps, Triton's shared memory,
and the scratch pointers Triton appends to every kernel's parameters)."""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..inputs import TrialArgs

ATTR_MAX_THREADS, ATTR_SHARED_SIZE, ATTR_NUM_REGS, ATTR_MAX_DYN_SHARED = 0, 1, 4, 8
DEFAULT_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in (MAX_DYNAMIC_SHARED_SIZE)


class CudaDriverError(RuntimeError):
    pass


class Driver:
    """The few driver API calls needed, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        u = ctypes.c_uint
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        self.lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(i), i, vp]
        self.lib.cuFuncSetAttribute.argtypes = [vp, i, i]
        self.lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), vp]
        self.lib.cuModuleUnload.argtypes = [vp]
        self.lib.cuGetErrorName.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuGetErrorString.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
        if hasattr(self.lib, "cuFuncGetParamInfo"):
            self.lib.cuFuncGetParamInfo.argtypes = [vp, sz, ctypes.POINTER(sz), ctypes.POINTER(sz)]

    def check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.lib.cuGetErrorName(rc, ctypes.byref(name))
        self.lib.cuGetErrorString(rc, ctypes.byref(text))
        raise CudaDriverError(
            f"CUDA error: {what}: {(name.value or b'?').decode()} ({rc}): "
            f"{(text.value or b'').decode()}"
        )

    def load(self, cubin: bytes) -> ctypes.c_void_p:
        module = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        return module

    def unload(self, module: ctypes.c_void_p) -> None:
        self.check(self.lib.cuModuleUnload(module), "cuModuleUnload")

    def function(self, module: ctypes.c_void_p, name: str) -> ctypes.c_void_p:
        func = ctypes.c_void_p()
        self.check(
            self.lib.cuModuleGetFunction(ctypes.byref(func), module, name.encode()),
            "cuModuleGetFunction",
        )
        return func

    def param_sizes(self, func: ctypes.c_void_p) -> list[int] | None:
        """Each parameter's size in bytes (cuFuncGetParamInfo, CUDA 12.4); None without it."""
        fn = getattr(self.lib, "cuFuncGetParamInfo", None)
        if fn is None:
            return None
        sizes: list[int] = []
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        while fn(func, len(sizes), ctypes.byref(offset), ctypes.byref(size)) == 0:
            sizes.append(size.value)
            if len(sizes) > 512:
                break
        return sizes

    def attribute(self, func: ctypes.c_void_p, attr: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, func), "cuFuncGetAttribute")
        return v.value

    def set_attribute(self, func: ctypes.c_void_p, attr: int, value: int, what: str) -> None:
        self.check(self.lib.cuFuncSetAttribute(func, attr, value), what)

    def launch(
        self,
        func: ctypes.c_void_p,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        stream: int,
        params: Any,  # void*[]: a pointer to each parameter's bytes
        what: str,
    ) -> None:
        rc = self.lib.cuLaunchKernel(func, *grid, *block, shared, stream, params, None)
        if rc != 0:
            self.check(rc, what)


@dataclass(frozen=True)
class Scratch:
    """A pointer parameter Triton appends (global scratch, then profile scratch): `size` bytes
    per program, NULL when 0."""

    size: int
    align: int


def current_stream() -> int:
    return int(torch.cuda.current_stream().cuda_stream)


def _unload(driver: Any, module: Any, synchronize: bool) -> None:
    """Unloads a module once its launcher is gone (a launch process runs many jobs), after
    the work queued with it finished; errors are ignored (a dead context goes with its
    process)."""
    try:
        if synchronize:
            torch.cuda.synchronize()
        unload = getattr(driver, "unload", None)
        if unload is not None:
            unload(module)
    except Exception:  # noqa: BLE001 - best effort: the process may be going down
        pass


def _make_current() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")  # makes torch's primary context current on this thread


class _Packed:
    """The kernelParams array for one set of argument values, kept with what it was made from
    (tensor addresses and scalar values) so that a later call can reuse it when they match."""

    def __init__(self, key: list[Any], holders: list[Any], scratch: list[Any]) -> None:
        self.key = key
        self.holders = holders  # ctypes values the array points into
        self.scratch = scratch  # scratch buffers (alive while the array is)
        self.params = (ctypes.c_void_p * max(1, len(holders)))(
            *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders]
        )


class CubinLaunch:
    """One kernel of a cubin, launched with the IOContract's non-meta arguments in order (then
    Triton's scratch pointers)."""

    def __init__(
        self,
        cubin: bytes,
        name: str,
        *,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared: int,
        scratch: Sequence[Scratch] = (),
        label: str = "",
        driver: Any = None,
        stream: Callable[[], int] = current_stream,
        device: str | torch.device = "cuda",
        aligned: bool = False,
    ) -> None:
        self.name = name
        self.label = label or name
        self.grid = grid
        self.block = block
        self.shared = int(shared)
        self.scratch = tuple(scratch)
        self.stream = stream
        self.device = device
        self.aligned = aligned  # compiled assuming 16-byte aligned tensors (Triton's "D")
        real = driver is None
        if driver is None:
            driver = Driver()
            _make_current()
        self.driver = driver
        self.module = driver.load(cubin)
        done = weakref.finalize(self, _unload, driver, self.module, real)
        done.atexit = False
        self.func = driver.function(self.module, name)
        self.sizes: list[int] | None = driver.param_sizes(self.func)
        self._what = f"cuLaunchKernel({self.label})"
        self._packed: _Packed | None = None
        self._shared_set = False

    def attribute(self, attr: int) -> int:
        return int(self.driver.attribute(self.func, attr))

    def allow_shared(self) -> None:
        """Opts in to more than 48 KiB of dynamic shared memory, as Triton's loader does."""
        if self.shared > DEFAULT_SHARED_LIMIT and not self._shared_set:
            self.driver.set_attribute(
                self.func,
                ATTR_MAX_DYN_SHARED,
                self.shared,
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            )
        self._shared_set = True

    # -- parameters ----------------------------------------------------------------------
    def _param(self, i: int, v: Any) -> Any:
        size = self.sizes[i] if self.sizes is not None and i < len(self.sizes) else None
        if isinstance(v, torch.Tensor):
            return ctypes.c_void_p(v.data_ptr())
        if isinstance(v, bool):
            return ctypes.c_bool(v)
        if isinstance(v, int):
            if size == 8 or (size is None and not -(2**31) <= v < 2**31):
                return ctypes.c_int64(v)
            return {1: ctypes.c_int8, 2: ctypes.c_int16}.get(size or 4, ctypes.c_int32)(v)
        if isinstance(v, float):
            return ctypes.c_double(v) if size == 8 else ctypes.c_float(v)
        raise TypeError(f"cannot pass {type(v).__name__} to a CUDA kernel")

    def _extra_count(self, n: int) -> int:
        """How many of the scratch pointers the kernel takes after its n arguments."""
        if self.sizes is None:
            return len(self.scratch)  # surplus entries of kernelParams are never read
        extra = len(self.sizes) - n
        if 0 <= extra <= len(self.scratch):
            return extra
        declared = f"{len(self.sizes)} parameters"
        if self.scratch:
            declared += f" (with up to {len(self.scratch)} scratch pointers Triton adds)"
        raise TypeError(f"{self.label} takes {declared} but the IOContract gives {n} arguments")

    def _pack(self, values: list[Any], key: list[Any]) -> _Packed:
        holders = [self._param(i, v) for i, v in enumerate(values)]
        if self.aligned:
            for v, h in zip(values, holders, strict=True):
                if isinstance(v, torch.Tensor) and (h.value or 0) % 16:
                    raise RuntimeError(
                        f"{self.label} was compiled for 16-byte aligned pointers but got "
                        f"address {h.value:#x}"
                    )
        buffers: list[Any] = []
        programs = self.grid[0] * self.grid[1] * self.grid[2]
        for s in self.scratch[: self._extra_count(len(values))]:
            if s.size <= 0:
                holders.append(ctypes.c_void_p(None))
                continue
            align = max(1, s.align)
            buf = torch.empty(s.size * programs + align, dtype=torch.uint8, device=self.device)
            ptr = buf.data_ptr()
            buffers.append(buf)
            holders.append(ctypes.c_void_p((ptr + align - 1) // align * align))
        return _Packed(key, holders, buffers)

    def __call__(self, args: TrialArgs) -> None:
        values = [v for v, m in zip(args.values, args.is_meta, strict=False) if not m]
        key = [(v.data_ptr() if isinstance(v, torch.Tensor) else (type(v), v)) for v in values]
        packed = self._packed
        if packed is None or packed.key != key:
            packed = self._packed = self._pack(values, key)
        if not self._shared_set:
            self.allow_shared()
        self.driver.launch(
            self.func, self.grid, self.block, self.shared, self.stream(), packed.params, self._what
        )
