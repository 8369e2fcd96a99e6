"""Engine test helpers: spec builders and a recording reporter.

The engine runs in this pytest process, as in a worker; Triton runs under its interpreter
because configure_process_environment() sets TRITON_INTERPRET=1 without a GPU.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from kerneleval_server.engine import configure_process_environment

configure_process_environment()

import torch  # noqa: E402
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_pb2  # noqa: E402

KERNELBENCH = Path(__file__).resolve().parents[3] / "shared" / "kernelbench"
if not KERNELBENCH.exists():
    KERNELBENCH = Path("/work/shared/kernelbench")

HAS_GPU = torch.cuda.is_available()
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
needs_kernelbench = pytest.mark.skipif(not KERNELBENCH.exists(), reason="no KernelBench copy")

F32 = dtype_pb2.DTYPE_FLOAT32
IN, OUT, INOUT = kernel_pb2.ARG_ROLE_INPUT, kernel_pb2.ARG_ROLE_OUTPUT, kernel_pb2.ARG_ROLE_INOUT
TORCH, TORCH_CUDA = kernel_pb2.KERNEL_TYPE_TORCH, kernel_pb2.KERNEL_TYPE_TORCH_CUDA
TRITON, CUDA = kernel_pb2.KERNEL_TYPE_TRITON, kernel_pb2.KERNEL_TYPE_CUDA
V = job_pb2


class RecordingReporter:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def phase(self, phase: int) -> None:
        self.events.append(("phase", phase))

    def progress(self, phase: int, done: int, total: int) -> None:
        self.events.append(("progress", phase, done, total))

    def log(self, text: str) -> None:
        self.events.append(("log", text))

    def phases(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "phase"]


def tensor(
    name: str,
    shape: list[int],
    dtype: int = F32,
    role: int = IN,
    init: kernel_pb2.TensorInit | None = None,
    data: bytes | None = None,
) -> kernel_pb2.ArgSpec:
    t = kernel_pb2.TensorSpec(shape=shape, dtype=dtype)
    if data is not None:
        t.data = data
    elif init is not None:
        t.init.CopyFrom(init)
    return kernel_pb2.ArgSpec(name=name, role=role, tensor=t)


def scalar(name: str, value: int | float, meta: bool = False) -> kernel_pb2.ArgSpec:
    a = kernel_pb2.ArgSpec(name=name, meta=meta)
    if isinstance(value, float):
        a.float_value = value
    else:
        a.int_value = value
    return a


def source(
    kind: int,
    code: str,
    args: list[kernel_pb2.ArgSpec] | None = None,
    grid: tuple[int, int, int] = (0, 0, 0),
    block: tuple[int, int, int] = (0, 0, 0),
    entry: str = "",
    shared: int = 0,
) -> kernel_pb2.KernelSource:
    k = kernel_pb2.KernelSource(type=kind, source_code=code, entry_point=entry)
    if args:
        k.io.args.extend(args)
    if any(grid):
        k.io.launch.grid.CopyFrom(kernel_pb2.Dim3(x=grid[0], y=grid[1], z=grid[2]))
    if any(block):
        k.io.launch.block.CopyFrom(kernel_pb2.Dim3(x=block[0], y=block[1], z=block[2]))
    k.io.launch.shared_memory_bytes = shared
    return k


def job(
    kernel: kernel_pb2.KernelSource,
    reference: kernel_pb2.KernelSource | None = None,
    **options: Any,
) -> kernel_pb2.JobSpec:
    opts = {"perf_trial_count": 3, "warmup_count": 1, **options}
    spec = kernel_pb2.JobSpec(kernel=kernel, options=kernel_pb2.EvalOptions(**opts))
    if reference is not None:
        spec.reference.CopyFrom(reference)
    return spec


ADD_MODEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b
def get_inputs():
    return [torch.randn(4, 64), torch.randn(4, 64)]
def get_init_inputs():
    return []
"""


# A Triton a + b launched from its IOContract, and its eager reference (several suites).
TRITON_ADD = """
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
             mask=mask)
"""
TORCH_ADD = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, y):
        return x + y
"""
