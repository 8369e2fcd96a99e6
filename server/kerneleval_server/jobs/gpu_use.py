"""A running job's use of its GPU: memory admission, the GPU gate's grants, timing windows.

A job process asks before each gated phase (a check, its timing: `JobManager` hands the
request here). Its check is admitted to the GPU's memory by what its problem was seen to need
(fleet/gpu_memory.py; on a GPU held for a job re-run alone, only that job), else it waits in
`waiting` with the others of its GPU, in order. Then the GPU gate (jobs/scheduler.py) grants
the phase: a check at once beside others, a timing window (`exclusive`) once the GPU's other
job processes are frozen (fleet/timing_windows.py), with the GPU work they had queued drained
first. Waiting for other jobs' GPU use is not a job's time: its deadline is pushed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server.fleet.gpu_memory import GpuMemory, problem_key
from kerneleval_server.fleet.job_processes import JobProcess, JobProcessTable
from kerneleval_server.fleet.timing_windows import TimingWindows, Window, public_conditions
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.running import Running
from kerneleval_server.jobs.scheduler import GpuGate
from kerneleval_server.metrics import Metrics
from kerneleval_server.spec.validation import is_timed


class GpuUseHost(Protocol):
    """What a job's GPU use asks of the job life cycle (manager.py JobManager)."""

    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def gate(self) -> GpuGate: ...
    @property
    def windows(self) -> TimingWindows: ...
    @property
    def memory(self) -> GpuMemory: ...
    @property
    def alone(self) -> set[str]: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def watchdog(self) -> WatchdogLike | None: ...
    @property
    def launched(self) -> set[str]: ...
    def held_devices(self) -> dict[int, str]: ...
    def spawn(self, coro: Awaitable[Any]) -> None: ...
    def on_protocol_violation(self, proc: JobProcess, what: str) -> None: ...


