"""The timing window's parts on their own: a deadline that waiting and freezing do not use up,
NVML's throttle bits as names, the drain probe, and one watchdog call at a time per device."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Sequence

import pytest
from kerneleval.internal.v1 import watchdog_pb2
from kerneleval_server.fleet.timing_windows import TimingWindows, public_conditions
from kerneleval_server.jobproc import drain
from kerneleval_server.jobs.deadline import Deadline


def test_a_paused_deadline_keeps_its_remaining_time() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        fired: list[float] = []
        d = Deadline(loop, 0.2, lambda: fired.append(loop.time() - start))
        await asyncio.sleep(0.1)
        d.pause()  # frozen for another job's window: 0.1 s left
        await asyncio.sleep(0.3)
        assert not fired and d.paused and d.remaining() == pytest.approx(0.1, abs=0.03)
        d.push(0.1)  # waited for the GPU while paused: counts too
        d.resume()
        await asyncio.sleep(0.3)
        return fired

    (fired,) = asyncio.run(main())
    assert fired == pytest.approx(0.6, abs=0.06)  # 0.1 run + 0.3 frozen + 0.1 left + 0.1 pushed


def test_a_cancelled_deadline_never_fires_even_when_resumed() -> None:
    async def main() -> list[int]:
        fired: list[int] = []
        d = Deadline(asyncio.get_running_loop(), 0.05, lambda: fired.append(1))
        d.pause()
        d.cancel()
        d.resume()
        d.push(0.01)
        await asyncio.sleep(0.15)
        return fired

    assert asyncio.run(main()) == []


def test_gpu_conditions_name_nvml_throttle_reasons() -> None:
    c = public_conditions(
        watchdog_pb2.GpuConditions(
            known=True, sm_clock_mhz=1755, memory_clock_mhz=2619, temperature_celsius=83,
            power_milliwatts=699_500, throttle_reasons=0x4 | 0x20 | 0x1000,
        )
    )  # fmt: skip
    assert (c.sm_clock_mhz, c.memory_clock_mhz, c.temperature_celsius) == (1755, 2619, 83)
    assert c.power_watts == pytest.approx(699.5)
    assert list(c.throttle_reasons) == ["sw_power_cap", "sw_thermal_slowdown", "0x1000"]
    unknown = public_conditions(watchdog_pb2.GpuConditions(known=False, sm_clock_mhz=5))
    assert not unknown.known and unknown.sm_clock_mhz == 0


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_torch(clock: _FakeClock, busy_probes: int) -> types.ModuleType:
    """A torch whose synchronize takes 2 ms for the first busy_probes probes (another
    context's queued kernels), then 20 us."""
    probes = [0]

    class Tensor:
        def add_(self, _: int) -> None:
            probes[0] += 1

    def synchronize() -> None:
        clock.now += 2e-3 if 0 < probes[0] <= busy_probes else 20e-6

    cuda = types.SimpleNamespace(is_initialized=lambda: True, synchronize=synchronize)
    return types.SimpleNamespace(cuda=cuda, zeros=lambda *a, **k: Tensor())  # type: ignore[return-value]


def test_drain_waits_until_probes_are_quick_in_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock()
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(clock, busy_probes=10))
    said: list[bool] = []
    waited, drained = drain.wait_for_idle_gpu(clock=clock, on_busy=said.append)
    assert drained and said == []  # 20 ms: not long enough to call anyone
    assert waited == pytest.approx(10 * 2e-3 + (drain.IDLE_RUNS + 1) * 20e-6, rel=0.01)


