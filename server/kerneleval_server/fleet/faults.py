"""What a lost job process means for its job: a verdict, or one more try.

The kernel's own faults end the job at once: a crash signal (SIGSEGV, SIGBUS, ...), an
unexpected exit, an XID on its GPU, the deadline. Losses that are not the kernel's doing (a
job process stopped for a reset or a restart, an unexplained SIGKILL such as the host's OOM killer,
the front end or the watchdog going away) re-run the job while attempts remain; the last
attempt ends with the fault, so a kernel that took its process down twice is not tried again.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server.config import Config
from kerneleval_server.error_texts import NVML_OOM_ASSERT

# Signals a kernel raises itself; never worth a second try.
KERNEL_SIGNALS = {
    signal.SIGSEGV,
    signal.SIGBUS,
    signal.SIGILL,
    signal.SIGFPE,
    signal.SIGABRT,
    signal.SIGSYS,
    signal.SIGTRAP,
}
# Reasons (WorkerExited.reason) of exits the front end or an operator asked for.
SERVICE_REASONS = ("stopped", "restart", "reset", "shutdown", "killed:restart", "killed:reset")

# The watchdog's exit reason for a job process killed by StopGpuUsers (windows.cc).
GPU_OUTSIDE_PHASE_KILL = "killed:gpu_outside_phase"


# ErrorInfo.exception_type of a job whose processes reached their cgroup's memory limit.
JOB_MEMORY_LIMIT = "JobMemoryLimit"


@dataclass
class Decision:
    verdict: job_pb2.Verdict  # VERDICT_UNSPECIFIED: re-run if attempts remain
    fault: job_pb2.FaultInfo
    # The result's error, where the fault is one a client should read first (EvalResult.error).
    error: job_pb2.ErrorInfo | None = None


@dataclass
class XidSeen:
    xid: int
    category: str
    message: str
    named: bool = True  # the watchdog tied it to this job's process (pid or SetJob)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def classify_exit(
    exited: watchdog_pb2.WorkerExited,
    *,
    pending: str,
    xid: XidSeen | None,
    phase: int,
    timeout_s: float,
) -> Decision:
    """The verdict for a job whose process exited before sending its result.

    `pending` is what the front end itself asked for: "timeout", "cancel" or "".
    """
    proc = exited.worker
    fault = job_pb2.FaultInfo(
        signal=max(exited.signal, 0),
        worker_pid=proc.pid,
        worker_restarted=exited.restarting,
    )
    if exited.signal <= 0:
        fault.exit_code = exited.exit_code
    where = job_pb2.Phase.Name(phase) if phase else "startup"
    how = (
        f"killed by {signal_name(exited.signal)}"
        if exited.signal > 0
        else f"exited with code {exited.exit_code}"
    )
    restarted = "; replaced" if exited.restarting else ""
    if exited.reason == GPU_OUTSIDE_PHASE_KILL:
        fault.description = (
            f"its GPU work kept running while it was frozen for another job's timing window "
            f"(work launched outside its phases, e.g. from a thread) in {where}; worker "
            f"{proc.worker_id} killed{restarted}"
        )
        error = job_pb2.ErrorInfo(exception_type="GpuWorkOutsidePhase", message=fault.description)
        return Decision(job_pb2.VERDICT_RUNTIME_ERROR, fault, error)
    if pending == "timeout":
        fault.description = (
            f"ran past its {timeout_s:g} s timeout in {where}; worker {proc.worker_id} "
            f"killed{restarted}"
        )
        return Decision(job_pb2.VERDICT_TIMEOUT, fault)
    if xid is not None:
        fault.xid = xid.xid
        fault.xid_category = xid.category
        fault.description = (
            f"XID {xid.xid} ({xid.category}) on device {proc.device_index} in {where}; "
            f"worker {proc.worker_id} {how}{restarted}"
        )
        return Decision(job_pb2.VERDICT_DEVICE_FAULT, fault)
    if exited.reason in ("xid", "killed:xid"):
        fault.description = (
            f"the watchdog stopped worker {proc.worker_id} for an XID on device "
            f"{proc.device_index} in {where}{restarted}"
        )
        return Decision(job_pb2.VERDICT_DEVICE_FAULT, fault)
    if exited.reason == "oom":
        fault.description = (
            f"out of host memory in {where}: the job's processes reached their memory limit "
            f"(--job-memory-mib) and the kernel's OOM killer ended worker {proc.worker_id}"
            f"{restarted}"
        )
        # The numbers and what to change: explain_memory, from the service's settings.
        error = job_pb2.ErrorInfo(exception_type=JOB_MEMORY_LIMIT, message=fault.description)
        return Decision(job_pb2.VERDICT_OUT_OF_MEMORY, fault, error)
    if exited.reason in SERVICE_REASONS or exited.reason.startswith("killed:reset"):
        fault.description = f"worker {proc.worker_id} stopped by the service ({exited.reason})"
        return Decision(job_pb2.VERDICT_UNSPECIFIED, fault)
    if exited.signal in KERNEL_SIGNALS or (exited.signal <= 0 and exited.exit_code != 0):
        fault.description = f"worker {proc.worker_id} {how} in {where}{restarted}"
        return Decision(job_pb2.VERDICT_CRASHED, fault)
    # SIGKILL from outside (OOM killer), SIGTERM, or a clean exit mid-job: not clearly the
    # kernel's doing.
    fault.description = f"worker {proc.worker_id} {how} in {where} (not by the service)"
    return Decision(job_pb2.VERDICT_UNSPECIFIED, fault)


def last_attempt_verdict(decision: Decision) -> int:
    """The verdict when no attempt is left for an ambiguous loss."""
    return decision.verdict or job_pb2.VERDICT_CRASHED


# ---- what a job that ran out of memory is told (EvalResult.error.message) ----------------

# What torch and the kernel say when a job's memory ran out: its GPU's (torch's allocator; the
# assertion it raises instead where NVML is hidden), its host memory (an allocation refused), a
# full /tmp or /dev/shm (ENOSPC).
GPU_OOM_TEXTS = ("CUDA out of memory", "CUDA_ERROR_OUT_OF_MEMORY", NVML_OOM_ASSERT)
HOST_OOM_TEXTS = ("DefaultCPUAllocator: can't allocate memory", "std::bad_alloc")
NO_SPACE_TEXTS = ("No space left on device", "[Errno 28]", "ENOSPC")


@dataclass(frozen=True)
class MemoryLimits:
    """The job processes' limits, as the service set them."""

    job_mib: int  # the job process's cgroup (--job-memory-mib, or worked out: auto)
    tmp_mib: int  # its private /tmp and /dev/shm (--job-tmp-mib)
    source: str  # how job_mib was set ("set by --job-memory-mib", or "auto: ...")

    @classmethod
    def of(cls, cfg: Config) -> MemoryLimits:
        source = cfg.job_memory_source()
        if source == "--job-memory-mib":
            source = "set by --job-memory-mib"
        return cls(cfg.effective_job_memory_mib(), cfg.job_tmp_mib, source)


