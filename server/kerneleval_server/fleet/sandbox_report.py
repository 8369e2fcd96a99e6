"""What the job processes' sandbox lacks on this host (GetStats, `kerneleval doctor`).

The watchdog sends one Warning per feature the host refuses (a cgroup controller, a namespace,
seccomp, a user for jobs, ...) and a few other warnings (an unreadable kernel log, a protocol
error, ...). The front end keeps them, one per feature with its latest message, for as long as
it runs: a restarted watchdog on the same host says the same again.

Complete is only said once it is known: after a job process has started under the watchdog
(the sandbox is set up before that, and any feature it lacks is reported first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kerneleval.v1 import operations_service_pb2 as ops_pb2

# Warnings of the watchdog that are not a part of the sandbox missing: the kernel log for XIDs,
# a bad frame on its control channel, a worker command that cannot start, a job process or job
# cgroup that could not be made (that job process does not start at all).
OTHER_WARNINGS = frozenset({"kmsg", "protocol", "worker_command", "zygote", "cgroup", "watchdog"})


def is_sandbox_feature(feature: str) -> bool:
    """Unknown names count as sandbox features: a new one is never hidden."""
    return feature not in OTHER_WARNINGS


@dataclass
class WarningRecord:
    feature: str
    message: str
    first_seen_ns: int

    @property
    def sandbox_feature(self) -> bool:
        return is_sandbox_feature(self.feature)


class SandboxReport:
    def __init__(self) -> None:
        self.warnings: dict[str, WarningRecord] = {}
        # A job process has started since the watchdog last (re)started.
        self.job_process_started = False

    def warn(self, feature: str, message: str, now_ns: int | None = None) -> bool:
        """Records a warning; True when it is new or says something new (log it then)."""
        feature = feature or "watchdog"
        old = self.warnings.get(feature)
        if old is not None:
            if old.message == message:
                return False
            old.message = message
            return True
        self.warnings[feature] = WarningRecord(
            feature, message, time.time_ns() if now_ns is None else now_ns
        )
        return True

    def started_job_process(self) -> bool:
        """A job process started; True the first time since the watchdog (re)started."""
        first = not self.job_process_started
        self.job_process_started = True
        return first

    def watchdog_lost(self) -> None:
        """The next watchdog sets its sandbox up again: unknown until it starts a process."""
        self.job_process_started = False

    def missing(self) -> list[str]:
        """The sandbox features the host refused."""
        return [w.feature for w in self.warnings.values() if w.sandbox_feature]

    def state(self) -> ops_pb2.SandboxState:
        if self.missing():
            return ops_pb2.SANDBOX_STATE_INCOMPLETE
        if self.job_process_started:
            return ops_pb2.SANDBOX_STATE_COMPLETE
        return ops_pb2.SANDBOX_STATE_UNSPECIFIED

    def to_proto(self) -> list[ops_pb2.SandboxWarning]:
        out = []
        for w in sorted(self.warnings.values(), key=lambda w: (w.first_seen_ns, w.feature)):
            pb = ops_pb2.SandboxWarning(
                feature=w.feature, message=w.message, sandbox_feature=w.sandbox_feature
            )
            pb.first_seen.FromNanoseconds(w.first_seen_ns)
            out.append(pb)
        return out
