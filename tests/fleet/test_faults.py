"""What a job process's exit means for its job (faults.classify_exit)."""

from __future__ import annotations

import signal

import pytest
from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server.fleet import faults


def _exited(sig: int = 0, code: int = 0, reason: str = "crashed") -> watchdog_pb2.WorkerExited:
    ex = watchdog_pb2.WorkerExited(exit_code=code if not sig else -1, signal=sig, reason=reason)
    ex.worker.worker_id, ex.worker.pid, ex.restarting = "d0-w1", 1234, True
    return ex


@pytest.mark.parametrize(
    ("exited", "pending", "xid", "verdict"),
    [
        (_exited(sig=signal.SIGSEGV), "", None, job_pb2.VERDICT_CRASHED),
        (_exited(code=3, reason="exited"), "", None, job_pb2.VERDICT_CRASHED),
        (
            _exited(sig=signal.SIGKILL, reason="killed:timeout"),
            "timeout",
            None,
            job_pb2.VERDICT_TIMEOUT,
        ),
        (
            _exited(sig=signal.SIGKILL),
            "",
            faults.XidSeen(31, "application", ""),
            job_pb2.VERDICT_DEVICE_FAULT,
        ),
        (_exited(sig=signal.SIGKILL, reason="crashed"), "", None, job_pb2.VERDICT_UNSPECIFIED),
        (_exited(sig=signal.SIGTERM, reason="reset"), "", None, job_pb2.VERDICT_UNSPECIFIED),
        (_exited(sig=signal.SIGKILL, reason="xid"), "", None, job_pb2.VERDICT_DEVICE_FAULT),
    ],
)
def test_classify_exit(
    exited: watchdog_pb2.WorkerExited, pending: str, xid: faults.XidSeen | None, verdict: int
) -> None:
    d = faults.classify_exit(
        exited, pending=pending, xid=xid, phase=job_pb2.PHASE_VALIDATING, timeout_s=5
    )
    assert d.verdict == verdict
    assert d.fault.worker_pid == 1234 and d.fault.description
    if exited.signal:
        assert d.fault.signal == exited.signal and not d.fault.HasField("exit_code")
    else:
        assert d.fault.exit_code == exited.exit_code
    if xid is not None:
        assert d.fault.xid == 31 and d.fault.xid_category == "application"
