"""One builder per kernel type; each turns a KernelSource into a runnable Program."""

from __future__ import annotations

import re

from kerneleval.v1 import kernel_pb2

from .base import BuildContext, LaunchProgram, ModelProgram, NoDeviceError, Program
from .cuda import build_cuda
from .model import build_model
from .triton_launch import build_triton_launch

__all__ = ["BuildContext", "LaunchProgram", "ModelProgram", "NoDeviceError", "Program", "build"]


def is_triton_launch(k: kernel_pb2.KernelSource) -> bool:
    """TRITON runs from its IOContract unless it goes through a ModelNew (or Model) class."""
    if k.type != kernel_pb2.KERNEL_TYPE_TRITON or len(k.io.args) == 0:
        return False
    if k.entry_point:
        return k.entry_point not in ("ModelNew", "Model")
    return re.search(r"^class\s+ModelNew\b", k.source_code, re.MULTILINE) is None


def build(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> Program:
    if k.type == kernel_pb2.KERNEL_TYPE_CUDA:
        return build_cuda(k, role, ctx)
    if is_triton_launch(k):
        return build_triton_launch(k, role, ctx)
    return build_model(k, role, ctx)
