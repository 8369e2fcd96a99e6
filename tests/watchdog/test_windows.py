"""Timing windows (OpenWindow/CloseWindow): the real watchdog freezes a device's other job
processes through their cgroups' freezer while one times, and reports the GPU's conditions;
StopGpuUsers kills the frozen ones that the (fake) NVML's per-process utilization samples show
using the GPU since their freeze. On the CPU a frozen stand-in is seen from outside: its CPU
time stops (it burns a CPU when told to) and its cgroup reads frozen."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
from kerneleval.internal.v1 import watchdog_pb2 as pb
from kerneleval_server.fleet.watchdog import WatchdogError
from wd_harness import Harness, cgroup_members, pid_alive

CGROUP = Path("/sys/fs/cgroup")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="job cgroups need root")


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def watchdog_cgroups(pid: int) -> list[Path]:
    roots = [CGROUP] + [p for p in CGROUP.iterdir() if p.is_dir()]
    return [d for r in roots for d in r.rglob(f"kerneleval-{pid}")]


def freezer_state(pid: int) -> str:
    """FROZEN, FREEZING or THAWED: the freezer of the process's job cgroup (v1 or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "kerneleval-" not in path:
            continue
        if "freezer" in controllers.split(","):
            return (CGROUP / "freezer" / path.lstrip("/") / "freezer.state").read_text().strip()
        if controllers == "" and (CGROUP / "cgroup.controllers").exists():
            folder = CGROUP / path.lstrip("/")
            if "frozen 1" in (folder / "cgroup.events").read_text():
                return "FROZEN"
            return "FREEZING" if (folder / "cgroup.freeze").read_text().strip() == "1" else "THAWED"
    raise AssertionError(f"no job cgroup with a freezer for pid {pid}")


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def running(pids: list[int], seconds: float = 0.4) -> dict[int, bool]:
    """For each pid: whether it used CPU time in the next `seconds`."""
    before = {p: cpu_ticks(p) for p in pids}
    await asyncio.sleep(seconds)
    return {p: cpu_ticks(p) > before[p] for p in pids}


def require_freezer(harness: Harness) -> None:
    if os.geteuid() != 0:
        pytest.skip("job cgroups need root")
    refused = [
        e.warning.message for e in harness.of("warning") if e.warning.feature == "cgroup_freezer"
    ]
    if refused:
        pytest.skip(f"this host has no writable cgroup freezer: {refused[0]}")


async def burning(harness: Harness, workers: list[pb.Worker]) -> None:
    """Every one of them burns a CPU (and has said so)."""
    for w in workers:
        await harness.report(w.worker_id)
        harness.command(w.worker_id, "burn")
    for w in workers:
        channel = harness.channels[w.worker_id]
        await harness.wait_for(lambda c=channel: c.of("burning"), 5, f"{w.worker_id} to burn")


def test_window_freezes_the_others_and_close_thaws_them(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=2, warm_spare=True))
        require_freezer(harness)
        workers = await harness.started(3)
        await burning(harness, workers)
        holder, *others = workers
        pids = [w.pid for w in workers]

        report = await wd.open_window(0, holder.worker_id, True)
        assert report.ok and report.message == "" and report.device_index == 0
        assert sorted(report.frozen_worker_ids) == sorted(w.worker_id for w in others)
        assert [freezer_state(w.pid) for w in others] == ["FROZEN", "FROZEN"]
        assert freezer_state(holder.pid) == "THAWED"
        assert await running(pids) == {holder.pid: True, others[0].pid: False, others[1].pid: False}
        # A new holder: the old one is frozen with the others, the new one runs.
        report = await wd.open_window(0, others[0].worker_id, True)
        assert report.ok
        assert sorted(report.frozen_worker_ids) == sorted([holder.worker_id, others[1].worker_id])
        assert await running(pids) == {holder.pid: False, others[0].pid: True, others[1].pid: False}

        report = await wd.close_window(0)
        assert report.ok and report.device_index == 0 and not report.frozen_worker_ids
        assert all(freezer_state(p) == "THAWED" for p in pids)
        assert all((await running(pids)).values())
        # freeze_others=false (timing isolation off): nothing is frozen.
        report = await wd.open_window(0, holder.worker_id, False)
        assert report.ok and not report.frozen_worker_ids
        assert all((await running(pids)).values())
        assert (await wd.close_window(0)).ok
        # No window open: CloseWindow only reads the conditions.
        report = await wd.close_window(0)
        assert report.ok and report.conditions.known
        await wd.shutdown(0)

    run(body())


