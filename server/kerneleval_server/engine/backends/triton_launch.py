"""TRITON launched from its IOContract: kernel[grid](*args, num_warps=.., num_stages=..).
Meta args are passed in their place and become constexprs."""

from __future__ import annotations

from typing import Any

from kerneleval.v1 import kernel_pb2

from .. import loader, preflight
from ..inputs import TrialArgs
from .base import BuildContext, LaunchProgram


class TritonLaunch:
    def __init__(self, kernel: Any, launch: kernel_pb2.LaunchConfig) -> None:
        self.kernel = kernel
        self.grid = preflight.dims(launch.grid)
        self.options: dict[str, int] = {}
        if launch.num_warps:
            self.options["num_warps"] = launch.num_warps
        if launch.num_stages:
            self.options["num_stages"] = launch.num_stages

    def __call__(self, args: TrialArgs) -> None:
        self.kernel[self.grid](*args.values, **self.options)

    def compile_and_check(self, args: TrialArgs, ctx: BuildContext) -> None:
        """On a GPU: compile for these argument types and check shared memory before launch."""
        if ctx.limits is None or not ctx.device.type == "cuda":
            return
        warmup = getattr(self.kernel, "warmup", None)
        if warmup is None:
            return
        compiled = warmup(*args.values, grid=self.grid, **self.options)
        for k in compiled if isinstance(compiled, (list, tuple)) else [compiled]:
            shared = getattr(getattr(k, "metadata", None), "shared", None)
            if isinstance(shared, int):
                ctx.log(f"triton: {getattr(k, 'name', 'kernel')} uses {shared} bytes of shared")
                preflight.check_triton_shared(shared, ctx.limits)


def build_triton_launch(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> LaunchProgram:
    module = loader.import_source(ctx.work_dir, role, k.source_code)
    ctx.source_files.append(str(module.__file__))
    kernel = loader.find_triton_kernel(module, k.entry_point)
    params = loader.signature_names(kernel)
    if len(params) != len(k.io.args):
        raise loader.CompileError(
            f"the kernel takes {len(params)} arguments ({', '.join(params)}) but the IOContract "
            f"gives {len(k.io.args)}"
        )
    return LaunchProgram(launch=TritonLaunch(kernel, k.io.launch), module=module)
