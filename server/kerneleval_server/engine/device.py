"""The device a job runs on: which one, its limits, and the DeviceInfo reported with results."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from kerneleval.v1 import job_pb2


@dataclass(frozen=True)
class DeviceLimits:
    """What one launch may ask for; pre-flight compares launches against these."""

    max_threads_per_block: int = 1024
    max_shared_memory_per_block: int = 48 * 1024  # without opting in
    max_shared_memory_per_block_optin: int = 48 * 1024
    max_grid_dim: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_block_dim: tuple[int, int, int] = (1024, 1024, 64)


def has_gpu() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this worker evaluates on: its one visible GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu() else torch.device("cpu")


@functools.lru_cache(maxsize=1)
def gpu_limits() -> DeviceLimits | None:
    """Limits of the current GPU, None without one."""
    if not has_gpu():
        return None
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0) or _triton_max_shared(idx)
    per_block = int(getattr(props, "shared_memory_per_block", 0) or 48 * 1024)
    return DeviceLimits(
        max_threads_per_block=int(getattr(props, "max_threads_per_block", 1024) or 1024),
        max_shared_memory_per_block=per_block,
        max_shared_memory_per_block_optin=max(optin, per_block),
    )


def _triton_max_shared(idx: int) -> int:
    """The opt-in shared memory limit as Triton reads it (the number its own check uses)."""
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(idx)["max_shared_mem"])
    except Exception:  # an older torch and no Triton driver: the conservative default
        return 0


@functools.lru_cache(maxsize=1)
def device_info() -> job_pb2.DeviceInfo:
    import triton

    info = job_pb2.DeviceInfo(torch_version=torch.__version__, triton_version=triton.__version__)
    if not has_gpu():
        info.name = "cpu"
        info.index = -1
        return info
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    info.name = props.name
    info.index = _physical_index(idx)
    info.compute_capability = f"{props.major}.{props.minor}"
    info.cuda_version = torch.version.cuda or ""
    info.uuid = str(getattr(props, "uuid", "") or "")
    info.driver_version = _driver_version()
    return info


def _physical_index(idx: int) -> int:
    """The host's GPU index: workers see one GPU through CUDA_VISIBLE_DEVICES."""
    import os

    env = os.environ.get("KERNELEVAL_DEVICE_INDEX") or ""
    if env.lstrip("-").isdigit():
        return int(env)
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if idx < len(visible) and visible[idx].strip().isdigit():
        return int(visible[idx])
    return idx


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # NVML missing or not permitted: the version is only informative
        return ""
