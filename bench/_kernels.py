"""Kernel sources and JobSpecs shared by the bench/ scripts (good ones and planted faults)."""

from __future__ import annotations

from kerneleval.v1 import dtype_pb2, kernel_pb2

TORCH_ADD_REF = """
import torch

class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b

def get_inputs():
    return [torch.randn(N_ELEMS), torch.randn(N_ELEMS)]

def get_init_inputs():
    return []
"""

# SCALE is replaced per candidate, so that every candidate is a distinct source (a search
# agent's candidates are; no compile cache hit between them).
TRITON_ADD = """
import torch
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * SCALE + y, mask=mask)

class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        out = torch.empty_like(a)
        n = a.numel()
        add_kernel[(triton.cdiv(n, BLOCK_SIZE),)](a, b, out, n, BLOCK=BLOCK_SIZE)
        return out
"""

CUDA_ADD = r"""
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] * SCALE + b[i];
}
"""

CUDA_ADD_REF = r"""
extern "C" __global__ void add_ref(const float* a, const float* b, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = a[i] + b[i];
}
"""

# The store lands 4 TiB past the buffer: cudaErrorIllegalAddress on a GPU (XID 31); a wild
# write and SIGSEGV under the CPU interpreter.
TRITON_OOB = """
import torch
import triton
import triton.language as tl

@triton.jit
def oob_store(x_ptr, n):
    offs = tl.arange(0, 1024)
    tl.store(x_ptr + offs + (1 << 40), tl.zeros((1024,), dtype=tl.float32))

class ModelNew(torch.nn.Module):
    def forward(self, x):
        oob_store[(1,)](x, x.numel())
        return x

def get_inputs():
    return [torch.zeros(1024)]

def get_init_inputs():
    return []
"""

CUDA_OOB = r"""
extern "C" __global__ void oob_write(float* out, int n) {
  out[(size_t)threadIdx.x + (1ull << 40)] = 1.0f;
}
"""

CUDA_MISALIGNED = r"""
extern "C" __global__ void misaligned(float* out, int n) {
  *(float*)((char*)out + 1 + 4 * threadIdx.x) = 1.0f;
}
"""

CUDA_HANG = r"""
extern "C" __global__ void spin(float* out, int n) {
  // clock64() is volatile: unlike an empty loop on a local, the compiler cannot drop this
  // one (on the H200 the former version returned at once).
  const long long start = clock64();
  while (clock64() - start < (1LL << 62)) { }
  out[threadIdx.x] = 1.0f;
}
"""


def _f32(arg: kernel_pb2.ArgSpec, n: int) -> None:
    arg.tensor.shape.append(n)
    arg.tensor.dtype = dtype_pb2.DTYPE_FLOAT32


def cuda_io(n: int, with_inputs: bool = True) -> kernel_pb2.IOContract:
    io = kernel_pb2.IOContract()
    if with_inputs:
        for name in ("a", "b"):
            _f32(io.args.add(name=name, role=kernel_pb2.ARG_ROLE_INPUT), n)
    _f32(io.args.add(name="out", role=kernel_pb2.ARG_ROLE_OUTPUT), n)
    io.args.add(name="n", int_value=n)
    io.launch.grid.x = (n + 255) // 256
    io.launch.block.x = 256
    return io


def options(
    *, correct: int = 2, perf: int = 20, warmup: int = 3, timeout_s: int = 120
) -> kernel_pb2.EvalOptions:
    o = kernel_pb2.EvalOptions(
        correct_trial_count=correct, perf_trial_count=perf, warmup_count=warmup
    )
    o.timeout.seconds = timeout_s  # no bypass_cache: bench/_common.Service has no result cache
    return o


def torch_ref(n: int) -> str:
    return TORCH_ADD_REF.replace("N_ELEMS", str(n))


def triton_add(scale: float = 1.0, block: int = 1024, variant: int = -1) -> str:
    """`variant` >= 0 makes a distinct source (a new compile) with the same result."""
    source = TRITON_ADD.replace("SCALE", repr(float(scale))).replace("BLOCK_SIZE", str(block))
    if variant >= 0:  # a comment in the kernel's body changes Triton's cache key
        line = "    mask = offs < n"
        source = source.replace(line, f"    # candidate {variant}\n{line}")
    return source


def triton_add_spec(
    n: int, scale: float = 1.0, block: int = 1024, variant: int = -1
) -> kernel_pb2.JobSpec:
    """A Triton `a * scale + b` compared with eager `a + b` (correct when scale is 1)."""
    spec = kernel_pb2.JobSpec(client_tag="bench-triton")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TRITON
    spec.kernel.source_code = triton_add(scale, block, variant)
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.reference.source_code = torch_ref(n)
    return spec


def triton_add_io_spec(n: int, scale: float = 1.0, variant: int = -1) -> kernel_pb2.JobSpec:
    """The same Triton `a * scale + b`, launched from its IOContract (no candidate host code
    runs: only the @triton.jit function is used), compared with eager `a + b`."""
    spec = triton_add_spec(n, scale, 1024, variant)
    spec.client_tag = "bench-triton-io"
    source = spec.kernel.source_code
    spec.kernel.source_code = source[: source.index("class ModelNew")]
    spec.kernel.entry_point = "add_kernel"
    io = cuda_io(n)
    io.args.add(name="BLOCK", int_value=1024, meta=True)
    io.launch.grid.x = (n + 1023) // 1024
    io.launch.ClearField("block")
    spec.kernel.io.CopyFrom(io)
    return spec


def triton_add_io_built_spec(n: int, variant: int = -1) -> kernel_pb2.JobSpec:
    """The Triton `a + b` from its IOContract compared with the raw CUDA reference: no source
    of the job has host code, so both are built ahead and launched by a launch process."""
    spec = triton_add_io_spec(n, variant=variant)
    spec.client_tag = "bench-triton-built"
    spec.reference.Clear()
    spec.reference.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.reference.source_code = CUDA_ADD_REF
    spec.reference.io.CopyFrom(cuda_io(n))
    return spec


def cuda_add_spec(n: int, scale: float = 1.0, variant: int = -1) -> kernel_pb2.JobSpec:
    """A raw CUDA `a * scale + b` compared with a grid-stride CUDA reference."""
    spec = kernel_pb2.JobSpec(client_tag="bench-cuda")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_CUDA
    factor = f"{float(scale)!r}f" if variant < 0 else f"({float(scale)!r}f + 0.0f * {variant})"
    spec.kernel.source_code = CUDA_ADD.replace("SCALE", factor)
    spec.kernel.io.CopyFrom(cuda_io(n))
    spec.reference.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.reference.source_code = CUDA_ADD_REF
    spec.reference.io.CopyFrom(cuda_io(n))
    return spec


def torch_spec(source: str, tag: str) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag=tag)
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = source
    return spec


def triton_oob_spec() -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag="bench-triton-oob")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TRITON
    spec.kernel.source_code = TRITON_OOB
    return spec


def cuda_bad_spec(source: str, tag: str) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag=tag)
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.kernel.source_code = source
    spec.kernel.io.CopyFrom(cuda_io(1024, with_inputs=False))
    return spec
