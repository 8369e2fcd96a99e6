"""Kernel sources and JobSpecs for the front-end tests (KernelBench's Model format)."""

from __future__ import annotations

from kerneleval.v1 import kernel_pb2

GOOD = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x * 2.0 + 1.0

def get_inputs():
    return [torch.randn(64)]

def get_init_inputs():
    return []
"""

HANG = GOOD.replace(
    "        return x * 2.0 + 1.0",
    "        import time\n        time.sleep(3600)\n        return x",
)

SEGFAULT = GOOD.replace(
    "        return x * 2.0 + 1.0",
    # a real fault: the job process is PID 1 of its namespace, which ignores kill(SIGSEGV)
    "        import ctypes\n        ctypes.string_at(0)\n        return x",
)

# A Triton store far past its buffer: under TRITON_INTERPRET=1 the interpreter writes through
# a wild pointer and the worker process dies with SIGSEGV.
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
    return [torch.zeros(16)]

def get_init_inputs():
    return []
"""


def spec(
    source: str = GOOD,
    kind: int = kernel_pb2.KERNEL_TYPE_TORCH,
    *,
    reference: str | None = None,
    timeout_s: int = 0,
    client_tag: str = "",
    perf_trials: int = 3,
) -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec(client_tag=client_tag)
    s.kernel.type = kind  # type: ignore[assignment]
    s.kernel.source_code = source
    if reference is not None:
        s.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
        s.reference.source_code = reference
    s.options.correct_trial_count = 1
    s.options.perf_trial_count = perf_trials
    s.options.warmup_count = 1
    if timeout_s:
        s.options.timeout.seconds = timeout_s
    return s
