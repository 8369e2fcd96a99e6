"""A kernel a build process compiled ahead of time (KernelArtifact), made runnable without
importing or compiling its source: the cubin is loaded and launched through the driver API."""

from __future__ import annotations

from typing import Any

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from .. import preflight
from .base import BuildContext, LaunchProgram, NoDeviceError
from .cubin import ATTR_MAX_THREADS, CubinLaunch, Scratch
from .cuda import CudaLaunch, base_name, check_without_gpu, no_device

TRITON, CUDA = kernel_pb2.KERNEL_TYPE_TRITON, kernel_pb2.KERNEL_TYPE_CUDA


class TritonCubinLaunch(CubinLaunch):
    """A Triton kernel compiled ahead: 32 * num_warps threads, Triton's shared memory, and the
    global and profile scratch pointers Triton appends after the kernel's own parameters."""

    def __init__(
        self,
        art: job_channel_pb2.KernelArtifact,
        launch: kernel_pb2.LaunchConfig,
        driver: Any = None,
        **kwargs: Any,
    ) -> None:
        if art.num_warps <= 0:
            raise ValueError(f"the artifact of {art.function} has num_warps={art.num_warps}")
        super().__init__(
            art.cubin,
            art.function,
            grid=preflight.dims(launch.grid),
            block=(32 * art.num_warps, 1, 1),
            shared=art.shared_bytes,
            scratch=(
                Scratch(art.global_scratch_bytes, art.global_scratch_align or 1),
                Scratch(art.profile_scratch_bytes, art.profile_scratch_align or 1),
            ),
            driver=driver,
            aligned=True,
            **kwargs,
        )

    def check_threads(self) -> None:
        """As Triton's loader: the block must fit the kernel's thread limit (register use)."""
        threads = self.block[0]
        limit = self.attribute(ATTR_MAX_THREADS)
        if threads > limit:
            raise preflight.ResourceLimitError(
                f"out of resource: threads: the kernel needs {threads}, the device has {limit}"
            )


def build_prebuilt(
    art: job_channel_pb2.KernelArtifact, k: kernel_pb2.KernelSource, ctx: BuildContext
) -> LaunchProgram:
    """The program of a prebuilt kernel; the source `k` gives only its IOContract."""
    if art.type != k.type or art.type not in (TRITON, CUDA):
        raise RuntimeError(
            f"the prebuilt {art.role} is {kernel_pb2.KernelType.Name(art.type)} but its source "
            f"is {kernel_pb2.KernelType.Name(k.type)}"
        )
    if art.build_log:
        ctx.log(art.build_log)
    ctx.notes.extend(art.notes)
    if art.type == CUDA:
        if ctx.limits is not None:  # checks that need no GPU (fake limits on CPU)
            check_without_gpu(k.io.launch, ctx.limits, art.build_log, art.function)
        if ctx.device.type != "cuda":
            raise no_device(art.function, art.arch)
        runner = CudaLaunch(art.cubin, art.function, k.io.launch)
        if ctx.limits is not None:
            runner.preflight(ctx.limits)
        return LaunchProgram(launch=runner)
    if ctx.device.type != "cuda":
        raise NoDeviceError(
            f"no CUDA device: {base_name(art.function)} compiled for {art.arch} but cannot "
            "run here",
            compiled=True,
        )
    if ctx.limits is not None:
        preflight.check_triton_shared(art.shared_bytes, ctx.limits)
    triton_launch = TritonCubinLaunch(art, k.io.launch)
    triton_launch.check_threads()
    triton_launch.allow_shared()
    return LaunchProgram(launch=triton_launch)
