"""Jobs built ahead: which jobs a build process compiles so that a launch process runs them.

A Triton or raw CUDA kernel launched from its IOContract needs its source only to compile. A
build process (no GPU, the build pseudo-device of the watchdog) compiles it into a cubin; a
launch process, a GPU job process into which no job's host code is ever loaded, launches the
cubin and may then take the next such job (docs/INTERNALS.md, "Built ahead"). A reference
with host code (an eager PyTorch Model, the common case) is not built: where this node judges
(jobs/judging.py), the launch process runs the kernel alone and records its outputs, and the
reference runs only in the job's judge. Everything else, and every job with a debug aid (they
re-run the job's source in a child process), runs whole in a job process of its own.
"""

from __future__ import annotations

import math
import os

from kerneleval.contracts import ITEMSIZE
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.spec.validation import is_triton_launch

__all__ = [
    "BUILD_DEVICE", "arch_of", "check_artifacts", "judged_launch_fits", "kind",
    "reference_judged",
]  # fmt: skip

DEFAULT_CUDA_ARCH = "sm_90"  # raw CUDA built before any GPU said what it is (CPU hosts)
# The engine's record and shares (engine/record.py, device_share.py; not imported: torch).
RECORD_HEADER = 1 << 20
RECORD_ALIGN = 64
SHARE_GRANULARITY = 2 << 20
MAX_SHARES = 256
DEFAULT_CORRECT_TRIALS = 5  # engine/options.py's


def kind(spec: kernel_pb2.JobSpec, judged: bool = False) -> str:
    """ "" (runs whole), "cuda" (every source built raw CUDA) or "triton" (one is Triton: built
    ahead only for a GPU; without one, Triton runs in its interpreter, which needs the source).
    `judged`: a reference with host code may stay out of the build (reference_judged)."""
    o = spec.options
    if o.sanitize or o.device_metrics or o.launch_blocking or o.device_side_assertions:
        return ""
    kernel = _built_as(spec.kernel)
    if not kernel:
        return ""
    kinds = {kernel}
    if spec.HasField("reference"):
        reference = _built_as(spec.reference)
        if not reference and not judged:
            return ""
        kinds.add(reference)
    return "triton" if "triton" in kinds else "cuda"


def _built_as(k: kernel_pb2.KernelSource) -> str:
    if k.type == kernel_pb2.KERNEL_TYPE_CUDA and len(k.io.args) > 0:
        return "cuda"
    return "triton" if is_triton_launch(k) else ""


def reference_judged(spec: kernel_pb2.JobSpec) -> bool:
    """The job's reference is not built ahead: its kernel is launched alone, and the reference
    runs only in the judge."""
    return spec.HasField("reference") and not _built_as(spec.reference)


def judged_launch_fits(spec: kernel_pb2.JobSpec, record_bytes: int, share_bytes: int) -> bool:
    """Every trial its judge reads (the correctness trials and the timed one on fresh inputs)
    fits the record, or the shares: a launch process never has the reference, so it cannot
    judge outputs over both itself, as a job process running the job whole does. Sized from
    the kernel's IOContract, whose OUTPUT and INOUT tensors are the outputs."""
    sizes = [
        math.prod(a.tensor.shape) * ITEMSIZE.get(a.tensor.dtype, 8)
        for a in spec.kernel.io.args
        if a.WhichOneof("value") == "tensor"
        and a.role in (kernel_pb2.ARG_ROLE_OUTPUT, kernel_pb2.ARG_ROLE_INOUT)
    ]
    o = spec.options
    correct = o.correct_trial_count if o.HasField("correct_trial_count") else DEFAULT_CORRECT_TRIALS
    trials = correct + 1
    in_record = RECORD_HEADER + sum(-(-n // RECORD_ALIGN) * RECORD_ALIGN for n in sizes)
    if trials * in_record <= record_bytes:
        return True
    shared = sum(max(1, -(-n // SHARE_GRANULARITY)) * SHARE_GRANULARITY for n in sizes)
    return (
        trials * shared <= share_bytes
        and trials * len(sizes) <= MAX_SHARES
        and trials * RECORD_HEADER <= record_bytes
    )


def arch_of(compute_capability: str) -> str:
    """ "9.0" -> "sm_90"; "" for an unknown one."""
    major, _, minor = compute_capability.partition(".")
    return f"sm_{major}{minor}" if major.isdigit() and minor.isdigit() else ""


def cpu_arch() -> str:
    return os.environ.get("KERNELEVAL_CUDA_ARCH") or DEFAULT_CUDA_ARCH


def check_artifacts(
    spec: kernel_pb2.JobSpec, artifacts: list[job_channel_pb2.KernelArtifact]
) -> str:
    """What is wrong with a build process's artifacts for this spec; "" when nothing is."""
    reference = spec.HasField("reference") and not reference_judged(spec)
    wanted = ["kernel", *(["reference"] if reference else [])]
    roles = [a.role for a in artifacts]
    if roles != wanted:
        return f"artifacts for {roles}, wanted {wanted}"
    for a in artifacts:
        if not a.cubin.startswith(b"\x7fELF") or not a.function:
            return f"the {a.role} artifact is not a cubin with a function"
    return ""