def test_job_process_started_in_a_window_is_frozen_until_it_closes(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, warm_spare=True))
        require_freezer(harness)
        holder, spare = await harness.started(2)
        await harness.report(spare.worker_id)
        report = await wd.open_window(0, holder.worker_id, True)
        assert list(report.frozen_worker_ids) == [spare.worker_id]
        await wd.kill_worker(spare.worker_id, "test")  # its replacement starts in the window
        new = (await harness.started(3))[2]
        # Frozen before its WorkerStarted was sent.
        assert new.spare and freezer_state(new.pid) == "FROZEN"
        assert not (await running([new.pid]))[new.pid]
        report = await wd.close_window(0)
        assert report.ok
        assert freezer_state(new.pid) == "THAWED"
        await harness.report(new.worker_id)  # it runs: its first report comes
        # Reopened, the window freezes it like the others.
        report = await wd.open_window(0, holder.worker_id, True)
        assert list(report.frozen_worker_ids) == [new.worker_id]
        await wd.close_window(0)
        await wd.shutdown(0)

    run(body())


def test_warming_job_processes_run_in_a_window_until_said_warm(harness: Harness) -> None:
    """Configure.warming_runs_in_windows (--freeze-warming false): a window leaves the job
    processes that have not been said warm running (the pool refills meanwhile); a
    JobProcessWarm freezes one at once in the open window, and the next window freezes it too.
    An unknown process is refused."""

    async def body() -> None:
        cfg = harness.configure(
            gpus=1, workers_per_device=2, warm_spare=True, warming_runs_in_windows=True
        )
        wd = await harness.start(cfg)
        require_freezer(harness)
        workers = await harness.started(3)
        await burning(harness, workers)
        holder, warm, warming = workers
        await wd.job_process_warm(holder.worker_id)
        await wd.job_process_warm(warm.worker_id)
        report = await wd.open_window(0, holder.worker_id, True)
        assert report.ok and list(report.frozen_worker_ids) == [warm.worker_id]
        assert freezer_state(warming.pid) == "THAWED"
        assert (await running([warming.pid]))[warming.pid]
        await wd.job_process_warm(warming.worker_id)  # acknowledged once frozen
        assert freezer_state(warming.pid) == "FROZEN"
        assert not (await running([warming.pid]))[warming.pid]
        assert (await wd.close_window(0)).ok
        assert freezer_state(warming.pid) == "THAWED"
        report = await wd.open_window(0, holder.worker_id, True)
        assert sorted(report.frozen_worker_ids) == sorted([warm.worker_id, warming.worker_id])
        assert (await wd.close_window(0)).ok
        with pytest.raises(WatchdogError, match="no worker"):
            await wd.job_process_warm("d0-nobody")
        await wd.shutdown(0)

    run(body())


def test_frozen_job_process_killed_dies_and_leaves_the_window(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=2, warm_spare=True))
        require_freezer(harness)
        holder, victim, spare = await harness.started(3)
        await burning(harness, [victim])
        await harness.report(spare.worker_id)
        await wd.set_job(victim.worker_id, "job-late")
        report = await wd.open_window(0, holder.worker_id, True)
        assert victim.worker_id in report.frozen_worker_ids
        assert freezer_state(victim.pid) == "FROZEN"
        await wd.kill_worker(victim.worker_id, "timeout")
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == victim.worker_id and ex.worker.job_id == "job-late"
        assert ex.reason == "killed:timeout" and ex.signal == 9 and ex.restarting
        assert not pid_alive(victim.pid)
        # The spare took its place and stays frozen; the new spare starts frozen.
        assert [e.worker_promoted.worker_id for e in harness.of("worker_promoted")] == [
            spare.worker_id
        ]
        new = (await harness.started(4))[3]
        assert freezer_state(spare.pid) == freezer_state(new.pid) == "FROZEN"
        report = await wd.open_window(0, holder.worker_id, True)  # the same window, again
        assert sorted(report.frozen_worker_ids) == sorted([spare.worker_id, new.worker_id])
        report = await wd.close_window(0)
        assert report.ok, report.message
        assert freezer_state(spare.pid) == freezer_state(new.pid) == "THAWED"
        await wd.shutdown(0)

    run(body())


