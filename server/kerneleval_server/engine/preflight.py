"""Checks a launch against the device's limits before it runs, so that a kernel asking for too
much gets VERDICT_RESOURCE_LIMIT with both numbers instead of a crash or a cryptic error."""

from __future__ import annotations

from kerneleval.v1 import kernel_pb2

from .device import DeviceLimits


class ResourceLimitError(Exception):
    """A launch needs more than the device has; the message names both numbers."""


def dims(d: kernel_pb2.Dim3) -> tuple[int, int, int]:
    """A Dim3 with zeros read as 1."""
    return (d.x or 1, d.y or 1, d.z or 1)


def check_cuda_launch(
    launch: kernel_pb2.LaunchConfig,
    limits: DeviceLimits,
    *,
    static_shared_bytes: int = 0,
    kernel_max_threads: int | None = None,
) -> None:
    """Block size, grid size and shared memory of a raw CUDA launch."""
    block = dims(launch.block)
    threads = block[0] * block[1] * block[2]
    if threads > limits.max_threads_per_block:
        raise ResourceLimitError(
            f"block of {threads} threads ({block[0]}x{block[1]}x{block[2]}) exceeds the device "
            f"limit of {limits.max_threads_per_block} threads per block"
        )
    for axis, (v, cap) in enumerate(zip(block, limits.max_block_dim, strict=False)):
        if v > cap:
            raise ResourceLimitError(f"block.{'xyz'[axis]} = {v} exceeds the device limit {cap}")
    for axis, (v, cap) in enumerate(zip(dims(launch.grid), limits.max_grid_dim, strict=False)):
        if v > cap:
            raise ResourceLimitError(f"grid.{'xyz'[axis]} = {v} exceeds the device limit {cap}")
    if kernel_max_threads is not None and threads > kernel_max_threads:
        raise ResourceLimitError(
            f"block of {threads} threads exceeds this kernel's limit of {kernel_max_threads} "
            "threads per block (its register use)"
        )
    shared = launch.shared_memory_bytes + static_shared_bytes
    if shared > limits.max_shared_memory_per_block_optin:
        raise ResourceLimitError(
            f"out of resource: shared memory, required: {shared} bytes "
            f"({static_shared_bytes} static + {launch.shared_memory_bytes} dynamic), "
            f"hardware limit: {limits.max_shared_memory_per_block_optin} bytes per block"
        )


def check_triton_shared(required: int, limits: DeviceLimits) -> None:
    if required > limits.max_shared_memory_per_block_optin:
        raise ResourceLimitError(
            f"out of resource: shared memory, required: {required} bytes, "
            f"hardware limit: {limits.max_shared_memory_per_block_optin} bytes per block"
        )
