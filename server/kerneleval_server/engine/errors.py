"""Turns an exception raised by a kernel into a verdict, an ErrorInfo, and whether the CUDA
context of this process is now unusable (a sticky error: the worker must exit)."""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

import torch
from kerneleval.v1 import job_pb2

from kerneleval_server.error_texts import NVML_OOM_ASSERT


@dataclass(frozen=True)
class CudaError:
    name: str  # runtime API name
    code: int
    text: str  # cudaGetErrorString's text, as it appears in torch's and Triton's messages
    sticky: bool  # corrupts the context: every later call in this process fails
    driver_name: str = ""


# The errors a kernel can cause, with the strings CUDA prints for them.
CUDA_ERRORS: tuple[CudaError, ...] = (
    CudaError(
        "cudaErrorIllegalAddress",
        700,
        "an illegal memory access was encountered",
        True,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
    ),
    CudaError(
        "cudaErrorLaunchOutOfResources",
        701,
        "too many resources requested for launch",
        False,
        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    ),
    CudaError(
        "cudaErrorLaunchTimeout",
        702,
        "the launch timed out and was terminated",
        True,
        "CUDA_ERROR_LAUNCH_TIMEOUT",
    ),
    CudaError("cudaErrorAssert", 710, "device-side assert triggered", True, "CUDA_ERROR_ASSERT"),
    CudaError(
        "cudaErrorHardwareStackError",
        714,
        "hardware stack error",
        True,
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
    ),
    CudaError(
        "cudaErrorIllegalInstruction",
        715,
        "an illegal instruction was encountered",
        True,
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    ),
    CudaError(
        "cudaErrorMisalignedAddress",
        716,
        "misaligned address",
        True,
        "CUDA_ERROR_MISALIGNED_ADDRESS",
    ),
    CudaError(
        "cudaErrorInvalidAddressSpace",
        717,
        "operation not supported on global/shared address space",
        True,
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    ),
    CudaError("cudaErrorInvalidPc", 718, "invalid program counter", True, "CUDA_ERROR_INVALID_PC"),
    CudaError(
        "cudaErrorLaunchFailure",
        719,
        "unspecified launch failure",
        True,
        "CUDA_ERROR_LAUNCH_FAILED",
    ),
    CudaError(
        "cudaErrorECCUncorrectable",
        214,
        "uncorrectable ECC error encountered",
        True,
        "CUDA_ERROR_ECC_UNCORRECTABLE",
    ),
    CudaError("cudaErrorInvalidConfiguration", 9, "invalid configuration argument", False),
    CudaError("cudaErrorInvalidDeviceFunction", 98, "invalid device function", False),
    CudaError(
        "cudaErrorNoKernelImageForDevice",
        209,
        "no kernel image is available for execution on the device",
        False,
        "CUDA_ERROR_NO_BINARY_FOR_GPU",
    ),
    CudaError("cudaErrorInvalidValue", 1, "invalid argument", False, "CUDA_ERROR_INVALID_VALUE"),
    CudaError("cudaErrorMemoryAllocation", 2, "out of memory", False, "CUDA_ERROR_OUT_OF_MEMORY"),
)
_BY_CODE = {e.code: e for e in CUDA_ERRORS}


@dataclass
class Failure:
    verdict: job_pb2.Verdict
    error: job_pb2.ErrorInfo
    context_poisoned: bool = False


def find_cuda_error(message: str) -> CudaError | None:
    """The CUDA error a message names: by name, by driver name, by code, or by its text."""
    for e in CUDA_ERRORS:
        if e.name in message or (e.driver_name and e.driver_name in message):
            return e
    m = re.search(r"(?:error code|error|code)[ :=]*\(?(\d{1,4})\)?", message, re.IGNORECASE)
    lowered = message.lower()
    looks_cuda = "cuda" in lowered or "triton error" in lowered
    if m and looks_cuda and int(m.group(1)) in _BY_CODE:
        return _BY_CODE[int(m.group(1))]
    if looks_cuda:
        for e in CUDA_ERRORS:
            if e.text in lowered:
                return e
    return None