def test_window_closes_when_its_holder_exits(harness: Harness) -> None:
    """A window never outlives its holder: the others run again when it exits."""

    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, warm_spare=True))
        require_freezer(harness)
        holder, spare = await harness.started(2)
        await harness.report(holder.worker_id)
        await wd.open_window(0, holder.worker_id, True)
        assert freezer_state(spare.pid) == "FROZEN"
        harness.command(holder.worker_id, "exit 0")
        await harness.exited(1)
        await harness.wait_for(lambda: freezer_state(spare.pid) == "THAWED", 2, "thawed")
        new = (await harness.started(3))[2]  # the replacement spare is not frozen
        assert freezer_state(new.pid) == "THAWED"
        report = await wd.close_window(0)
        assert report.ok and not report.frozen_worker_ids
        await wd.shutdown(0)

    run(body())


def test_window_partners_run_beside_the_holder(harness: Harness) -> None:
    """A judge holds the window and the kernel's job process it drives is its partner: both
    run while the rest of the device is frozen. A partner frozen for an earlier window thaws,
    StopGpuUsers leaves it alone, and a partner that is no job process of the device changes
    nothing."""

    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=2, warm_spare=True))
        require_freezer(harness)
        workers = await harness.started(3)
        await burning(harness, workers)
        judge, kernel, other = workers
        pids = [w.pid for w in workers]
        # An earlier window (other's) froze both.
        report = await wd.open_window(0, other.worker_id, True)
        assert sorted(report.frozen_worker_ids) == sorted([judge.worker_id, kernel.worker_id])
        assert freezer_state(kernel.pid) == "FROZEN"

        report = await wd.open_window(0, judge.worker_id, True, [kernel.worker_id])
        assert report.ok and report.message == ""
        assert list(report.frozen_worker_ids) == [other.worker_id]
        assert [freezer_state(p) for p in pids] == ["THAWED", "THAWED", "FROZEN"]
        assert await running(pids) == {judge.pid: True, kernel.pid: True, other.pid: False}
        # The kernel's GPU use is the window's own work, long after its earlier freeze.
        await asyncio.sleep(SAMPLE_MARGIN_S)
        harness.nvml(f"utilization 0 {kernel.pid} sm=90")
        harness.nvml(f"utilization 0 {judge.pid} sm=5")
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids, users.message
        assert f"{kernel.pid} ({kernel.worker_id}, a partner)" in users.message
        assert f"{judge.pid} ({judge.worker_id}, the holder)" in users.message

        # A partner that is no job process of the device: refused, the window unchanged.
        report = await wd.open_window(0, judge.worker_id, True, [kernel.worker_id, "d0-w999"])
        assert not report.ok and not report.frozen_worker_ids
        assert "'d0-w999' (a partner)" in report.message and "unchanged" in report.message
        assert [freezer_state(p) for p in pids] == ["THAWED", "THAWED", "FROZEN"]
        # Reopened without partners, the window freezes the kernel's process like any other.
        report = await wd.open_window(0, judge.worker_id, True)
        assert sorted(report.frozen_worker_ids) == sorted([kernel.worker_id, other.worker_id])
        assert await running(pids) == {judge.pid: True, kernel.pid: False, other.pid: False}

        assert (await wd.close_window(0)).ok
        assert all(freezer_state(p) == "THAWED" for p in pids)
        assert all((await running(pids)).values())
        assert not harness.of("worker_exited")
        await wd.shutdown(0)

    run(body())


def test_window_reports_the_gpu_conditions(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1))
        (w,) = await harness.started(1)
        harness.nvml("health 0 temperature=55")
        report = await wd.open_window(0, w.worker_id, False)
        c = report.conditions
        assert report.ok and c.known and c.temperature_celsius == 55  # before any clocks line
        assert (c.sm_clock_mhz, c.memory_clock_mhz, c.power_milliwatts, c.throttle_reasons) == (
            0,
            0,
            0,
            0,
        )
        harness.nvml("clocks 0 sm=1980 mem=2619 temperature=41 power_mw=312000 reasons=0x24")
        report = await wd.close_window(0)
        c = report.conditions
        assert report.ok and c.known
        assert (
            c.sm_clock_mhz,
            c.memory_clock_mhz,
            c.temperature_celsius,
            c.power_milliwatts,
            c.throttle_reasons,
        ) == (1980, 2619, 41, 312000, 0x24)
        harness.nvml("clocks 0 sm=1410 reasons=4")  # only what it names changes
        c = (await wd.open_window(0, w.worker_id, False)).conditions
        assert (c.sm_clock_mhz, c.memory_clock_mhz, c.throttle_reasons) == (1410, 2619, 4)
        # A holder that is not a job process of the device: nothing changes.
        report = await wd.open_window(0, "d0-w999", True)
        assert not report.ok and "d0-w999" in report.message and not report.frozen_worker_ids
        with pytest.raises(WatchdogError, match="no device 3"):
            await wd.open_window(3, w.worker_id, True)
        with pytest.raises(WatchdogError, match="no device 3"):
            await wd.close_window(3)
        await wd.shutdown(0)

    run(body())