def explain_memory(result: job_pb2.EvalResult, device_index: int, limits: MemoryLimits) -> None:
    """A job that ran out of memory, or filled its /tmp, is told so first in its error
    message: which memory (its host memory, /tmp, its GPU's), how much against what limit, and
    what to change; on a host without a GPU, that smaller inputs would run. Nothing for any
    other result."""
    error = result.error
    said = "\n".join((error.message, result.compilation_error, error.traceback))
    lead: list[str] = []
    inputs_may_be_why = False  # host memory, past building the model
    if result.verdict == job_pb2.VERDICT_OUT_OF_MEMORY:
        if error.exception_type == JOB_MEMORY_LIMIT:
            lead.append(
                f"out of host memory: the job's processes used all {limits.job_mib} MiB of "
                "their limit (the job process's memory cgroup, its /tmp and /dev/shm files "
                f"included) and were ended; change it with --job-memory-mib "
                f"(KERNELEVAL_JOB_MEMORY_MIB; now {limits.job_mib} MiB, {limits.source})"
            )
            # While the model was built (its weights are on the host first, on any host): the
            # limit, not the inputs (classify_exit's message names the phase).
            building = f"in {job_pb2.Phase.Name(job_pb2.PHASE_COMPILING)}" in error.message
            inputs_may_be_why = not building
        elif device_index >= 0 and any(t in said for t in GPU_OOM_TEXTS):
            lead.append(
                f"out of GPU memory on GPU {device_index}: the job's tensors did not fit in its "
                "memory (torch's numbers below); no setting raises a GPU's memory: run "
                "smaller inputs (--io / the IOContract's shapes, or smaller sizes in the "
                "reference's get_inputs)"
            )
        elif any(t in said for t in HOST_OOM_TEXTS) or error.exception_type == "MemoryError":
            inputs_may_be_why = True
            lead.append(
                "out of host memory: an allocation was refused (torch's words below); a job "
                f"process may hold {limits.job_mib} MiB (its memory cgroup); change it with "
                f"--job-memory-mib (KERNELEVAL_JOB_MEMORY_MIB; {limits.source})"
            )
        if inputs_may_be_why and device_index < 0:
            lead.append(
                "this host has no GPU: a job's tensors are in host memory, within that limit, "
                "and inputs sized for a GPU (KernelBench's) may need more; smaller inputs "
                "would run: --io (the IOContract's shapes) or smaller sizes in the "
                "reference's get_inputs"
            )
    if result.verdict != job_pb2.VERDICT_OK and any(t in said for t in NO_SPACE_TEXTS):
        lead.append(
            f"the job's /tmp or /dev/shm is full: each is a private tmpfs of {limits.tmp_mib} "
            "MiB (--job-tmp-mib, KERNELEVAL_JOB_TMP_MIB), whose files count to the job's "
            f"memory limit too ({limits.job_mib} MiB, --job-memory-mib)"
        )
    if lead and not error.message.startswith(lead[0]):  # once (a result can be handed on)
        error.message = "\n".join([*lead, error.message] if error.message else lead)