def kernel_traceback(exc: BaseException, source_files: tuple[str, ...] = ()) -> str:
    """The traceback, trimmed to start at the first frame of the kernel's own source."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    if source_files:
        for i, line in enumerate(frames):
            if any(f in line for f in source_files):
                return "Traceback (most recent call last):\n" + "".join(frames[i:])
    return "".join(frames)


def classify(exc: BaseException, source_files: tuple[str, ...] = ()) -> Failure:
    """Verdict for an exception raised while the kernel ran (never for compile errors)."""
    message = str(exc)
    info = job_pb2.ErrorInfo(
        message=message[:8000],
        exception_type=type(exc).__name__,
        traceback=kernel_traceback(exc, source_files)[-16000:],
    )
    if _is_oom(exc):
        message = _NVML_OOM.sub(_NVML_OOM_SAID, message)
        info.message = (message[:6000] + "\n" + allocator_numbers()).strip()
        _release_cache()
        return Failure(job_pb2.VERDICT_OUT_OF_MEMORY, info)
    resource = _resource_limit(exc)
    if resource is not None:
        info.message = resource
        return Failure(job_pb2.VERDICT_RESOURCE_LIMIT, info)
    if needs_missing_cuda(message):
        return Failure(job_pb2.VERDICT_CANNOT_RUN_HERE, info)
    cuda = find_cuda_error(message)
    if cuda is not None:
        info.cuda_error_name = cuda.name
        info.cuda_error_code = cuda.code
        if cuda.code == 2:
            info.message = (message[:6000] + "\n" + allocator_numbers()).strip()
            return Failure(job_pb2.VERDICT_OUT_OF_MEMORY, info)
        if cuda.code == 701:
            return Failure(job_pb2.VERDICT_RESOURCE_LIMIT, info)
        return Failure(job_pb2.VERDICT_DEVICE_FAULT, info, cuda.sticky or context_dead())
    return Failure(job_pb2.VERDICT_RUNTIME_ERROR, info)


# What torch says when code asks for CUDA on a host (or a torch build) that has none.
_NO_CUDA_MESSAGES = (
    "Torch not compiled with CUDA enabled",
    "without ATen_cuda library",
    "Found no NVIDIA driver on your system",
    "No CUDA GPUs are available",
)


def needs_missing_cuda(message: str) -> bool:
    """The code asked for CUDA where there is none: it cannot run here, it did not fail.
    (Torch says these only then; CUDA is not asked, which a build process must not do.)"""
    return any(m in message for m in _NO_CUDA_MESSAGES)


# torch's allocator describes an OOM with NVML's list of the GPU's processes; where NVML does
# not start (a job's sandbox) it asserts instead, and the assertion is all the message says.
_NVML_OOM = re.compile(
    r"NVML_SUCCESS == DriverAPI::get\(\)->nvmlInit_v2_\(\) INTERNAL ASSERT FAILED at "
    r'"[^"]*CUDACachingAllocator\.cpp":\d+, please report a bug to PyTorch\. ?'
)
_NVML_OOM_SAID = (
    "CUDA out of memory (torch's allocator could not allocate; its own report of that reads "
    "NVML, which a job's sandbox does not reach)"
)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(exc)
    # torch's allocator, describing an OOM where NVML cannot start (a sandbox), asserts instead
    nvml_oom = NVML_OOM_ASSERT in msg and "CUDACachingAllocator" in msg
    return (
        "DefaultCPUAllocator: can't allocate memory" in msg
        or "CUDA out of memory" in msg
        or nvml_oom
    )


def _resource_limit(exc: BaseException) -> str | None:
    """Triton's OutOfResources (shared memory, registers) says what it needed and had."""
    if type(exc).__name__ != "OutOfResources":
        return None
    required = getattr(exc, "required", None)
    limit = getattr(exc, "limit", None)
    name = getattr(exc, "name", "resources")
    if required is not None and limit is not None:
        return f"out of resource: {name}: the kernel needs {required}, the device has {limit}"
    return str(exc)


def allocator_numbers() -> str:
    """The allocator's view at the time of an out-of-memory error."""
    if not torch.cuda.is_available():
        return "allocator: host memory (no CUDA device)"
    try:
        free, total = torch.cuda.mem_get_info()
        return (
            f"allocator: allocated={torch.cuda.memory_allocated()} "
            f"reserved={torch.cuda.memory_reserved()} "
            f"max_allocated={torch.cuda.max_memory_allocated()} "
            f"device_free={free} device_total={total} (bytes)"
        )
    except Exception as e:  # the context may be gone: the numbers are a courtesy
        return f"allocator: unavailable ({e})"


def _release_cache() -> None:
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except Exception:
            pass


def context_dead() -> bool:
    """Whether the CUDA context fails even a synchronize (a sticky error)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.synchronize()
        return False
    except Exception:
        return True