def test_window_without_nvml_has_unknown_conditions(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure())  # NVML_SOURCE_NONE: the CPU device -1
        (w,) = await harness.started(1)
        report = await wd.open_window(-1, w.worker_id, False)
        assert report.ok and report.device_index == -1 and not report.conditions.known
        report = await wd.close_window(-1)
        assert report.ok and not report.conditions.known
        await wd.shutdown(0)

    run(body())


@pytest.mark.parametrize("end", ["shutdown", "channel_closed"])
def test_watchdog_exit_with_a_window_open_leaves_nothing_frozen(harness: Harness, end: str) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=2, warm_spare=True))
        require_freezer(harness)
        workers = await harness.started(3)
        await burning(harness, workers)
        holder = workers[0]
        report = await wd.open_window(0, holder.worker_id, True)
        assert len(report.frozen_worker_ids) == 2
        cgroups = watchdog_cgroups(wd.pid)
        assert cgroups
        t0 = time.monotonic()
        if end == "shutdown":
            await wd.shutdown(grace_ms=300)
            assert await wd.wait() == 0
            exits = [x.worker_exited for x in harness.of("worker_exited")]
            assert sorted(x.worker.worker_id for x in exits) == sorted(w.worker_id for w in workers)
            assert {x.reason for x in exits} == {"shutdown"}
        else:
            await wd.close()
            assert await asyncio.wait_for(wd.wait(), 5) != 0
        assert time.monotonic() - t0 < 3
        assert not any(pid_alive(w.pid) for w in workers)
        assert not any(c.exists() for c in cgroups)  # no cgroup left, frozen or not

    run(body())


def test_host_without_a_freezer_says_so(harness: Harness) -> None:
    """Job cgroups that cannot be made (a cgroup_root outside any cgroup hierarchy): one
    cgroup_freezer warning at Configure, and OpenWindow says it froze nothing."""

    async def body() -> None:
        sandbox = pb.SandboxConfig(cgroup_root="/nonexistent/kew-no-cgroups")
        wd = await harness.start(harness.configure(gpus=1, warm_spare=True, sandbox=sandbox))
        holder, _ = await harness.started(2)
        warned = [
            e.warning.message
            for e in harness.of("warning")
            if e.warning.feature == "cgroup_freezer"
        ]
        assert len(warned) == 1 and "timing windows" in warned[0]
        report = await wd.open_window(0, holder.worker_id, True)
        assert not report.ok and "no cgroup freezer" in report.message
        assert not report.frozen_worker_ids and report.conditions.known
        assert (await wd.open_window(0, holder.worker_id, False)).ok  # freezing not asked
        assert (await wd.close_window(0)).ok
        assert len([e for e in harness.of("warning") if e.warning.feature == "cgroup_freezer"]) == 1
        await wd.shutdown(0)

    run(body())


