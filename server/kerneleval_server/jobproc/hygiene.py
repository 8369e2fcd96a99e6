"""A job process's GPU memory between jobs: the cleanup before the next job, a job's peak.

A launch process or a judge takes job after job (runtime.py): before the next one, nothing
of the last may be left in Python or in device memory (`_clean_for_next_job`). What torch's
allocator held at most during a job goes in its outcome (`_reset_peak_memory` while the
process waits for the job, `_peak_memory` after it). Apart from the job loop: this is what
the process does with its CUDA context between jobs, and only when it made one.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
from typing import Any


def _clean_for_next_job() -> bool:
    """Hygiene before a launch process or a judge takes another job: nothing of the job left
    in Python, the GPU idle, every byte of device memory the job freed zeroed (a later kernel
    that reads out of its bounds must not find this job's inputs or outputs: with the same
    seed they are the next job's answers) and given back to the driver. Memory still
    allocated belongs to the process (cuBLAS's workspace, the engine's own buffers) and is
    left as it is. False when any of it fails: the process then exits."""
    gc.collect()
    torch = _cuda_in_use()
    if torch is None:
        return True
    try:
        torch.cuda.synchronize()
        zero = _device_memset()
        for segment in torch.cuda.memory_snapshot():
            address = segment["address"]
            for block in segment["blocks"]:  # in address order within the segment
                if block["state"] == "inactive" and zero(address, block["size"]) != 0:
                    return False
                address += block["size"]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a GPU that fails here is not fit for the next job
        return False
    return True


def _cuda_in_use() -> Any:
    """torch, when this process has made its CUDA context; else None."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


def _reset_peak_memory() -> None:
    torch = _cuda_in_use()
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> int:
    """The most device memory torch's allocator held during the job (the front end learns
    from it what a problem's jobs need: fleet/gpu_memory.py)."""
    torch = _cuda_in_use()
    if torch is None:
        return 0
    try:
        # The nested form: max_memory_reserved() flattens every statistic first, ~0.5 ms of
        # each job's outcome on an H100.
        return int(torch.cuda.memory_stats_as_nested_dict()["reserved_bytes"]["all"]["peak"])
    except Exception:  # noqa: BLE001 - a failing context reports nothing
        return 0


@functools.cache
def _device_memset() -> Any:
    """cuMemsetD8 (the driver API: torch has no binding) on the current context; bound once
    a process."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuMemsetD8_v2
    fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    return lambda address, size: fn(address, 0, size)