log = logging.getLogger("kerneleval.jobs")
STOP_GPU_USERS_S = 0.25  # between asks for the frozen processes that keep a window's GPU busy


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class GpuUse:
    """The job manager's (`m`) side of its jobs' GPU use."""

    def __init__(self, m: GpuUseHost) -> None:
        self.m = m
        self.waiting: dict[str, Running] = {}  # checks waiting for memory, by process, in order

    def on_host_cpu(self, device: int) -> None:
        """The device's job processes see no GPU (the CPU pseudo-device, or fake-NVML devices
        on a host without one): their timed trials run on the host's cores, as every such
        device's do, so all of them share one GPU gate and take turns for their windows: one
        timing phase at a time on the host (a kernel's and another job's judge timing at once
        on two cores read identical code as 437x, 0.004x and 3.6x)."""
        self.m.gate.share_host(device)
        self.m.windows.share_host(device)

    def ask(self, run: Running) -> None:
        """A gated phase asked for later: the GPU gate once the job's memory is admitted."""
        if self.admit(run):
            self.use(run)
        else:
            self.wait_for_memory(run)

    def ask_early(self, run: Running) -> None:
        """A check asked for as its process is sent the job (a launch: its kernel built ahead,
        it loads it, then checks it), its go (a judge started ahead) or its process asks ahead
        (a whole job, its kernel built: PhaseUpdate.ahead), when that check shares
        the GPU: the grant is there by the time the process says PHASE_VALIDATING (it waits
        for it as always; messages.py on_process_message asks nothing more), not a round trip
        later. A check that asks for the GPU alone (a timed launch's: its window) is asked
        for when the kernel is loaded, as before."""
        if self._exclusive(run, job_pb2.PHASE_VALIDATING):
            return
        run.proc.check_asked = True
        run.grant_asked_at = asyncio.get_running_loop().time()
        self.ask(run)

    def wait_for_memory(self, run: Running) -> None:
        """Until its memory is admitted, with the others (admit_waiting)."""
        self.waiting[run.proc.worker_id] = run
        self._say_memory_wait(run)

    def admit(self, run: Running, held_devices: dict[int, str] | None = None) -> bool:
        """Whether the job may use its GPU's memory now (fleet/gpu_memory.py): what its problem
        was seen to need fits beside what checking jobs hold. Nothing new is admitted on a GPU
        held for a job re-run alone, but that job. `held_devices`: m.held_devices(), when the
        caller has it."""
        device, worker_id = run.proc.device_index, run.proc.worker_id
        if not self.m.memory.admits_on(device) or self.m.memory.holds(device, worker_id):
            return True
        shares = self._shares_held(run)
        if shares:
            return self._admit_with_shares(run, shares)
        if self._judges_a_serving_kernel(run):
            # Its kernel's process waits for it (and a job alone waits for that process to
            # exit): it is not held back by a GPU held for a job alone, nor, for ever, by
            # processes that wait for their judges as its own does.
            return self.m.memory.admit(
                device, worker_id, self.memory_key(run)
            ) or self._admit_beside_shares(run, 0)
        if held_devices is None:
            held_devices = self.m.held_devices()
        held = held_devices.get(device)
        if held is not None and held != run.job.job_id:
            return False
        alone = run.job.job_id in self.m.alone
        return self.m.memory.admit(device, worker_id, self.memory_key(run), alone)

    @staticmethod
    def _judges_a_serving_kernel(run: Running) -> bool:
        """The run's process is the judge of a kernel whose process stays for its timed
        calls (JobOutcome.serves_timed_calls)."""
        return run.judged_now and run.kernel_serves and run.proc is not run.kernel_proc

    def _goes_first(self, run: Running) -> bool:
        """Judges whose kernels hold something of the GPU until they are done: shares, or
        a process waiting for its timed calls."""
        return bool(self._shares_held(run)) or self._judges_a_serving_kernel(run)

    def _shares_held(self, run: Running) -> str:
        """The holder name of what a judge's kernel handed over by descriptor, while it is
        held on the judge's GPU (judging.Judges.kernel_exited); "" when none is."""
        record = run.record
        if (
            record is None
            or not run.judged_now
            or record.gpu_held_on is None
            or record.gpu_held_on != run.proc.device_index
        ):
            return ""
        return record.holder

    def _admit_with_shares(self, run: Running, holder: str) -> bool:
        """A judge whose kernel's outputs are held on its GPU for it: its admission takes
        their place (it reads them, then lets them go). It goes first, even on a GPU held for
        a job re-run alone, which waits for exactly these bytes; and when nothing but such
        shares holds the GPU's memory, the judge is admitted even if its problem's footprint
        does not fit beside them: only judges give shares back, so waiting would be for ever."""
        memory, device, worker_id = self.m.memory, run.proc.device_index, run.proc.worker_id
        record = run.record
        assert record is not None
        size = record.shared_bytes
        memory.release(device, holder)
        if memory.admit(device, worker_id, self.memory_key(run)):
            record.gpu_held_on = None
            return True
        if self._admit_beside_shares(run, size):
            record.gpu_held_on = None
            return True
        memory.hold(device, holder, size)  # still theirs: the judge waits with the others
        return False

    def _admit_beside_shares(self, run: Running, size: int) -> bool:
        """A judge admitted when nothing but shares and serving kernels' processes hold its
        GPU's memory (its problem's footprint, at least `size`), which only judges let go."""
        memory, device = self.m.memory, run.proc.device_index
        if not memory.only_shares(device):
            return False
        key = self.memory_key(run)
        memory.hold(device, run.proc.worker_id, max(size, memory.footprint(key) or 0), key)
        return True

    def learn(self, run: Running, outcome: job_channel_pb2.JobOutcome) -> None:
        """What the job's problem needs of a GPU's memory, from a run that went to its end
        (a poisoned context or a crash says nothing of it)."""
        if (
            outcome.peak_memory_bytes
            and not outcome.context_poisoned
            and outcome.result.verdict in (job_pb2.VERDICT_OK, job_pb2.VERDICT_INCORRECT)
        ):
            key = self.memory_key(run)
            self.m.memory.learn(key, outcome.peak_memory_bytes)
            log.info(
                "GPU memory learned",
                extra={"job_id": run.job.job_id, "side": "judge" if run.judged_now else "kernel",
                       "peak_mib": outcome.peak_memory_bytes >> 20,
                       "footprint_mib": (self.m.memory.footprint(key) or 0) >> 20},
            )  # fmt: skip

    @staticmethod
    def memory_key(run: Running, judge: bool | None = None) -> str:
        """What a job's process needs is learned per problem and per side: a judge (the
        reference's outputs, the timed calls' buffers, the kernel's outputs it maps) and the
        kernel's process of one job hold different amounts at once, and one median of both
        sides' peaks under-reserved the larger (H200, the RL step: 15 re-runs alone a step).
        `judge`: the run's process is its judge (default: whether the job is being judged)."""
        if not run.memory_key:
            run.memory_key = problem_key(run.job.spec)
        if judge is None:
            judge = bool(run.judged_now)
        return run.memory_key + ("/judge" if judge else "")

    def use(self, run: Running) -> None:
        """Admitted to its GPU's memory: the job asks the GPU gate for its phase."""
        proc = run.proc
        proc.used_gpu = True
        self.m.gate.request(proc.device_index, proc.worker_id, self._exclusive(run, run.phase))

    def admit_waiting(self) -> None:
        """Jobs waiting for GPU memory, in the order they asked, per GPU: one that still does
        not fit holds back the later ones of its GPU (a large job is not passed over for
        ever). One refused because the GPU is held for another job re-run alone holds back
        nobody: that job goes first (a judge that asked before it kept it waiting for ever,
        seen on an H100)."""
        if not self.waiting:
            return
        blocked: set[int] = set()
        held_devices = self.m.held_devices()
        self._sweep({run.proc.device_index for run in self.waiting.values()})
        # Judges whose kernels hold memory or a process go first: they give it back.
        order = sorted(self.waiting.items(), key=lambda item: not self._goes_first(item[1]))
        for worker_id, run in order:
            device = run.proc.device_index
            if self.m.running.get(run.job.job_id) is not run or run.proc.job_id != run.job.job_id:
                del self.waiting[worker_id]
                continue
            if self._goes_first(run):
                if self.admit(run, held_devices):
                    del self.waiting[worker_id]
                    self.use(run)
                continue
            held = held_devices.get(device)
            if device in blocked or (held is not None and held != run.job.job_id):
                continue
            if not self.admit(run, held_devices):
                blocked.add(device)
                continue
            del self.waiting[worker_id]
            self.use(run)

    def _sweep(self, devices: set[int]) -> None:
        """What holders that no longer exist hold goes back (fleet/gpu_memory.py sweep)."""
        live = set(self.m.job_processes.by_id)  # exited ones leave the table
        live |= {
            run.record.holder for run in self.m.running.values()
            if run.record is not None and run.record.gpu_held_on is not None
        }  # fmt: skip
        for device in devices:
            for holder in self.m.memory.sweep(device, live):
                log.warning("GPU %d memory held by %s, which is gone: given back", device, holder)

    def _say_memory_wait(self, run: Running) -> None:
        if run.memory_wait_said:
            return
        run.memory_wait_said = True
        device = run.proc.device_index
        need = self.m.memory.footprint(self.memory_key(run))
        held, budget, holders = self.m.memory.usage(device)
        if need is not None and run.job.job_id not in self.m.alone:
            why = (
                f"waits for {_size(need)} of GPU {device}'s memory (what this problem's jobs "
                f"held), {_size(held)} of {_size(budget)} being held by {holders} checking "
                "job(s)"
            )
        else:
            why = (
                f"waits for GPU {device} to itself: this problem's jobs ran out of memory "
                f"beside others ({holders} job(s) hold memory there now)"
            )
        self.m.hub.log(run.job.job_id, f"kerneleval: {why}")

    def _exclusive(self, run: Running, phase: int) -> bool:
        """Whether a gated phase asks for the GPU alone. Timing does. So does the check of a
        timed job launched wholly prebuilt: a few milliseconds of GPU work, which would
        otherwise hold back the next window while it shares the GPU; in the job's own window
        the GPU goes from window to window (issue 14's timing-bound share) and the kernel is
        checked and timed under the same conditions. Other checks share the GPU, its judge's
        too: with the reference's time given (--reference-time-reuse-s) a window of its own
        froze the GPU for a few milliseconds of checking, a third of the windows of a batch."""
        if phase == job_pb2.PHASE_PROFILING:
            return True
        timed = is_timed(run.job.spec.options)
        return timed and run.job.job_id in self.m.launched and not run.judged_now

    def drive_kernel(self, run: Running) -> None:
        """A judge asks to drive its kernel's timed calls (PhaseUpdate.drives_kernel): a
        timing window in which the kernel's process, still there, runs beside it (a partner:
        never frozen). Asked like any timing phase; a judge holding its window already (the
        reference was timed in it, the kernel's process frozen) has it opened again with
        that partner."""
        if not run.kernel_serves or not run.judged_now:
            self.m.on_protocol_violation(run.proc, "a kernel's timing asked with no kernel to time")
            return
        # A kernel's process gone meanwhile is no partner: the judge finds its calls
        # unanswered, the kernel's failure.
        run.drives_kernel = True
        run.phase = job_pb2.PHASE_PROFILING
        run.grant_asked_at = asyncio.get_running_loop().time()
        self.use(run)

    def _partners(self, run: Running | None) -> list[str]:
        kernel = run.kernel_proc if run is not None and run.drives_kernel else None
        return [kernel.worker_id] if kernel is not None else []

    def grant(self, worker_id: str, exclusive: bool) -> None:
        """The GPU gate lets the job process use its GPU for the phase it asked for: checks at
        once; a timing window once the device's other job processes are frozen (a job whose
        check opened the window keeps it for its timing)."""
        proc = self.m.job_processes.by_id.get(worker_id)
        if proc is None or not proc.job_id:
            return
        run = self.m.running.get(proc.job_id)
        phase = run.phase if run is not None else job_pb2.PHASE_PROFILING
        if not exclusive:
            self._send_grant(proc, job_pb2.PHASE_VALIDATING)
        elif (
            run is not None
            and run.window is not None
            and run.window.partners == self._partners(run)
        ):
            self._send_grant(proc, phase)  # its window is open: its check ran in it
        else:
            self.m.spawn(self._open_window(proc, phase))

    async def _open_window(self, proc: JobProcess, phase: int) -> None:
        device = proc.device_index
        began = time.perf_counter()
        run = self.m.running.get(proc.job_id) if proc.job_id else None
        partners = self._partners(run)
        report = await self.m.windows.open(
            self.m.watchdog, device, proc.worker_id, partner_worker_ids=partners
        )
        log.info(
            "timing window opened",
            extra={"worker_id": proc.worker_id, "device_index": device,
                   "open_ms": round((time.perf_counter() - began) * 1e3, 2)},
        )  # fmt: skip
        run = self.m.running.get(proc.job_id) if proc.job_id else None
        if run is None or self.m.gate.holders(device)[0] != proc.worker_id:
            return  # it ended while the others froze; its release closes the window
        if run.window is not None:  # opened again, its partner thawed: the same window
            run.window.partners = partners
            self._send_grant(proc, phase)
            return
        if self.m.windows.frozen(device):
            for other in self.m.running.values():
                if other.proc.device_index == device and other is not run and other.deadline:
                    other.deadline.pause()
        run.window = Window(others_frozen=report.ok, at_start=public_conditions(report.conditions))
        run.window.partners = partners
        if not report.ok and self.m.windows.freeze_others:
            log.warning(
                "timing window of job %s on device %d: others not frozen: %s",
                run.job.job_id,
                device,
                report.message,
                extra={"job_id": run.job.job_id},
            )
        self._send_grant(proc, phase)

    def on_drain_status(self, proc: JobProcess, run: Running, busy: bool) -> None:
        """The window's holder finds the GPU still busy with the others frozen: work they
        queued outside their phases runs into its window. Until it says the wait is over, the
        watchdog is asked (every STOP_GPU_USERS_S: NVML samples come late) to kill the frozen
        processes that NVML sees using the GPU."""
        if run.window is None or self.m.gate.holders(proc.device_index)[0] != proc.worker_id:
            return  # only a window's holder waits for the GPU to drain
        run.window.draining = busy
        if not busy:
            return
        frozen = self.m.windows.frozen(proc.device_index)
        self.m.hub.log(
            run.job.job_id,
            "kerneleval: the timing window waits for GPU work that other jobs queued before "
            "they were frozen" + ("; those still using the GPU are stopped" if frozen else ""),
        )
        if frozen:
            self.m.spawn(self._stop_gpu_users(proc.device_index, run))

    async def _stop_gpu_users(self, device: int, run: Running) -> None:
        assert run.window is not None
        while (
            run.window.draining
            and not run.window.closed.is_set()
            and self.m.running.get(run.job.job_id) is run
            and self.m.watchdog is not None
        ):
            try:
                report = await self.m.watchdog.stop_gpu_users(device)
            except Exception as exc:  # noqa: BLE001 - the window goes on; its result says so
                log.warning("stopping GPU users on device %d failed: %r", device, exc)
                return
            if not report.known:
                return  # NVML cannot tell: nothing to wait for
            if report.killed_worker_ids:
                log.warning(
                    "device %d: %s kept the GPU busy while frozen for job %s's timing window: "
                    "killed (%s)",
                    device,
                    ", ".join(report.killed_worker_ids),
                    run.job.job_id,
                    report.message,
                    extra={"job_id": run.job.job_id},
                )
            await asyncio.sleep(STOP_GPU_USERS_S)

    def _send_grant(self, proc: JobProcess, phase: int) -> None:
        run = self.m.running.get(proc.job_id)
        if run is not None and run.proc is proc and run.deadline and run.grant_asked_at:
            # Waiting for other jobs' GPU use is not this job's time: push its deadline.
            waited = asyncio.get_running_loop().time() - run.grant_asked_at
            if run.window is not None:  # a check in the window waited for it, not its timing
                run.window.waited_s += waited
            if waited > 0.001:
                run.deadline.push(waited)
            run.grant_asked_at = 0.0
        proc.send(
            job_channel_pb2.FrontendMessage(
                grant=job_channel_pb2.GpuGrant(job_id=proc.job_id, phase=phase)  # type: ignore[arg-type]
            )
        )

    def window_ended(self, device: int, holder_id: str, seconds: float) -> None:
        self.m.metrics.timing_window.labels(str(device)).inc(seconds)
        holder = self.m.job_processes.by_id.get(holder_id)
        run = self.m.running.get(holder.job_id) if holder is not None and holder.job_id else None
        # The window as it is now: a judged job's next one (its judge's) is another.
        self.m.spawn(self._close_window(device, run.window if run is not None else None, seconds))

    async def _close_window(self, device: int, window: Window | None, held_s: float = 0.0) -> None:
        began = time.perf_counter()
        report = await self.m.windows.close(self.m.watchdog, device)
        log.info(
            "timing window closed",
            extra={"device_index": device, "held_ms": round(held_s * 1e3, 2),
                   "close_ms": round((time.perf_counter() - began) * 1e3, 2)},
        )  # fmt: skip
        for run in self.m.running.values():
            if run.proc.device_index == device and run.deadline is not None:
                if not run.awaiting_judge:  # paused until its judge process starts
                    run.deadline.resume()
        if window is not None:
            window.at_end = public_conditions(report.conditions)
            window.closed.set()
