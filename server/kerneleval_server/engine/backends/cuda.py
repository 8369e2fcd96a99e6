"""Raw CUDA: compiled with nvcc to a cubin for this GPU (the log kept), loaded through the
driver API, and launched from the IOContract on torch's current stream."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import torch
from kerneleval.v1 import kernel_pb2

from .. import loader, preflight
from ..inputs import TrialArgs
from .base import BuildContext, LaunchProgram, NoDeviceError

DEFAULT_CPU_ARCH = "sm_90"  # what a GPU-less machine compiles for, to check the source
_ATTR_MAX_THREADS, _ATTR_SHARED_SIZE, _ATTR_NUM_REGS, _ATTR_MAX_DYN_SHARED = 0, 1, 4, 8


@dataclass
class Compiled:
    cubin: bytes
    log: str
    kernels: list[str]  # mangled names
    static_shared: dict[str, int]


def nvcc_path() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return shutil.which("nvcc") or (
        p if os.path.exists(p := os.path.join(cuda_home, "bin", "nvcc")) else None
    )


def target_arch() -> str:
    if env := os.environ.get("KERNELEVAL_CUDA_ARCH"):
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return DEFAULT_CPU_ARCH


def compile_cuda(source: str, ctx: BuildContext) -> Compiled:
    nvcc = nvcc_path()
    if nvcc is None:
        raise loader.CompileError("nvcc was not found: raw CUDA kernels cannot be compiled here")
    src = loader.write_source(ctx.work_dir, "cuda", source, suffix=".cu")
    ctx.source_files.append(str(src))
    out = src.with_suffix(".cubin")
    cmd = [
        nvcc,
        "-cubin",
        f"-arch={target_arch()}",
        "-lineinfo",
        "-Xptxas",
        "-v",
        "-o",
        str(out),
        str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr).strip()
    ctx.log(f"$ {' '.join(cmd)}\n{log}")
    if proc.returncode != 0:
        raise loader.CompileError(f"nvcc failed (exit {proc.returncode}):\n{log}", log)
    cubin = out.read_bytes()
    names = sorted(set(re.findall(rb"\.text\.([A-Za-z_$][A-Za-z0-9_$]*)\x00", cubin)))
    kernels = [n.decode() for n in names]
    return Compiled(cubin, log, kernels, _static_shared(log))


def _static_shared(log: str) -> dict[str, int]:
    """Static shared memory per kernel from ptxas -v."""
    out: dict[str, int] = {}
    current = ""
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = m.group(1)
        elif current and (m := re.search(r"(\d+) bytes smem", line)):
            out[current] = int(m.group(1))
    return out


def resource_line(log: str, kernel: str) -> str:
    """ptxas's register and shared memory line for one kernel ("Used 10 registers, ...")."""
    current = ""
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = m.group(1)
        elif current == kernel and "Used" in line:
            return line.split(":", 1)[-1].strip()
    return ""


def base_name(mangled: str) -> str:
    """foo from _Z3fooPfi, bar from _ZN2ns3barEv, extern "C" names unchanged."""
    if not mangled.startswith("_Z"):
        return mangled
    rest = mangled[2:]
    nested = rest.startswith("N")
    if nested:
        rest = rest[1:]
    last = mangled
    while m := re.match(r"(\d+)", rest):
        n = int(m.group(1))
        last = rest[len(m.group(1)) : len(m.group(1)) + n]
        rest = rest[len(m.group(1)) + n :]
        if not nested:
            break
    return last


def pick_kernel(kernels: list[str], entry_point: str) -> str:
    if not kernels:
        raise loader.CompileError("no __global__ function in the source")
    if entry_point:
        for k in kernels:
            if k == entry_point or base_name(k) == entry_point:
                return k
        found = ", ".join(base_name(k) for k in kernels)
        raise loader.CompileError(f"no __global__ function {entry_point} in the source ({found})")
    if len(kernels) > 1:
        found = ", ".join(base_name(k) for k in kernels)
        raise loader.CompileError(
            f"the source defines {len(kernels)} __global__ functions ({found}): set entry_point"
        )
    return kernels[0]


class CudaDriverError(RuntimeError):
    pass


class Driver:
    """The few driver API calls needed, through ctypes (no extra Python package)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        u = ctypes.c_uint
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        self.lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(i), i, vp]
        self.lib.cuFuncSetAttribute.argtypes = [vp, i, i]
        self.lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), vp]
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

    def param_sizes(self, func: ctypes.c_void_p) -> list[int] | None:
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


class CudaLaunch:
    def __init__(self, compiled: Compiled, name: str, launch: kernel_pb2.LaunchConfig) -> None:
        self.name = name
        self.launch_cfg = launch
        self.grid = preflight.dims(launch.grid)
        self.block = preflight.dims(launch.block)
        self.shared = int(launch.shared_memory_bytes)
        self.driver = Driver()
        torch.cuda.init()
        torch.empty(1, device="cuda")  # makes torch's primary context current on this thread
        self.module = ctypes.c_void_p()
        self.driver.check(
            self.driver.lib.cuModuleLoadData(ctypes.byref(self.module), compiled.cubin),
            "cuModuleLoadData",
        )
        self.func = ctypes.c_void_p()
        self.driver.check(
            self.driver.lib.cuModuleGetFunction(
                ctypes.byref(self.func), self.module, name.encode()
            ),
            "cuModuleGetFunction",
        )
        self.sizes = self.driver.param_sizes(self.func)

    def preflight(self, limits: Any) -> None:
        preflight.check_cuda_launch(
            self.launch_cfg,
            limits,
            static_shared_bytes=self.driver.attribute(self.func, _ATTR_SHARED_SIZE),
            kernel_max_threads=self.driver.attribute(self.func, _ATTR_MAX_THREADS),
        )
        if self.shared > 48 * 1024:
            self.driver.check(
                self.driver.lib.cuFuncSetAttribute(self.func, _ATTR_MAX_DYN_SHARED, self.shared),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            )

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

    def __call__(self, args: TrialArgs) -> None:
        values = [v for v, m in zip(args.values, args.is_meta, strict=False) if not m]
        if self.sizes is not None and len(self.sizes) != len(values):
            raise TypeError(
                f"{base_name(self.name)} takes {len(self.sizes)} parameters but the IOContract "
                f"gives {len(values)} arguments"
            )
        holders = [self._param(i, v) for i, v in enumerate(values)]
        params = (ctypes.c_void_p * max(1, len(holders)))(
            *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders]
        )
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = self.driver.lib.cuLaunchKernel(
            self.func, *self.grid, *self.block, self.shared, stream, params, None
        )  # params: void*[] of pointers to each argument's bytes
        self.driver.check(rc, f"cuLaunchKernel({base_name(self.name)})")


def build_cuda(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> LaunchProgram:
    compiled = compile_cuda(k.source_code, ctx)
    name = pick_kernel(compiled.kernels, k.entry_point)
    if used := resource_line(compiled.log, name):
        ctx.notes.append(f"ptxas ({base_name(name)}, {target_arch()}): {used}")
    if ctx.limits is not None:  # checks that need no GPU (fake limits on CPU)
        preflight.check_cuda_launch(
            k.io.launch, ctx.limits, static_shared_bytes=compiled.static_shared.get(name, 0)
        )
    if ctx.device.type != "cuda":
        raise NoDeviceError(
            f"no CUDA device: {base_name(name)} compiled for {target_arch()} but cannot run here"
        )
    runner = CudaLaunch(compiled, name, k.io.launch)
    if ctx.limits is not None:
        runner.preflight(ctx.limits)
    return LaunchProgram(launch=runner)