def test_drain_says_when_the_gpu_stays_busy_and_when_it_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Busy past BUSY_AFTER_S: the front end hears of it (it has the frozen processes whose
    queued work this is stopped), then hears that the wait is over."""
    clock = _FakeClock()
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(clock, busy_probes=200))  # 0.4 s
    said: list[tuple[bool, float]] = []
    waited, drained = drain.wait_for_idle_gpu(
        clock=clock, on_busy=lambda busy: said.append((busy, clock.now))
    )
    assert drained and waited == pytest.approx(0.4, abs=0.01)
    assert [b for b, _ in said] == [True, False]
    assert said[0][1] == pytest.approx(drain.BUSY_AFTER_S, abs=0.003)


def test_drain_gives_up_at_its_limit_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock()
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(clock, busy_probes=10**9))
    said: list[bool] = []
    waited, drained = drain.wait_for_idle_gpu(limit_s=0.5, clock=clock, on_busy=said.append)
    assert not drained and 0.5 <= waited < 0.51
    assert said == [True, False]


def test_drain_without_a_cuda_context_is_immediate(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert drain.wait_for_idle_gpu() == (0.0, True)


class _RecordingWatchdog:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.partners: list[tuple[str, ...]] = []

    async def open_window(
        self,
        device_index: int,
        holder_worker_id: str,
        freeze_others: bool,
        partner_worker_ids: Sequence[str] = (),
    ) -> watchdog_pb2.WindowReport:
        self.partners.append(tuple(partner_worker_ids))
        self.calls.append(f"open {device_index} {holder_worker_id} start")
        await asyncio.sleep(0.05)
        self.calls.append(f"open {device_index} {holder_worker_id} end")
        return watchdog_pb2.WindowReport(
            device_index=device_index, ok=True, frozen_worker_ids=["x"]
        )

    async def close_window(self, device_index: int) -> watchdog_pb2.WindowReport:
        self.calls.append(f"close {device_index}")
        return watchdog_pb2.WindowReport(device_index=device_index, ok=True)


def test_window_calls_go_one_at_a_time_per_device_in_order() -> None:
    async def main() -> tuple[_RecordingWatchdog, list[bool]]:
        wd = _RecordingWatchdog()
        windows = TimingWindows(freeze_others=True)
        frozen: list[bool] = []
        opened = asyncio.ensure_future(windows.open(wd, 0, "a"))
        other_device = asyncio.ensure_future(windows.open(wd, 1, "b"))
        closed = asyncio.ensure_future(windows.close(wd, 0))  # asked while the open runs
        await asyncio.sleep(0.01)
        frozen.append(windows.frozen(0))  # not before the watchdog said so
        assert (await opened).ok
        await closed
        await other_device
        frozen.append(windows.frozen(0))
        frozen.append(windows.frozen(1))
        return wd, frozen

    wd, frozen = asyncio.run(main())
    d0 = [c for c in wd.calls if " 0" in c]
    assert d0 == ["open 0 a start", "open 0 a end", "close 0"]
    # device 1's open did not wait for device 0's
    assert wd.calls.index("open 1 b start") < wd.calls.index("open 0 a end")
    assert frozen == [False, False, True]


def test_a_window_without_freezing_or_watchdog_says_others_were_not_frozen() -> None:
    async def main() -> tuple[bool, bool, bool]:
        off = TimingWindows(freeze_others=False)
        report = await off.open(_RecordingWatchdog(), 0, "a")
        none = await TimingWindows(freeze_others=True).open(None, 0, "a")
        return report.ok, off.frozen(0), none.ok

    assert asyncio.run(main()) == (False, False, False)


def test_a_window_passes_its_partners_to_the_watchdog_and_none_by_default() -> None:
    """A judge's window names the kernel's job process as its partner (never frozen)."""

    async def main() -> list[tuple[str, ...]]:
        wd = _RecordingWatchdog()
        windows = TimingWindows(freeze_others=True)
        assert (await windows.open(wd, 0, "judge", ["kernel"])).ok
        await windows.close(wd, 0)
        assert (await windows.open(wd, 0, "a")).ok  # every existing caller: no partners
        await windows.close(wd, 0)
        return wd.partners

    assert asyncio.run(main()) == [("kernel",), ()]
