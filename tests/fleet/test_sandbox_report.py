"""The front end's bookkeeping of the watchdog's warnings (issue 12: never silent)."""

from __future__ import annotations

import logging
from pathlib import Path

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval_server import config as config_mod
from kerneleval_server.fleet.sandbox_report import SandboxReport
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.manager import JobManager
from kerneleval_server.jobs.store import SqliteStore
from kerneleval_server.metrics import Metrics


def _warning(feature: str, message: str) -> watchdog_pb2.WatchdogEvent:
    return watchdog_pb2.WatchdogEvent(
        warning=watchdog_pb2.Warning(feature=feature, message=message)
    )


def _started(worker_id: str) -> watchdog_pb2.WatchdogEvent:
    ev = watchdog_pb2.WatchdogEvent()
    ev.worker_started.worker.worker_id = worker_id
    ev.worker_started.worker.pid = 4242
    ev.worker_started.worker.device_index = -1
    return ev


def test_report_dedups_by_feature_and_keeps_the_first_time() -> None:
    r = SandboxReport()
    assert r.state() == ops.SANDBOX_STATE_UNSPECIFIED  # nothing said yet: not "complete"
    assert r.warn("kmsg", "cannot read /dev/kmsg", now_ns=1_000_000_000)
    assert r.state() == ops.SANDBOX_STATE_UNSPECIFIED  # kmsg is no part of the sandbox
    assert r.started_job_process() and not r.started_job_process()
    assert r.state() == ops.SANDBOX_STATE_COMPLETE
    assert r.warn("network_namespace", "refused (EPERM)", now_ns=2_000_000_000)
    assert not r.warn("network_namespace", "refused (EPERM)", now_ns=3_000_000_000)
    assert r.warn("network_namespace", "refused (ENOSPC)", now_ns=4_000_000_000)
    assert r.warn("", "no feature named", now_ns=5_000_000_000)
    assert r.state() == ops.SANDBOX_STATE_INCOMPLETE and r.missing() == ["network_namespace"]
    got = [(w.feature, w.message, w.first_seen.seconds, w.sandbox_feature) for w in r.to_proto()]
    assert got == [
        ("kmsg", "cannot read /dev/kmsg", 1, False),
        ("network_namespace", "refused (ENOSPC)", 2, True),  # latest message, first time
        ("watchdog", "no feature named", 5, False),
    ]
    r.watchdog_lost()  # a new watchdog: what it lacked stays said
    assert r.state() == ops.SANDBOX_STATE_INCOMPLETE


def test_unknown_features_count_as_missing_sandbox_parts() -> None:
    r = SandboxReport()
    r.warn("landlock", "a future feature")
    assert r.missing() == ["landlock"] and r.state() == ops.SANDBOX_STATE_INCOMPLETE


def test_manager_logs_each_feature_once_and_serves_it(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = SqliteStore(tmp_path / "db.sqlite")
    ops_log = OpsLog()
    m = JobManager(config_mod.Config(), store, EventHub(store), ops_log, Metrics(), 600.0)
    events = m.watchdog_events  # the watchdog's events and its sandbox report
    caplog.set_level(logging.INFO, logger="kerneleval")
    events.on_event(_warning("seccomp", "no seccomp filter for this architecture"))
    events.on_event(_warning("kmsg", "cannot read /dev/kmsg"))
    # A restarted watchdog says the same again: not logged twice.
    events.on_event(_warning("seccomp", "no seccomp filter for this architecture"))
    events.on_event(_started("cpu-w0"))
    events.on_event(_started("cpu-w1"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "sandbox incomplete (seccomp): no seccomp filter for this architecture",
        "watchdog warning: kmsg: cannot read /dev/kmsg",
        "sandbox incomplete: job processes run without seccomp (kerneleval doctor, GetStats)",
    ]
    assert [e.warning for e in ops_log._recent if e.WhichOneof("kind") == "warning"] == [
        "seccomp: no seccomp filter for this architecture",
        "kmsg: cannot read /dev/kmsg",
    ]
    assert events.sandbox.state() == ops.SANDBOX_STATE_INCOMPLETE
    assert [w.feature for w in events.sandbox.to_proto()] == ["seccomp", "kmsg"]
    store.close()


def test_manager_says_complete_only_once_a_job_process_started(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = SqliteStore(tmp_path / "db.sqlite")
    m = JobManager(config_mod.Config(), store, EventHub(store), OpsLog(), Metrics(), 600.0)
    events = m.watchdog_events  # the watchdog's events and its sandbox report
    caplog.set_level(logging.INFO, logger="kerneleval")
    assert events.sandbox.state() == ops.SANDBOX_STATE_UNSPECIFIED
    events.on_event(_started("cpu-w0"))
    assert events.sandbox.state() == ops.SANDBOX_STATE_COMPLETE
    assert any(
        r.levelno == logging.INFO and r.getMessage().startswith("sandbox complete")
        for r in caplog.records
    )
    events.watchdog_lost()
    assert events.sandbox.state() == ops.SANDBOX_STATE_UNSPECIFIED  # the next one sets up anew
    store.close()
