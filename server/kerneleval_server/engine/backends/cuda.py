"""Raw CUDA: compiled with nvcc to a cubin for this GPU (the log kept), loaded through the
driver API, and launched from the IOContract on torch's current stream."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import torch
from kerneleval.v1 import kernel_pb2

from .. import loader, preflight
from .base import BuildContext, LaunchProgram, NoDeviceError
from .cubin import ATTR_MAX_THREADS, ATTR_SHARED_SIZE, CubinLaunch, CudaDriverError, Driver

__all__ = [
    "Compiled",
    "CudaDriverError",
    "CudaLaunch",
    "Driver",
    "build_cuda",
    "compile_cuda",
    "pick_kernel",
    "target_arch",
]

DEFAULT_CPU_ARCH = "sm_90"  # what a GPU-less machine compiles for, to check the source


@dataclass
class Compiled:
    cubin: bytes
    log: str
    kernels: list[str]  # mangled names
    static_shared: dict[str, int]
    command: str = ""  # the nvcc command line


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


def compile_cuda(source: str, ctx: BuildContext, arch: str) -> Compiled:
    """nvcc to a cubin for `arch` ("sm_90"); a failure is a CompileError with nvcc's log."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise loader.CompileError("nvcc was not found: raw CUDA kernels cannot be compiled here")
    src = loader.write_source(ctx.work_dir, "cuda", source, suffix=".cu")
    ctx.source_files.append(str(src))
    out = src.with_suffix(".cubin")
    cmd = [
        nvcc,
        "-cubin",
        f"-arch={arch}",
        "-lineinfo",
        "-Xptxas",
        "-v",
        "-o",
        str(out),
        str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr).strip()
    command = " ".join(cmd)
    ctx.log(f"$ {command}\n{log}")
    if proc.returncode != 0:
        raise loader.CompileError(f"nvcc failed (exit {proc.returncode}):\n{log}", log)
    cubin = out.read_bytes()
    names = sorted(set(re.findall(rb"\.text\.([A-Za-z_$][A-Za-z0-9_$]*)\x00", cubin)))
    kernels = [n.decode() for n in names]
    return Compiled(cubin, log, kernels, _static_shared(log), command)


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


class CudaLaunch(CubinLaunch):
    """A raw CUDA kernel: grid, block and dynamic shared memory from the IOContract."""

    def __init__(
        self, cubin: bytes, name: str, launch: kernel_pb2.LaunchConfig, driver: Any = None
    ) -> None:
        super().__init__(
            cubin,
            name,
            grid=preflight.dims(launch.grid),
            block=preflight.dims(launch.block),
            shared=int(launch.shared_memory_bytes),
            label=base_name(name),
            driver=driver,
        )
        self.launch_cfg = launch

    def preflight(self, limits: Any) -> None:
        preflight.check_cuda_launch(
            self.launch_cfg,
            limits,
            static_shared_bytes=self.attribute(ATTR_SHARED_SIZE),
            kernel_max_threads=self.attribute(ATTR_MAX_THREADS),
        )
        self.allow_shared()


def cuda_notes(log: str, name: str, arch: str) -> list[str]:
    """ptxas's register and shared memory use of the kernel, as a result note."""
    used = resource_line(log, name)
    return [f"ptxas ({base_name(name)}, {arch}): {used}"] if used else []


def check_without_gpu(launch: kernel_pb2.LaunchConfig, limits: Any, log: str, name: str) -> None:
    """The pre-flight checks that need no GPU: block, grid, and shared memory (ptxas's static
    shared memory from the log plus the dynamic request)."""
    preflight.check_cuda_launch(
        launch, limits, static_shared_bytes=_static_shared(log).get(name, 0)
    )


def no_device(name: str, arch: str) -> NoDeviceError:
    return NoDeviceError(
        f"no CUDA device: {base_name(name)} compiled for {arch} but cannot run here",
        compiled=True,
    )


def build_cuda(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> LaunchProgram:
    arch = target_arch()
    compiled = compile_cuda(k.source_code, ctx, arch)
    name = pick_kernel(compiled.kernels, k.entry_point)
    ctx.notes.extend(cuda_notes(compiled.log, name, arch))
    if ctx.limits is not None:  # checks that need no GPU (fake limits on CPU)
        check_without_gpu(k.io.launch, ctx.limits, compiled.log, name)
    if ctx.device.type != "cuda":
        raise no_device(name, arch)
    runner = CudaLaunch(compiled.cubin, name, k.io.launch)
    if ctx.limits is not None:
        runner.preflight(ctx.limits)
    return LaunchProgram(launch=runner)
