"""What a job process says on its channel, routed to where it matters (the job life cycle's
`JobProcessHandler`, fleet/job_processes.py): its Hello (the device is warm), its outcome
(the life cycle's `on_outcome`), a build process's answers (builds/paths.py), a judge's
(judging.py), its phases (the GPU gate and timing windows: gpu_use.py), its progress and log
lines (job events), its channel's end. What breaks the channel's protocol ends its job
(the life cycle's `on_protocol_violation`).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server.fleet.devices import Devices
from kerneleval_server.fleet.job_processes import JobProcess
from kerneleval_server.jobproc import BUILD_DEVICE, GATED_PHASES
from kerneleval_server.jobs.builds import prebuild
from kerneleval_server.jobs.builds.paths import BuildPaths
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.gpu_use import GpuUse
from kerneleval_server.jobs.judging import Judges
from kerneleval_server.jobs.running import Running, Stage
from kerneleval_server.jobs.scheduler import GpuGate
from kerneleval_server.jobs.shared_queue import SharedQueue

LOST_FALLBACK_S = 10.0  # a dropped job process connection the watchdog never explains


class WatchdogExits(Protocol):
    def on_process_exited(self, exited: watchdog_pb2.WorkerExited, drain: bool = True) -> None: ...


class MessagesHost(Protocol):
    """What a job process's messages ask of the job life cycle (manager.py JobManager)."""

    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def gate(self) -> GpuGate: ...
    @property
    def gpu_use(self) -> GpuUse: ...
    @property
    def judges(self) -> Judges: ...
    @property
    def builds(self) -> BuildPaths: ...
    @property
    def fleet(self) -> Devices: ...
    @property
    def shared(self) -> SharedQueue | None: ...
    @property
    def watchdog_events(self) -> WatchdogExits: ...
    def on_health_change(self) -> None: ...
    def dispatch(self) -> None: ...
    def on_outcome(self, proc: JobProcess, outcome: job_channel_pb2.JobOutcome) -> None: ...
    def on_protocol_violation(self, proc: JobProcess, what: str) -> None: ...
    def watch_exit(self, proc: JobProcess) -> None: ...
    def on_process_lost(self, job_id: str, worker_id: str) -> None: ...


class JobProcessMessages:
    """The job life cycle's (`m`) handler of its job processes' channels."""

    def __init__(self, m: MessagesHost) -> None:
        self.m = m

    def on_protocol_violation(self, proc: JobProcess, what: str) -> None:
        self.m.on_protocol_violation(proc, what)

    def on_process_ready(self, proc: JobProcess) -> None:
        if proc.device_index == BUILD_DEVICE:
            self.m.fleet.warm_devices.add(BUILD_DEVICE)  # builds are ready (fleet/readiness.py)
            self.m.on_health_change()
            self.m.dispatch()
            return
        assert proc.hello is not None
        arch = prebuild.arch_of(proc.hello.device.compute_capability)
        if arch:
            self.m.builds.device_arch[proc.device_index] = arch
        if not proc.hello.device.compute_capability:  # no GPU: it times on the host's CPU
            self.m.gpu_use.on_host_cpu(proc.device_index)
        self.m.builds.engine_judges = proc.hello.judges
        self.m.fleet.warm_devices.add(proc.device_index)
        self.m.on_health_change()
        self.m.dispatch()
        if self.m.shared is not None:
            self.m.shared.claim_soon()

    def on_process_message(self, proc: JobProcess, msg: job_channel_pb2.JobProcessMessage) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "outcome":
            self.m.on_outcome(proc, msg.outcome)
            return
        if self.m.builds.on_build_message(proc, msg, kind):
            return
        if kind == "judge_prepared":  # before its JudgeGo or just after (the frames cross)
            proc.prepared_job = msg.judge_prepared.job_id
            self.m.gate.release(proc.device_index, proc.worker_id)
            return
        sub = getattr(msg, kind) if kind else None
        run = self.m.running.get(sub.job_id) if sub is not None else None
        if sub is not None and self.m.judges.answers_ahead(proc, sub.job_id, run):
            self.m.judges.on_ahead_message(run, proc, msg)
            return
        if run is None or run.proc is not proc or run.outcome is not None:
            return
        if kind == "phase" and msg.phase.ahead:
            self._ask_ahead(run, msg.phase.phase)
            return
        event = self.m.hub.next_event(run.job.job_id)
        if kind == "phase":
            run.phase = msg.phase.phase
            event.phase.phase = msg.phase.phase
            if msg.phase.phase not in GATED_PHASES:
                self.m.hub.publish(event)
                return
            if proc.check_asked and msg.phase.phase == job_pb2.PHASE_VALIDATING:
                proc.check_asked = False  # asked for already: granted or waiting
                self.m.hub.publish(event)
                return
            run.grant_asked_at = asyncio.get_running_loop().time()
            if msg.phase.drives_kernel:
                self.m.gpu_use.drive_kernel(run)
                self.m.hub.publish(event)
                return
            if (
                msg.phase.phase == job_pb2.PHASE_PROFILING
                and run.kernel_proc is not None
                and run.kernel_proc is not proc
                and not run.kernel_serves
            ):
                # A judge, before its kernel's process has exited: nothing of the kernel may
                # still run on the GPU while the reference is timed (judges.kernel_exited asks).
                run.stage = Stage.TIMING_WAITS_KERNEL
                self.m.hub.publish(event)
                return
            if self.m.gpu_use.admit(run):
                # The job process waits for the grant (a check's comes at once): it goes out
                # before the event is stored. No other event of the job comes in between.
                try:
                    self.m.gpu_use.use(run)
                finally:
                    self.m.hub.publish(event)
            else:
                self.m.hub.publish(event)
                self.m.gpu_use.wait_for_memory(run)
        elif kind == "progress":
            p = msg.progress
            event.progress.phase = p.phase
            event.progress.done_count = p.done_count
            event.progress.total_count = p.total_count
            self.m.hub.publish(event)
        elif kind == "log":
            event.log.text = msg.log.text
            self.m.hub.publish(event)
        elif kind == "drain":
            self.m.gpu_use.on_drain_status(proc, run, msg.drain.busy)
        elif kind == "extension":
            self.m.builds.on_extension_request(proc, run, msg.extension)

    def _ask_ahead(self, run: Running, phase: int) -> None:
        """PhaseUpdate.ahead: a check's grant asked for before its phase (its process says
        PHASE_VALIDATING later and waits for it there). Only before that phase, once."""
        if (
            phase == job_pb2.PHASE_VALIDATING
            and run.phase < job_pb2.PHASE_VALIDATING
            and not run.proc.check_asked
        ):
            self.m.gpu_use.ask_early(run)

    def on_process_disconnected(self, proc: JobProcess) -> None:
        proc.gone = True
        if proc.pending_exit is not None:
            self.m.watchdog_events.on_process_exited(proc.pending_exit)
            return
        # Without its channel a job process is of no use: it exits at once (the runtime's
        # reader does), or it is killed (a candidate that closed the channel and stayed).
        self.m.watch_exit(proc)
        self.m.on_health_change()
        run = self.m.running.get(proc.job_id) if proc.job_id else None
        if run is not None and run.outcome is None:
            # The watchdog's WorkerExited says why; this only guards against never hearing.
            run.timers.append(
                asyncio.get_running_loop().call_later(
                    LOST_FALLBACK_S, self.m.on_process_lost, run.job.job_id, proc.worker_id
                )
            )
