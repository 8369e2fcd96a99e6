"""What a lost worker means for its job: a verdict, or one more try.

The kernel's own faults end the job at once: a crash signal (SIGSEGV, SIGBUS, ...), an
unexpected exit, an XID on its GPU, the deadline. Losses that are not the kernel's doing (a
worker stopped for a reset or a restart, an unexplained SIGKILL such as the host's OOM killer,
the front end or the watchdog going away) re-run the job while attempts remain; the last
attempt ends with the fault, so a kernel that took its worker down twice is not tried again.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2

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


@dataclass
class Decision:
    verdict: int  # job_pb2.Verdict; VERDICT_UNSPECIFIED means: re-run if attempts remain
    fault: job_pb2.FaultInfo


@dataclass
class XidSeen:
    xid: int
    category: str
    message: str
    named: bool = True  # the watchdog tied it to this job's worker (pid or SetJob)


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
    """The verdict for a job whose worker exited before sending its result.

    `pending` is what the front end itself asked for: "timeout", "cancel" or "".
    """
    worker = exited.worker
    fault = job_pb2.FaultInfo(
        signal=max(exited.signal, 0),
        worker_pid=worker.pid,
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
            f"{worker.worker_id} killed{restarted}"
        )
        return Decision(job_pb2.VERDICT_RUNTIME_ERROR, fault)
    if pending == "timeout":
        fault.description = (
            f"ran past its {timeout_s:g} s timeout in {where}; worker {worker.worker_id} "
            f"killed{restarted}"
        )
        return Decision(job_pb2.VERDICT_TIMEOUT, fault)
    if xid is not None:
        fault.xid = xid.xid
        fault.xid_category = xid.category
        fault.description = (
            f"XID {xid.xid} ({xid.category}) on device {worker.device_index} in {where}; "
            f"worker {worker.worker_id} {how}{restarted}"
        )
        return Decision(job_pb2.VERDICT_DEVICE_FAULT, fault)
    if exited.reason in ("xid", "killed:xid"):
        fault.description = (
            f"the watchdog stopped worker {worker.worker_id} for an XID on device "
            f"{worker.device_index} in {where}{restarted}"
        )
        return Decision(job_pb2.VERDICT_DEVICE_FAULT, fault)
    if exited.reason == "oom":
        fault.description = (
            f"out of host memory in {where}: the job's processes reached their memory limit "
            f"(--job-memory-mib) and the kernel's OOM killer ended worker {worker.worker_id}"
            f"{restarted}"
        )
        return Decision(job_pb2.VERDICT_OUT_OF_MEMORY, fault)
    if exited.reason in SERVICE_REASONS or exited.reason.startswith("killed:reset"):
        fault.description = f"worker {worker.worker_id} stopped by the service ({exited.reason})"
        return Decision(job_pb2.VERDICT_UNSPECIFIED, fault)
    if exited.signal in KERNEL_SIGNALS or (exited.signal <= 0 and exited.exit_code != 0):
        fault.description = f"worker {worker.worker_id} {how} in {where}{restarted}"
        return Decision(job_pb2.VERDICT_CRASHED, fault)
    # SIGKILL from outside (OOM killer), SIGTERM, or a clean exit mid-job: not clearly the
    # kernel's doing.
    fault.description = f"worker {worker.worker_id} {how} in {where} (not by the service)"
    return Decision(job_pb2.VERDICT_UNSPECIFIED, fault)


def last_attempt_verdict(decision: Decision) -> int:
    """The verdict when no attempt is left for an ambiguous loss."""
    return decision.verdict or job_pb2.VERDICT_CRASHED
