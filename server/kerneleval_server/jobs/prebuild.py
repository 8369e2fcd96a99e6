"""Jobs built ahead: which jobs a build process compiles so that a launch process runs them.

A Triton or raw CUDA kernel launched from its IOContract needs its source only to compile. A
build process (no GPU, the build pseudo-device of the watchdog) compiles it into a cubin; a
launch process, a GPU job process into which no job's host code is ever loaded, launches the
cubin and may then take the next such job (docs/INTERNALS.md, "Built ahead"). Everything
else, and every job with a debug aid (they re-run the job's source in a child process), runs
whole in a job process of its own.
"""

from __future__ import annotations

import os

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from kerneleval_server.api.validation import is_triton_launch
from kerneleval_server.jobproc import BUILD_DEVICE

__all__ = ["BUILD_DEVICE", "arch_of", "check_artifacts", "kind"]

DEFAULT_CUDA_ARCH = "sm_90"  # raw CUDA built before any GPU said what it is (CPU hosts)


def kind(spec: kernel_pb2.JobSpec) -> str:
    """ "" (runs whole), "cuda" (every source raw CUDA) or "triton" (one is Triton: built ahead
    only for a GPU; without one, Triton runs in its interpreter, which needs the source)."""
    o = spec.options
    if o.sanitize or o.device_metrics or o.launch_blocking or o.device_side_assertions:
        return ""
    sources = [spec.kernel, *([spec.reference] if spec.HasField("reference") else [])]
    kinds = set()
    for k in sources:
        if k.type == kernel_pb2.KERNEL_TYPE_CUDA and len(k.io.args) > 0:
            kinds.add("cuda")
        elif is_triton_launch(k):
            kinds.add("triton")
        else:
            return ""
    return "triton" if "triton" in kinds else "cuda"


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
    wanted = ["kernel", *(["reference"] if spec.HasField("reference") else [])]
    roles = [a.role for a in artifacts]
    if roles != wanted:
        return f"artifacts for {roles}, wanted {wanted}"
    for a in artifacts:
        if not a.cubin.startswith(b"\x7fELF") or not a.function:
            return f"the {a.role} artifact is not a cubin with a function"
    return ""
