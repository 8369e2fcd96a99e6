"""The watchdog's events, translated: job processes, device readings, XIDs, resets, warnings.

The watchdog's control channel (fleet/watchdog.py) hands every event here (`on_event`), and
the front end's end of a new job process's channel just before its WorkerStarted
(`on_job_channel`). An event becomes the fleet's state (the job process table, the devices of
fleet/devices.py, the sandbox report), counters, metrics, operations events and log lines.
What it means for a job is the job manager's, called from here: a job process's exit (its
GPU slot and memory, an extension build, its job's verdict: `JobManager.process_exited`)
and an XID (the jobs it belongs to: `JobManager.attribute_xid`, through devices.py).

Apart from devices.py: that is the fleet's state, which dispatch, the API and the health
check read; this is the watchdog's protocol reaching it, one event kind at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import operations_service_pb2 as ops_pb2

from kerneleval_server import metrics as metrics_mod
from kerneleval_server.fleet.devices import Devices, OpsEvents
from kerneleval_server.fleet.job_processes import JobChannels, JobProcess, JobProcessTable
from kerneleval_server.fleet.sandbox_report import SandboxReport, is_sandbox_feature
from kerneleval_server.fleet.watchdog import AttachedFd, WatchdogLike
from kerneleval_server.jobproc import POISONED_EXIT
from kerneleval_server.metrics import Metrics


class WatchdogEventsHost(Protocol):
    """What the watchdog's events ask of the job life cycle (jobs/manager.py JobManager):
    its tables to keep, and what an exit means for jobs (`process_exited`)."""

    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def channels(self) -> JobChannels: ...
    @property
    def fleet(self) -> Devices: ...
    @property
    def ops(self) -> OpsEvents: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def watchdog(self) -> WatchdogLike | None: ...
    def spawn(self, coro: Awaitable[Any]) -> None: ...
    def dispatch(self) -> None: ...
    def on_health_change(self) -> None: ...
    def process_exited(self, proc: JobProcess, exited: watchdog_pb2.WorkerExited) -> None: ...


log = logging.getLogger("kerneleval.jobs")
DRAIN_FALLBACK_S = 2.0  # an exited job process whose channel does not reach its end


class WatchdogEvents:
    """The job manager's (`m`) handler of the watchdog's events."""

    def __init__(self, m: WatchdogEventsHost) -> None:
        self.m = m
        # Sandbox features the host refused, and other warnings of the watchdog (also in the
        # ops log, the metrics and the service log, at WARNING); GetStats serves them.
        self.sandbox = SandboxReport()

    def on_job_channel(self, ev: watchdog_pb2.WatchdogEvent, attached: AttachedFd) -> None:
        """The descriptor of a job process's channel, just before its WorkerStarted."""
        if ev.WhichOneof("kind") != "worker_started":
            return
        proc = self.m.job_processes.announce(ev.worker_started.worker)
        if not proc.has_channel and not proc.gone:
            self.m.channels.attach(proc, attached.take())

    def on_event(self, ev: watchdog_pb2.WatchdogEvent) -> None:
        m = self.m
        kind = ev.WhichOneof("kind")
        if kind == "worker_started":
            w = ev.worker_started.worker
            proc = m.job_processes.announce(w)
            if ev.worker_started.channel_attached and not proc.has_channel:
                log.error(
                    "job process %s came without its channel; it is stopped",
                    w.worker_id,
                    extra={"worker_id": w.worker_id},
                )
                proc.gone = True
                if m.watchdog is not None:
                    m.spawn(m.watchdog.kill_worker(w.worker_id, metrics_mod.KILL_NO_CHANNEL))
            m.ops.emit(
                w.device_index,
                worker_started=ops_pb2.WorkerStartedEvent(worker=self._process_info(w)),
            )
            if self.sandbox.started_job_process():
                self._log_sandbox()
        elif kind == "worker_promoted":
            promoted = m.job_processes.by_id.get(ev.worker_promoted.worker_id)
            if promoted is not None:
                promoted.spare = False
                m.dispatch()
        elif kind == "worker_exited":
            self.on_process_exited(ev.worker_exited)
        elif kind == "xid":
            m.fleet.on_xid(ev.xid)
        elif kind == "device":
            m.fleet.on_device(ev.device.device)
        elif kind == "status":
            for status in ev.status.devices:
                m.fleet.on_device(status)
            for w in ev.status.workers:
                m.job_processes.announce(w)
        elif kind == "reset_step":
            step = ev.reset_step
            rs = ops_pb2.ResetStep(step=step.step, ok=step.ok, message=step.message)
            rs.time.FromNanoseconds(time.time_ns())
            m.ops.emit(step.device_index, reset_step=rs)
        elif kind == "reset_finished":
            rf = ev.reset_finished
            m.fleet.counters["resets"] += 1
            m.metrics.gpu_resets.labels(str(rf.device_index), str(rf.success).lower()).inc()
        elif kind == "warning":
            self._on_warning(ev.warning.feature or "watchdog", ev.warning.message)

    def _on_warning(self, feature: str, message: str) -> None:
        self.m.metrics.sandbox_warnings.labels(feature).set(1)
        if not self.sandbox.warn(feature, message):
            return  # said already (a restarted watchdog says it again)
        self.m.ops.emit(-1, warning=f"{feature}: {message}")
        if is_sandbox_feature(feature):
            log.warning("sandbox incomplete (%s): %s", feature, message)
        else:
            log.warning("watchdog warning: %s: %s", feature, message)

    def _log_sandbox(self) -> None:
        """Once a job process has started: the sandbox it got, in one line."""
        missing = self.sandbox.missing()
        if missing:
            log.warning(
                "sandbox incomplete: job processes run without %s (kerneleval doctor, GetStats)",
                ", ".join(missing),
            )
        else:
            log.info("sandbox complete: the host gave every feature of the job sandbox")

    def _process_info(self, w: watchdog_pb2.Worker) -> ops_pb2.WorkerInfo:
        info = ops_pb2.WorkerInfo(
            worker_id=w.worker_id, pid=w.pid, device_index=w.device_index, spare=w.spare
        )
        info.start_time.FromMilliseconds(w.start_time_ms)
        state = self.m.job_processes.by_id.get(w.worker_id)
        if state is not None:
            info.job_id = state.job_id
            info.completed_job_count = state.completed
            info.spare = state.spare
            info.standing_judge = bool(state.judge_key)
        return info

    def on_process_exited(self, exited: watchdog_pb2.WorkerExited, drain: bool = True) -> None:
        """A job process exited (the watchdog says so, or the front end gave it up for gone):
        out of the table, counted and told; then the job manager for what it held."""
        m = self.m
        w = exited.worker
        proc = m.job_processes.by_id.get(w.worker_id)
        if proc is not None and drain and proc.writer is not None:
            # Read what it sent before it exited (its outcome) first; then this exit.
            if proc.pending_exit is None:
                proc.pending_exit = exited
                proc.pending_exit_timer = asyncio.get_running_loop().call_later(
                    DRAIN_FALLBACK_S, self._drain_fallback, proc
                )
            return
        if proc is not None and proc.pending_exit_timer is not None:
            proc.pending_exit_timer.cancel()
        info = self._process_info(w)
        proc = m.job_processes.remove(w.worker_id)
        if proc is not None and proc.exit_watch is not None:
            proc.exit_watch.cancel()
        retired = (
            proc is not None
            and proc.outcome_seen
            and exited.signal <= 0
            and exited.exit_code in (0, POISONED_EXIT)
        )
        if not retired:  # a job process leaving after its one job is no restart
            m.fleet.counters["restarts"] += 1
            m.metrics.worker_restarted(w.device_index, exited.reason)
        ex = ops_pb2.WorkerExitedEvent(
            worker=info,
            signal=max(exited.signal, 0),
            reason=exited.reason,
            restarting=exited.restarting,
        )
        if exited.signal <= 0:
            ex.exit_code = exited.exit_code
        m.ops.emit(w.device_index, worker_exited=ex)
        log.info(
            "job process exited: %s (code %d, signal %d)",
            exited.reason,
            exited.exit_code,
            exited.signal,
            extra={"worker_id": w.worker_id},
        )
        if proc is not None:
            proc.gone = True
            m.process_exited(proc, exited)
            if proc.writer is not None:
                proc.writer.close()
        m.on_health_change()
        m.dispatch()

    def _drain_fallback(self, proc: JobProcess) -> None:
        exited = proc.pending_exit
        if exited is not None and self.m.job_processes.by_id.get(proc.worker_id) is proc:
            log.warning(
                "job process %s exited but its channel stays open",
                proc.worker_id,
                extra={"worker_id": proc.worker_id},
            )
            self.on_process_exited(exited, drain=False)

    def watchdog_lost(self) -> None:
        """The watchdog died: its job processes are gone with it (parent-death signal)."""
        self.m.fleet.warm_devices.clear()
        self.sandbox.watchdog_lost()
        for proc in list(self.m.job_processes.by_id.values()):
            exited = watchdog_pb2.WorkerExited(
                exit_code=-1, signal=9, reason="stopped", restarting=True
            )
            exited.worker.worker_id = proc.worker_id
            exited.worker.pid = proc.pid
            exited.worker.device_index = proc.device_index
            self.on_process_exited(exited, drain=False)