@needs_root
def test_frozen_cgroups_of_a_dead_watchdog_are_thawed_and_removed(harness: Harness) -> None:
    """A watchdog killed with a window open leaves frozen cgroups; the next one kills what is in
    them (a frozen v1 process takes its SIGKILL only when thawed) and removes them."""
    freezer, pids = CGROUP / "freezer", CGROUP / "pids"
    if not (freezer / "cgroup.procs").exists() or not (pids / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 freezer and pids hierarchies here")
    stale = [h / "kerneleval-999997" / "d0-w1" for h in (pids, freezer)]
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for d in stale:
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.procs").write_text(str(sleeper.pid))
        (stale[1] / "freezer.state").write_text("FROZEN")

        async def body() -> None:
            t0 = time.monotonic()
            wd = await harness.start(harness.configure())  # Configure removes them
            assert not any(d.parent.exists() for d in stale)
            assert time.monotonic() - t0 < 1.5  # no retrying while the frozen sleeper lives
            assert sleeper.wait(timeout=2) == -9
            await wd.shutdown(0)

        run(body())
    finally:
        with contextlib.suppress(OSError):
            (stale[1] / "freezer.state").write_text("THAWED")
        sleeper.kill()
        sleeper.wait()
        for d in stale:
            for p in (d, d.parent):
                with contextlib.suppress(OSError):
                    p.rmdir()


# ---------------------------------------------------------------- StopGpuUsers

GPU_KILL = "killed:gpu_outside_phase"
SAMPLE_MARGIN_S = 0.3  # windows.cc counts NVML samples from 250 ms after a freeze


def test_stop_gpu_users_kills_the_frozen_job_process_that_used_the_gpu(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=2, warm_spare=True))
        require_freezer(harness)
        a, b, c = await harness.started(3)  # a and b take jobs, c is the spare
        assert c.spare and not b.spare
        await burning(harness, [a, b, c])
        await wd.set_job(b.worker_id, "job-hostile")
        report = await wd.open_window(0, a.worker_id, True)
        assert report.ok and sorted(report.frozen_worker_ids) == sorted([b.worker_id, c.worker_id])
        # A sample right after the freeze may still cover work from before it: not counted.
        harness.nvml(f"utilization 0 {b.pid} sm=80")
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids, users.message
        await asyncio.sleep(SAMPLE_MARGIN_S)
        harness.nvml(f"utilization 0 {b.pid} sm=80")
        users = await wd.stop_gpu_users(0)
        assert users.device_index == 0 and users.known
        assert list(users.killed_worker_ids) == [b.worker_id]
        assert f"pids {b.pid} ({b.worker_id}) used the GPU while frozen" in users.message
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == b.worker_id and ex.worker.job_id == "job-hostile"
        assert ex.reason == GPU_KILL and ex.signal == 9 and ex.restarting and ex.backoff_ms == 0
        assert not pid_alive(b.pid)
        # Its slot went to the spare, which stays frozen; the new spare starts frozen.
        assert [e.worker_promoted.worker_id for e in harness.of("worker_promoted")] == [c.worker_id]
        new = (await harness.started(4))[3]
        assert new.spare and freezer_state(new.pid) == "FROZEN"
        assert pid_alive(c.pid) and freezer_state(c.pid) == "FROZEN"
        assert freezer_state(a.pid) == "THAWED"
        assert await running([a.pid, c.pid]) == {a.pid: True, c.pid: False}
        # Asked again, the same sample kills nobody more (b is gone).
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids
        report = await wd.close_window(0)
        assert report.ok, report.message
        assert freezer_state(c.pid) == freezer_state(new.pid) == "THAWED"
        assert all((await running([a.pid, c.pid])).values())
        assert len(harness.of("worker_exited")) == 1
        await wd.shutdown(0)

    run(body())


def test_stop_gpu_users_counts_the_processes_of_a_job_cgroup(harness: Harness) -> None:
    """A pid that is not the job process itself but lives in its cgroup (a child, a daemon)
    counts for that job process."""

    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, warm_spare=True))
        require_freezer(harness)
        holder, spare = await harness.started(2)
        info = await harness.report(spare.worker_id)
        harness.command(spare.worker_id, "daemon")
        await harness.wait_for(lambda: harness.channels[spare.worker_id].of("daemon"), 5, "daemon")
        (child,) = cgroup_members(info["cgroup"]) - {spare.pid}
        await wd.open_window(0, holder.worker_id, True)
        await asyncio.sleep(SAMPLE_MARGIN_S)
        harness.nvml(f"utilization 0 {child} mem=5")
        users = await wd.stop_gpu_users(0)
        assert users.known and list(users.killed_worker_ids) == [spare.worker_id]
        assert f"{child} ({spare.worker_id})" in users.message
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == spare.worker_id and ex.reason == GPU_KILL
        await harness.wait_for(lambda: not pid_alive(child), 2, "the daemon gone")
        assert (await wd.close_window(0)).ok
        await wd.shutdown(0)

    run(body())


