"""Timing windows: while a job times on a GPU, the device's other job processes are frozen.

The GPU gate (scheduler.GpuGate) keeps apart the jobs that ask for a GPU. A candidate that
launches GPU work from a background thread, after its phase or while it waits, does not ask.
So when the gate grants a timing window, the watchdog freezes every other job process of the
device (their cgroups' freezer) before the holder hears of its grant, and thaws them when the
window ends. Kernels they had already queued still run: the holder's runtime waits for them to
drain before it times (jobproc/drain.py). A frozen job's timeout stands still (deadline.py).

A window's holder may name partners: job processes of the device that run beside it and are
never frozen while the window lasts, e.g. the kernel's process whose calls a trusted judge (the
holder) drives and times from outside it.

Per device, OpenWindow and CloseWindow go to the watchdog one at a time in the order they
were asked for, so the end of one window always reaches it before the next one's start. Devices
on the host's CPU (`share_host`; one GPU gate for all of them, jobs/scheduler.py) take turns
as one device: the window of one ends before the next one's opens, whichever device it is on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2

log = logging.getLogger("kerneleval.timing_windows")

# A window whose watchdog does not answer in time opens without frozen neighbours (and says so).
WATCHDOG_REPLY_S = 5.0

# NVML's clocks event reasons (nvmlClocksEventReasons), as GpuConditions.throttle_reasons names.
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


class WindowWatchdog(Protocol):
    async def open_window(
        self,
        device_index: int,
        holder_worker_id: str,
        freeze_others: bool,
        partner_worker_ids: Sequence[str] = (),
    ) -> watchdog_pb2.WindowReport: ...

    async def close_window(self, device_index: int) -> watchdog_pb2.WindowReport: ...


def public_conditions(c: watchdog_pb2.GpuConditions) -> job_pb2.GpuConditions:
    out = job_pb2.GpuConditions(known=c.known)
    if not c.known:
        return out
    out.sm_clock_mhz = c.sm_clock_mhz
    out.memory_clock_mhz = c.memory_clock_mhz
    out.temperature_celsius = c.temperature_celsius
    out.power_watts = c.power_milliwatts / 1000
    rest = c.throttle_reasons
    for bit, name in THROTTLE_REASONS.items():
        if rest & bit:
            out.throttle_reasons.append(name)
            rest &= ~bit
    if rest:
        out.throttle_reasons.append(f"0x{rest:x}")  # a reason newer than this table
    return out


@dataclass
class Window:
    """What the service says about one job's timing window (EvalResult.timing_window)."""

    waited_s: float = 0.0
    others_frozen: bool = False
    at_start: job_pb2.GpuConditions = field(default_factory=job_pb2.GpuConditions)
    at_end: job_pb2.GpuConditions | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False  # the holder waits for a GPU others' queued work keeps busy
    partners: list[str] = field(default_factory=list)  # job processes it lets run too

    def fill(self, out: job_pb2.TimingWindow) -> None:
        out.exclusive = True
        out.waited.FromNanoseconds(int(max(self.waited_s, 0.0) * 1e9))
        out.others_frozen = self.others_frozen
        out.at_start.CopyFrom(self.at_start)
        if self.at_end is not None:
            out.at_end.CopyFrom(self.at_end)


class TimingWindows:
    """Opens and closes the devices' windows through the watchdog, one call at a time each."""

    def __init__(self, freeze_others: bool) -> None:
        self.freeze_others = freeze_others
        self._locks: dict[int, asyncio.Lock] = {}
        self._frozen: set[int] = set()  # devices whose other job processes are frozen now
        self._host_lock: asyncio.Lock | None = None  # the devices on the host's CPU share it

    def share_host(self, device_index: int) -> None:
        """The device runs its jobs on the host's CPU: its windows' calls take turns with
        every such device's (a lock held now stays until the device's next idle moment)."""
        if self._host_lock is None:
            self._host_lock = asyncio.Lock()
        lock = self._locks.get(device_index)
        if lock is None or not lock.locked():
            self._locks[device_index] = self._host_lock

    def frozen(self, device_index: int) -> bool:
        """Whether the device's job processes, but a window's holder, are frozen now."""
        return device_index in self._frozen

    async def open(
        self,
        watchdog: WindowWatchdog | None,
        device_index: int,
        holder_worker_id: str,
        partner_worker_ids: Sequence[str] = (),
    ) -> watchdog_pb2.WindowReport:
        """Opens the device's window for the holder; its partners run beside it, unfrozen."""
        partners = tuple(partner_worker_ids)  # as asked, whatever the caller's list becomes
        async with self._lock(device_index):
            report = await self._call(
                watchdog,
                device_index,
                "open",
                lambda w: w.open_window(
                    device_index, holder_worker_id, self.freeze_others, partners
                ),
            )
            if not self.freeze_others:
                report.ok = False  # nothing was frozen
            elif report.ok or report.frozen_worker_ids:  # a partial freeze too: close undoes it
                self._frozen.add(device_index)
            return report

    async def close(
        self, watchdog: WindowWatchdog | None, device_index: int
    ) -> watchdog_pb2.WindowReport:
        async with self._lock(device_index):
            report = await self._call(
                watchdog, device_index, "close", lambda w: w.close_window(device_index)
            )
            self._frozen.discard(device_index)
            return report

    def _lock(self, device_index: int) -> asyncio.Lock:
        return self._locks.setdefault(device_index, asyncio.Lock())

    async def _call(
        self,
        watchdog: WindowWatchdog | None,
        device_index: int,
        what: str,
        call: Callable[[WindowWatchdog], Awaitable[watchdog_pb2.WindowReport]],
    ) -> watchdog_pb2.WindowReport:
        if watchdog is None:
            return watchdog_pb2.WindowReport(device_index=device_index, message="no watchdog")
        try:
            return await asyncio.wait_for(call(watchdog), WATCHDOG_REPLY_S)
        except Exception as exc:  # noqa: BLE001 - a window never fails a job: it says so
            log.warning("%s of the timing window on device %d failed: %r", what, device_index, exc)
            return watchdog_pb2.WindowReport(device_index=device_index, message=repr(exc))
