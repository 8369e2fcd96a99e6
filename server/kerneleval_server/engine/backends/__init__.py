"""One builder per kernel type; each turns a KernelSource into a runnable Program."""

from __future__ import annotations

from kerneleval.v1 import kernel_pb2

from kerneleval_server.spec.validation import is_triton_launch

from .base import BuildContext, LaunchProgram, ModelProgram, NoDeviceError, Program
from .cuda import build_cuda
from .model import build_model
from .triton_launch import build_triton_launch

__all__ = [
    "BuildContext",
    "LaunchProgram",
    "ModelProgram",
    "NoDeviceError",
    "Program",
    "build",
    "is_triton_launch",
]


def build(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> Program:
    if k.type == kernel_pb2.KERNEL_TYPE_CUDA:
        return build_cuda(k, role, ctx)
    if is_triton_launch(k):
        return build_triton_launch(k, role, ctx)
    return build_model(k, role, ctx)