def test_stop_gpu_users_ignores_samples_from_before_the_freeze(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=2, warm_spare=True))
        require_freezer(harness)
        a, b, c = await harness.started(3)
        await burning(harness, [b])
        # A sample of b before the window: StopGpuUsers without a window reads (and so stamps)
        # it now.
        harness.nvml(f"utilization 0 {b.pid} sm=90 mem=40")
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids
        await asyncio.sleep(0.01)
        assert (await wd.open_window(0, a.worker_id, True)).ok
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids
        assert "no frozen job process used the GPU" in users.message
        # The holder's own sample, then the window moves to b: a is frozen from then on, and
        # its sample from its own window does not count.
        harness.nvml(f"utilization 0 {a.pid} sm=70")
        users = await wd.stop_gpu_users(0)  # reads a's sample while a holds the window
        assert not users.killed_worker_ids and f"{a.pid} ({a.worker_id}, the holder)" in (
            users.message
        )
        await asyncio.sleep(0.01)
        report = await wd.open_window(0, b.worker_id, True)
        assert sorted(report.frozen_worker_ids) == sorted([a.worker_id, c.worker_id])
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids
        assert f"{a.pid} ({a.worker_id}, before its freeze)" in users.message
        assert await running([b.pid, a.pid]) == {b.pid: True, a.pid: False}
        assert (await wd.close_window(0)).ok
        assert not harness.of("worker_exited")
        await wd.shutdown(0)

    run(body())


def test_stop_gpu_users_never_kills_the_holder_or_another_device(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=2, warm_spare=True))
        require_freezer(harness)
        workers = await harness.started(4)
        d0 = [w for w in workers if w.device_index == 0]
        d1 = [w for w in workers if w.device_index == 1]
        holder, frozen = sorted(d0, key=lambda w: w.spare)
        report = await wd.open_window(0, holder.worker_id, True)
        assert list(report.frozen_worker_ids) == [frozen.worker_id]
        outsider = os.getpid()  # a process in no job cgroup (the test itself)
        for pid in (holder.pid, d1[0].pid, d1[1].pid, outsider):
            harness.nvml(f"utilization 0 {pid} sm=100 mem=100")
        harness.nvml(f"utilization 1 {frozen.pid} sm=100")  # another GPU's sample
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids, users.message
        assert f"{holder.pid} ({holder.worker_id}, the holder)" in users.message
        assert f"{d1[0].pid} ({d1[0].worker_id}, not frozen here)" in users.message
        assert f"{outsider} (not a frozen job process)" in users.message
        # Device 1 has no window: nothing is killed there either.
        users = await wd.stop_gpu_users(1)
        assert users.known and users.device_index == 1 and not users.killed_worker_ids
        assert "no timing window" in users.message
        await asyncio.sleep(0.2)
        assert not harness.of("worker_exited")
        assert all(pid_alive(w.pid) for w in workers)
        assert (await wd.close_window(0)).ok
        await wd.shutdown(0)

    run(body())


def test_stop_gpu_users_without_a_window_kills_nothing(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, warm_spare=True))
        holder, spare = await harness.started(2)
        harness.nvml(f"utilization 0 {spare.pid} sm=50")
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids
        assert "no timing window with frozen job processes is open on device 0" in users.message
        # A window that freezes nothing (timing isolation off) is no better.
        assert (await wd.open_window(0, holder.worker_id, False)).ok
        harness.nvml(f"utilization 0 {spare.pid} sm=50")
        users = await wd.stop_gpu_users(0)
        assert users.known and not users.killed_worker_ids and "no timing window" in users.message
        assert (await wd.close_window(0)).ok
        with pytest.raises(WatchdogError, match="no device 3"):
            await wd.stop_gpu_users(3)
        await asyncio.sleep(0.2)
        assert not harness.of("worker_exited")
        await wd.shutdown(0)

    run(body())


def test_stop_gpu_users_without_nvml_cannot_tell(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(warm_spare=True))  # NVML_SOURCE_NONE
        holder, spare = await harness.started(2)
        users = await wd.stop_gpu_users(-1)
        assert users.device_index == -1 and not users.known and not users.killed_worker_ids
        report = await wd.open_window(-1, holder.worker_id, True)
        if report.frozen_worker_ids:  # a host with a freezer: a window with a frozen process
            users = await wd.stop_gpu_users(-1)
            assert not users.known and not users.killed_worker_ids
            assert "no NVML" in users.message and "nothing killed" in users.message
        assert (await wd.close_window(-1)).ok
        assert not harness.of("worker_exited")
        await wd.shutdown(0)

    run(body())
