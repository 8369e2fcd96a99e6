"""Integration tests: the real kerneleval-watchdog binary, driven through
kerneleval_server.fleet.watchdog, with the real zygote (kerneleval_server.jobproc.zygote) running
the stand-in job main (stand_in_job.py), a fake NVML and a kernel log file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kerneleval.internal.v1 import watchdog_pb2 as pb
from kerneleval_server.fleet.watchdog import (
    Watchdog,
    WatchdogError,
    encode_frame,
    find_watchdog_binary,
)
from wd_harness import BUILD, REPO, Harness, pid_alive

HEALTHY, UNHEALTHY = pb.HEALTH_HEALTHY, pb.HEALTH_UNHEALTHY


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_find_watchdog_binary(monkeypatch: pytest.MonkeyPatch, watchdog_binary: str) -> None:
    monkeypatch.setenv("KERNELEVAL_WATCHDOG", "/opt/x/kerneleval-watchdog")
    assert find_watchdog_binary() == "/opt/x/kerneleval-watchdog"
    monkeypatch.delenv("KERNELEVAL_WATCHDOG")
    assert find_watchdog_binary() == str(BUILD / "kerneleval-watchdog")


def job_user_ids() -> tuple[int, int]:
    """The job user the watchdog picks as root: kerneleval-job, else nobody."""
    try:
        pw = pwd.getpwnam("kerneleval-job")
    except KeyError:
        pw = pwd.getpwnam("nobody")
    return pw.pw_uid, pw.pw_gid


def cgroup_dirs(report: dict) -> list[Path]:
    """The job process's cgroup folders on the host, from its /proc/self/cgroup."""
    out = []
    for line in report["cgroup"]:
        _, controllers, path = line.split(":", 2)
        if "kerneleval-" not in path:
            continue
        for c in controllers.split(",") if controllers else [""]:
            out.append(Path("/sys/fs/cgroup") / c / path.lstrip("/"))
    return out


def members(report: dict) -> set[int]:
    pids: set[int] = set()
    for d in cgroup_dirs(report):
        if (d / "cgroup.procs").exists():
            pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
    return pids


def watchdog_cgroups(pid: int) -> list[Path]:
    roots = [Path("/sys/fs/cgroup")] + [p for p in Path("/sys/fs/cgroup").iterdir() if p.is_dir()]
    return [d for r in roots for d in r.rglob(f"kerneleval-{pid}")]


@pytest.mark.skipif(os.geteuid() != 0, reason="the sealed sandbox needs root")
def test_job_processes_are_sealed_and_shutdown_cleans_up(harness: Harness) -> None:
    async def body() -> None:
        sandbox = pb.SandboxConfig(tmp_bytes=32 << 20, memory_bytes=512 << 20, max_pids=64)
        cfg = harness.configure(gpus=2, warm_spare=True, sandbox=sandbox)
        wd = await harness.start(cfg)
        workers = await harness.started(4)
        assert sorted((w.device_index, w.spare) for w in workers) == [
            (0, False),
            (0, True),
            (1, False),
            (1, True),
        ]
        assert all(e.worker_started.channel_attached for e in harness.of("worker_started"))
        warnings = {e.warning.feature: e.warning.message for e in harness.of("warning")}
        assert not warnings, warnings
        uid, gid = job_user_ids()
        for w in workers:
            info = await harness.report(w.worker_id)  # it came over the passed descriptor
            assert harness.channels[w.worker_id].fd_count == 1
            assert info["pid"] == 1 and info["proc_pids"] == [1]  # own PID namespace
            ids = (info["uid"], info["euid"], info["gid"], info["groups"])
            assert ids == (uid, uid, gid, [gid])
            assert info["no_new_privs"] == "1" and info["seccomp"] == "2"
            assert info["rlimit_core"] == 0 and info["rlimit_nofile"] == 4096
            assert info["interfaces"] == ["lo"]
            assert info["netns"] != os.readlink("/proc/self/ns/net")
            assert info["mntns"] != os.readlink("/proc/self/ns/mnt")
            visible = info["visible"]
            for hidden in (
                harness.state_dir,
                REPO / "tests",
                REPO / ".git",
                harness.root,
                harness.fake_nvml,
                "/home",
            ):
                assert visible[str(hidden)] is False, hidden
            assert visible[str(REPO / "server")] and visible[str(harness.code_dir)]
            assert set(info["root_listing"]) <= {".pyenv"}  # /root holds only the bound Python
            assert info["tmp_mount"].startswith("tmpfs") and info["tmp_bytes"] == 32 << 20
            # private /tmp: its own file, and the way to read-only paths under /tmp (a checkout
            # there), bound again inside it
            way = {p.split("/")[2] for p in cfg.sandbox.read_only_paths if p.startswith("/tmp/")}
            assert info["tmp_listing"] == sorted({f"standin-{w.worker_id}"} | way)
            assert info["root_mount"].startswith("tmpfs ro")
            assert set(info["dev"]) == {
                "fd",
                "full",
                "null",
                "random",
                "shm",
                "stderr",
                "stdin",
                "stdout",
                "tty",
                "urandom",
                "zero",
            }
            assert info["fds"] in ([0, 1, 2, 3], [0, 1, 2, 3, 4])  # 4: listdir's own
            env = info["env"]
            assert env["KERNELEVAL_WORKER_ID"] == w.worker_id
            assert env["KERNELEVAL_DEVICE_INDEX"] == str(w.device_index)
            # By UUID: the sandbox shows only its GPU's node, so CUDA sees it alone.
            assert env["CUDA_VISIBLE_DEVICES"] == f"GPU-fake-{w.device_index}"
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # CUDA's numbering = NVML's
            assert env["STANDIN_MODE"] == "idle"  # Configure.worker_env
            assert env["TMPDIR"] == env["HOME"] == "/tmp"
            assert env["TRITON_CACHE_DIR"] == "/tmp/triton"
            assert not any("TOKEN" in k or "SOCK" in k for k in env)
            dirs = cgroup_dirs(info)
            assert dirs and all(d.name == w.worker_id for d in dirs)
            assert w.pid in members(info)
            for d in dirs:
                if (d / "memory.limit_in_bytes").exists():
                    assert int((d / "memory.limit_in_bytes").read_text()) == 512 << 20
                if (d / "memory.max").exists():
                    assert int((d / "memory.max").read_text()) == 512 << 20
                if (d / "pids.max").exists():
                    assert (d / "pids.max").read_text().strip() == "64"
            limited = {f.name for d in dirs for f in d.iterdir()}
            assert "pids.max" in limited
            assert "memory.limit_in_bytes" in limited or "memory.max" in limited
        # The seccomp filter answers the ways out.
        harness.command(workers[0].worker_id, "try_escape")
        escape = (
            await harness.wait_for(
                lambda: harness.channels[workers[0].worker_id].of("escape"), 5, "escape"
            )
        )[0]
        assert {k: escape[k] for k in ("unshare", "unshare_user", "setns", "mount", "ptrace")} == {
            "unshare": "EPERM",
            "unshare_user": "EPERM",
            "setns": "EPERM",
            "mount": "EPERM",
            "ptrace": "EPERM",
        }
        status = await wd.status()
        assert {w.worker_id for w in status.workers} == {w.worker_id for w in workers}
        assert [d.device_index for d in status.devices] == [0, 1]
        assert all(d.health == HEALTHY for d in status.devices)
        assert watchdog_cgroups(wd.pid)
        await wd.shutdown(grace_ms=300)
        assert await wd.wait() == 0
        exits = [e.worker_exited for e in harness.of("worker_exited")]
        assert sorted(x.worker.worker_id for x in exits) == sorted(w.worker_id for w in workers)
        assert all(x.reason == "shutdown" and not x.restarting for x in exits)
        assert not any(pid_alive(w.pid) for w in workers)
        assert watchdog_cgroups(wd.pid) == []  # every job cgroup and our folder removed

    run(body())


def test_segfault_promotes_spare_and_starts_a_new_one(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(warm_spare=True))
        workers = await harness.started(2)
        taker = next(w for w in workers if not w.spare)
        spare = next(w for w in workers if w.spare)
        assert taker.device_index == -1 and taker.worker_id.startswith("cpu-")
        await harness.report(taker.worker_id)
        await wd.set_job(taker.worker_id, "job-7")
        harness.command(taker.worker_id, "segv")
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == taker.worker_id
        assert ex.signal == 11 and ex.exit_code == -1 and ex.reason == "crashed"
        assert ex.worker.job_id == "job-7" and ex.restarting
        promoted = harness.of("worker_promoted")
        assert [p.worker_promoted.worker_id for p in promoted] == [spare.worker_id]
        # promotion comes right after the exit, before any replacement starts
        kinds = [e.WhichOneof("kind") for e in harness.events]
        assert kinds.index("worker_promoted") == kinds.index("worker_exited") + 1
        new = (await harness.started(3))[2]
        assert new.spare and new.device_index == -1
        status = await wd.status()
        assert {(w.worker_id, w.spare) for w in status.workers} == {
            (spare.worker_id, False),
            (new.worker_id, True),
        }
        await wd.shutdown(0)

    run(body())


def test_a_finished_job_process_hands_its_slot_to_a_spare_before_it_exits(
    harness: Harness,
) -> None:
    """SetJob finished (its outcome is in): a spare takes the slot at once, while the finished
    process is still alive (its teardown, or a timing window that froze it, must not hold
    the slot); its exit later promotes nobody else and names its job."""

    async def body() -> None:
        wd = await harness.start(harness.configure(warm_spare=True, spare_count=2))
        workers = await harness.started(3)
        taker = next(w for w in workers if not w.spare)
        await harness.report(taker.worker_id)
        await wd.set_job(taker.worker_id, "job-9")
        await wd.set_job(taker.worker_id, "job-9", finished=True)
        await harness.wait_for(lambda: harness.of("worker_promoted"), 5, "a promotion")
        (promoted,) = [p.worker_promoted.worker_id for p in harness.of("worker_promoted")]
        assert promoted != taker.worker_id and pid_alive(taker.pid)
        await wd.set_job(taker.worker_id, "job-9", finished=True)  # said twice: still one
        harness.command(taker.worker_id, "exit 0")
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == taker.worker_id and ex.worker.job_id == "job-9"
        await asyncio.sleep(0.3)
        assert len(harness.of("worker_promoted")) == 1  # the exit promoted no second spare
        status = await wd.status()
        assert sum(not w.spare for w in status.workers) == 1  # never more than one taker
        await wd.shutdown(0)

    run(body())


def test_exit_codes_failures_and_retirement(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(retire_exit_codes=[5], max_restarts=1))
        (first,) = await harness.started(1)
        await harness.report(first.worker_id)
        harness.command(first.worker_id, "exit 3")
        (ex,) = await harness.exited(1)
        assert (ex.exit_code, ex.signal, ex.reason, ex.restarting) == (3, 0, "exited", True)
        assert ex.backoff_ms == 20  # first failure: backoff_initial_ms
        # Finishing (exit 0: one job done) or retiring (a retire code, e.g. after a poisoned
        # CUDA context) is no failure: no backoff, and max_restarts=1 is never exceeded.
        for n, code in enumerate(("5", "0", "5"), start=2):
            w = (await harness.started(n))[n - 1]
            await harness.report(w.worker_id)
            harness.command(w.worker_id, f"exit {code}")
            x = (await harness.exited(n))[n - 1]
            assert (x.exit_code, x.reason, x.restarting, x.backoff_ms) == (
                int(code),
                "exited",
                True,
                0,
            )
        await harness.started(5)
        assert (await wd.status()).devices[0].health == HEALTHY
        await wd.shutdown(0)

    run(body())


def test_exit_before_the_spawned_frame_is_still_reported(harness: Harness) -> None:
    """Job processes that exit at once (often before the zygote's JobProcessSpawned arrives):
    each is announced, then its exit, and the device keeps making them."""

    async def body() -> None:
        cfg = harness.configure(mode="exit", worker_env={"STANDIN_EXIT": "0"})
        wd = await harness.start(cfg)
        await harness.exited(6, timeout=20)
        started = [w.worker_id for w in await harness.started(6)]
        for x in harness.of("worker_exited"):
            ex = x.worker_exited
            assert ex.worker.worker_id in started and ex.exit_code == 0 and ex.restarting
            assert ex.reason == "exited"
        order = [
            e.worker_started.worker.worker_id or e.worker_exited.worker.worker_id
            for e in harness.events
            if e.WhichOneof("kind") in ("worker_started", "worker_exited")
        ]
        for wid in started[:5]:
            assert order.index(wid) < len(order) - 1 - order[::-1].index(wid)  # start, then exit
        assert (await wd.status()).devices[0].health == HEALTHY
        await wd.shutdown(0)

    run(body())


def test_spare_count_keeps_that_many_spares(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(
            harness.configure(gpus=1, workers_per_device=1, warm_spare=True, spare_count=2)
        )
        started = await harness.started(3)
        assert sorted(w.spare for w in started) == [False, True, True]
        worker = next(w for w in started if not w.spare)
        await harness.report(worker.worker_id)
        harness.command(worker.worker_id, "segv")
        await harness.exited(1)
        await harness.started(4)  # a spare was promoted and a new one started
        await asyncio.sleep(0.2)
        live = (await wd.status()).workers
        assert len(live) == 3 and sum(w.spare for w in live) == 2
        await wd.shutdown(0)

    run(body())


def test_workers_that_die_running_jobs_never_trip_the_intensity(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(max_restarts=1))
        for n in range(1, 5):  # four crashes under jobs, with max_restarts=1
            w = (await harness.started(n))[n - 1]
            await harness.report(w.worker_id)
            await wd.set_job(w.worker_id, f"job-{n}")
            harness.command(w.worker_id, "segv")
            x = (await harness.exited(n))[n - 1]
            assert (x.reason, x.signal, x.restarting, x.backoff_ms) == ("crashed", 11, True, 0)
            assert x.worker.job_id == f"job-{n}"
        await harness.started(5)
        assert (await wd.status()).devices[0].health == HEALTHY
        await wd.shutdown(0)

    run(body())


@pytest.mark.skipif(os.geteuid() != 0, reason="the sealed sandbox needs root")
def test_hung_job_killed_on_request_with_its_daemon(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure())
        (w,) = await harness.started(1)
        info = await harness.report(w.worker_id)
        harness.command(w.worker_id, "daemon")  # setsid grandchild that ignores SIGTERM
        await harness.wait_for(lambda: harness.channels[w.worker_id].of("daemon"), 5, "daemon")
        pids = members(info)
        assert len(pids) >= 2 and w.pid in pids
        await harness.hang(w.worker_id)  # ignores SIGTERM from now on
        await wd.set_job(w.worker_id, "job-hung")
        await wd.kill_worker(w.worker_id, "deadline")
        (ex,) = await harness.exited(1)
        assert ex.reason == "killed:deadline" and ex.signal == 9
        assert ex.worker.job_id == "job-hung" and ex.restarting and ex.backoff_ms == 0
        await harness.wait_for(lambda: not any(pid_alive(p) for p in pids), 2, "all gone")
        await harness.wait_for(
            lambda: not any(d.exists() for d in cgroup_dirs(info)), 2, "cgroup removed"
        )
        await harness.started(2)
        with pytest.raises(WatchdogError, match="no worker"):
            await wd.kill_worker("no-such-worker", "x")
        with pytest.raises(WatchdogError, match="no worker"):
            await wd.set_job("no-such-worker", "j")
        await wd.shutdown(0)

    run(body())


@pytest.mark.skipif(os.geteuid() != 0, reason="the sealed sandbox needs root")
def test_daemon_dies_when_its_job_process_exits(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure())
        (w,) = await harness.started(1)
        info = await harness.report(w.worker_id)
        harness.command(w.worker_id, "daemon")
        await harness.wait_for(lambda: harness.channels[w.worker_id].of("daemon"), 5, "daemon")
        pids = members(info) - {w.pid}
        assert pids and all(pid_alive(p) for p in pids)
        harness.command(w.worker_id, "exit 0")  # one job done: it exits by itself
        (ex,) = await harness.exited(1)
        assert (ex.exit_code, ex.reason) == (0, "exited")
        await harness.wait_for(lambda: not any(pid_alive(p) for p in pids), 2, "daemon gone")
        await harness.wait_for(
            lambda: not any(d.exists() for d in cgroup_dirs(info)), 2, "cgroup removed"
        )
        await wd.shutdown(0)

    run(body())


def test_crash_flood_trips_restart_intensity(harness: Harness) -> None:
    async def body() -> None:
        cfg = harness.configure(
            mode="crash",
            max_restarts=3,
            restart_window_seconds=30,
            backoff_initial_ms=10,
            backoff_max_ms=40,
        )
        wd = await harness.start(cfg)
        await harness.wait_for(
            lambda: any(e.device.device.health == UNHEALTHY for e in harness.of("device")),
            15,
            "device unhealthy",
        )
        exits = [e.worker_exited for e in harness.of("worker_exited")]
        assert len(exits) == 4  # more than max_restarts = 3
        assert all(x.signal == 11 for x in exits)
        assert [x.restarting for x in exits] == [True, True, True, False]
        assert [x.backoff_ms for x in exits[:3]] == [10, 20, 40]
        await asyncio.sleep(0.5)
        assert len(harness.of("worker_started")) == 4  # no more restarts
        status = await wd.status()
        assert status.devices[0].health == UNHEALTHY
        assert "restart intensity" in status.devices[0].health_reason
        assert list(status.workers) == []
        await wd.shutdown(0)

    run(body())


@pytest.mark.skipif(os.geteuid() != 0, reason="the sealed sandbox needs root")
def test_xid31_restarts_the_faulting_worker_on_that_gpu_only(harness: Harness) -> None:
    async def body() -> None:
        cfg = harness.configure(gpus=2, workers_per_device=2)
        harness.fake_nvml.write_text(
            "device 0 pci=00000000:06:00.0\ndevice 1 pci=00000000:07:00.0\n"
        )
        wd = await harness.start(cfg)
        workers = await harness.started(4)
        reports = {w.worker_id: await harness.report(w.worker_id) for w in workers}
        d0 = [w for w in workers if w.device_index == 0]
        d1 = [w for w in workers if w.device_index == 1]
        # The faulting process is a child of the job process: its cgroup names the job process.
        harness.command(d0[0].worker_id, "daemon")
        await harness.wait_for(lambda: harness.channels[d0[0].worker_id].of("daemon"), 5, "daemon")
        culprit = max(members(reports[d0[0].worker_id]) - {d0[0].pid})
        await wd.set_job(d0[0].worker_id, "job-bad")
        await wd.set_job(d0[1].worker_id, "job-good")
        # NVML names no pid; the kernel log does, matched by the GPU's PCI address.
        harness.kernel_log(
            f"4,99,123,-;NVRM: Xid (PCI:0000:06:00): 31, pid={culprit}, "
            "name=python3, Ch 00000008, intr 00000000. MMU Fault"
        )
        harness.kernel_log(
            f"4,100,124,-;NVRM: Xid (PCI:0000:07:00): 31, pid={d1[0].pid}, "
            "name=python3, Ch 00000008"
        )  # another GPU's line: not this event
        harness.nvml("xid 0 31")
        xid = (await harness.wait_for(lambda: harness.of("xid"), 5, "xid")).pop().xid  # type: ignore[attr-defined]
        assert (xid.device_index, xid.xid, xid.pid) == (0, 31, culprit)
        assert (xid.category, xid.action) == ("application", "restart_worker")
        assert list(xid.worker_ids) == [d0[0].worker_id] and list(xid.job_ids) == ["job-bad"]
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == d0[0].worker_id and ex.reason == "xid" and ex.restarting
        assert ex.worker.job_id == "job-bad"
        assert ex.signal == signal.SIGKILL  # it stayed up past its grace to report
        await harness.started(5)
        await asyncio.sleep(0.2)
        status = await wd.status()
        live = {w.worker_id: w.pid for w in status.workers}
        for w in [d0[1], *d1]:  # same GPU's other worker and the other GPU: untouched
            assert live[w.worker_id] == w.pid and pid_alive(w.pid)
        assert all(d.health == HEALTHY for d in status.devices)
        assert len(harness.of("worker_exited")) == 1
        await wd.shutdown(0)

    run(body())


def test_xid_victim_may_report_and_exit_by_itself_first(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, workers_per_device=1))
        (w,) = await harness.started(1)
        await harness.report(w.worker_id)
        await wd.set_job(w.worker_id, "job-bad")
        harness.nvml(f"xid 0 31 pid={w.pid}")
        await harness.wait_for(lambda: harness.of("xid"), 5, "xid")
        harness.command(w.worker_id, "exit 3")  # the engine saw the CUDA error: poisoned
        (ex,) = await harness.exited(1)
        assert (ex.exit_code, ex.signal, ex.reason) == (3, 0, "xid") and ex.restarting
        await harness.started(2)
        await wd.shutdown(0)

    run(body())


def test_xid_without_pid_hits_the_workers_running_jobs(harness: Harness) -> None:
    async def body() -> None:
        cfg = harness.configure(gpus=1, workers_per_device=2, kmsg_path="/nonexistent/kmsg")
        wd = await harness.start(cfg)
        workers = await harness.started(2)
        assert [e.warning.feature for e in harness.of("warning")].count("kmsg") == 1
        await wd.set_job(workers[1].worker_id, "job-1")
        harness.nvml(f"xid 0 13 pid={workers[1].pid + 100000}")  # a pid that is no worker
        harness.nvml("xid 0 43")
        await harness.wait_for(lambda: len(harness.of("xid")) == 2, 5, "two xids")
        named, anonymous = (e.xid for e in harness.of("xid"))
        assert list(named.worker_ids) == []  # not ours: nobody is killed
        assert list(anonymous.worker_ids) == [workers[1].worker_id]
        assert list(anonymous.job_ids) == ["job-1"]
        (ex,) = await harness.exited(1)
        assert ex.worker.worker_id == workers[1].worker_id
        assert pid_alive(workers[0].pid)
        await wd.shutdown(0)

    run(body())


def test_xid79_auto_reset_runs_every_step_and_brings_workers_back(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=2, auto_reset=True, warm_spare=True))
        workers = await harness.started(4)
        d1 = [w for w in workers if w.device_index == 1]
        harness.nvml("xid 0 79")
        await harness.wait_for(lambda: harness.of("reset_finished"), 10, "reset finished")
        (xid,) = [e.xid for e in harness.of("xid")]
        assert (xid.xid, xid.category, xid.action) == (79, "reset", "reset_gpu")
        steps = [e.reset_step for e in harness.of("reset_step")]
        assert [s.step for s in steps] == [
            "drain",
            "stop_workers",
            "check_processes",
            "reset",
            "check_health",
            "start_workers",
        ]
        assert all(s.ok and s.device_index == 0 for s in steps)
        assert "recorded reset of GPU 0" in steps[3].message
        fin = harness.of("reset_finished")[0]
        assert fin.command_id == 0 and fin.reset_finished.success
        assert harness.reset_record.read_text() == "0\n"
        healths = [
            e.device.device.health
            for e in harness.of("device")
            if e.device.device.device_index == 0
        ]
        for h in (UNHEALTHY, pb.HEALTH_DRAINING, pb.HEALTH_RESETTING):
            assert h in healths
        assert healths[-1] == HEALTHY
        exits = [x for x in await harness.exited(2) if x.worker.device_index == 0]
        assert {x.reason for x in exits} == {"reset"} and not any(x.restarting for x in exits)
        await harness.started(6)
        status = await wd.status()
        assert {w.worker_id for w in status.workers if w.device_index == 1} == {
            w.worker_id for w in d1
        }
        assert len([w for w in status.workers if w.device_index == 0]) == 2
        assert all(d.health == HEALTHY for d in status.devices)
        # A GPU that keeps failing: three automatic resets an hour, then it waits for a person.
        for n in (2, 3, 4):  # a kernel-log line without a pid: handled without waiting
            harness.kernel_log("NVRM: Xid (PCI:0000:00:06): 79, GPU has fallen off the bus.")
            harness.nvml("xid 0 79")
            await harness.count("xid", n)
            if n < 4:
                await harness.count("reset_finished", n)
        await harness.wait_for(lambda: "automatic resets" in status_reason(harness), 10, "limit")
        assert len(harness.of("reset_finished")) == 3
        assert harness.reset_record.read_text() == "0\n0\n0\n"
        await wd.shutdown(0)

    run(body())


def status_reason(harness: Harness) -> str:
    updates = [e.device.device for e in harness.of("device") if e.device.device.device_index == 0]
    return updates[-1].health_reason if updates else ""


def test_xid79_without_auto_reset_waits_for_reset_gpu(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1))
        await harness.started(1)
        harness.kernel_log("NVRM: Xid (PCI:0000:00:06): 79, GPU has fallen off the bus.")
        harness.nvml("xid 0 79")
        await harness.wait_for(
            lambda: any(e.device.device.health == UNHEALTHY for e in harness.of("device")),
            5,
            "unhealthy",
        )
        await asyncio.sleep(0.3)
        assert not harness.reset_record.exists() and not harness.of("reset_step")
        with pytest.raises(WatchdogError, match="needs ResetGpu"):
            await wd.restart_workers(0)
        # A process still holds the GPU: the reset stops before running the command.
        harness.nvml("processes 0 4242")
        ok, steps = await wd.reset_gpu(0, grace_ms=0)
        assert not ok and steps[-1].step == "check_processes" and "4242" in steps[-1].message
        assert not harness.reset_record.exists()
        harness.nvml("processes 0")
        ok, steps = await wd.reset_gpu(0, grace_ms=0)
        assert ok and [s.step for s in steps][-3:] == ["reset", "check_health", "start_workers"]
        assert harness.reset_record.read_text() == "0\n"
        await harness.started(2)
        assert (await wd.status()).devices[0].health == HEALTHY
        with pytest.raises(WatchdogError, match="no GPU"):
            await wd.reset_gpu(7, 0)
        await wd.shutdown(0)

    run(body())


@pytest.mark.skipif(os.geteuid() != 0, reason="the sealed sandbox needs root")
def test_channel_close_kills_every_job_process_and_daemon(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=2, warm_spare=True))
        workers = await harness.started(4)
        pids: set[int] = set()
        for w in workers:
            info = await harness.report(w.worker_id)
            harness.command(w.worker_id, "daemon")
            channel = harness.channels[w.worker_id]
            await harness.wait_for(lambda c=channel: c.of("daemon"), 5, "daemon")
            pids |= members(info)
        assert len(pids) >= 8 and all(pid_alive(p) for p in pids)
        t0 = time.monotonic()
        await wd.close()
        await harness.wait_for(lambda: not any(pid_alive(p) for p in pids), 2.0, "all gone")
        assert time.monotonic() - t0 < 2.0
        code = await asyncio.wait_for(wd.wait(), 3.0)
        assert code != 0  # the front end vanished: not a clean shutdown
        assert watchdog_cgroups(wd.pid) == []
        with pytest.raises(WatchdogError):
            await wd.status()

    run(body())


def test_stale_cgroup_folders_of_dead_watchdogs_are_removed(harness: Harness) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (cgroups)")
    stale = [
        d / "kerneleval-999999" / "d0-w1"
        for d in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/freezer"))
        if d.is_dir()
    ]
    if not stale:
        pytest.skip("no cgroup v1 pids/freezer hierarchy here")
    for d in stale:
        d.mkdir(parents=True, exist_ok=True)

    async def body() -> None:
        wd = await harness.start(harness.configure())
        await harness.started(1)
        assert not any(d.parent.exists() for d in stale)
        await wd.shutdown(0)

    try:
        run(body())
    finally:
        for d in stale:
            for p in (d, d.parent):
                with contextlib.suppress(OSError):
                    p.rmdir()


class RawChannel:
    """The watchdog on a plain socketpair, for bytes the asyncio client would never send."""

    def __init__(self, binary: str, user: int | None = None) -> None:
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [binary, "--control-fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stderr=subprocess.PIPE,
            user=user,
        )
        theirs.close()
        self.sock.settimeout(5)
        self.buf = b""

    def send(self, cmd: pb.WatchdogCommand) -> None:
        self.sock.sendall(encode_frame(cmd))

    def event(self) -> pb.WatchdogEvent:
        while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack(">I", self.buf[:4])[0]:
            self.buf += self.sock.recv(65536)
        n = struct.unpack(">I", self.buf[:4])[0]
        ev = pb.WatchdogEvent.FromString(self.buf[4 : 4 + n])
        self.buf = self.buf[4 + n :]
        return ev

    def until(self, pred: Callable[[pb.WatchdogEvent], bool]) -> list[pb.WatchdogEvent]:
        seen = [self.event()]
        while not pred(seen[-1]):
            seen.append(self.event())
        return seen

    def close(self) -> str:
        self.sock.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode()


def test_garbage_on_the_channel_is_rejected_and_logged(
    harness: Harness, watchdog_binary: str
) -> None:
    ch = RawChannel(watchdog_binary)
    try:
        ch.send(pb.WatchdogCommand(command_id=1, get_status=pb.GetStatus()))
        ev = ch.event()
        assert ev.command_id == 1 and not ev.ack.ok and "Configure" in ev.ack.message
        ch.sock.sendall(struct.pack(">I", 7) + b"\xff\xff\xff\xff\xff\xff\xff")  # not protobuf
        ev = ch.event()
        assert ev.warning.feature == "protocol" and "malformed" in ev.warning.message
        big = 16 * 1024 * 1024 + 1
        ch.sock.sendall(struct.pack(">I", big) + b"\0" * big)  # oversized: skipped whole
        ev = ch.event()
        assert ev.warning.feature == "protocol" and "exceeds" in ev.warning.message
        cfg = harness.configure()
        ch.send(pb.WatchdogCommand(command_id=2, configure=cfg))
        assert ch.event().ack.ok
        ch.send(pb.WatchdogCommand(command_id=3, configure=cfg))
        ev = ch.until(lambda e: e.command_id == 3)[-1]
        assert not ev.ack.ok and "already configured" in ev.ack.message
        ch.send(pb.WatchdogCommand(command_id=4, get_status=pb.GetStatus()))
        ev = ch.until(lambda e: e.WhichOneof("kind") == "status")[-1]
        assert ev.command_id == 4 and len(ev.status.devices) == 1
        assert ch.proc.poll() is None  # still up
        ch.send(pb.WatchdogCommand(command_id=5, shutdown=pb.Shutdown()))
        assert ch.proc.wait(5) == 0
    finally:
        log = ch.close()
    assert "malformed command frame" in log and "exceeds" in log


def test_bad_configure_is_refused(harness: Harness) -> None:
    async def body() -> None:
        cfg = harness.configure(gpus=1)
        cfg.fake_nvml_path = "/nonexistent/fake"
        with pytest.raises(WatchdogError, match="fake NVML"):
            await Watchdog.start(harness.binary, cfg, harness.events.append)
        cfg = harness.configure(xid_policy=[pb.XidPolicyEntry(xid=31, action="explode")])
        with pytest.raises(WatchdogError, match="unknown action"):
            await Watchdog.start(harness.binary, cfg, harness.events.append)
        if os.geteuid() == 0:
            cfg = harness.configure(sandbox=pb.SandboxConfig(user="root"))
            with pytest.raises(WatchdogError, match="never run as root"):
                await Watchdog.start(harness.binary, cfg, harness.events.append)

    run(body())


def test_policy_override_and_stop_start(harness: Harness) -> None:
    async def body() -> None:
        cfg = harness.configure(
            gpus=1, xid_policy=[pb.XidPolicyEntry(xid=31, category="custom", action="ignore")]
        )
        wd = await harness.start(cfg)
        (w,) = await harness.started(1)
        harness.nvml(f"xid 0 31 pid={w.pid}")
        await harness.wait_for(lambda: harness.of("xid"), 5, "xid")
        xid = harness.of("xid")[0].xid
        assert (xid.category, xid.action) == ("custom", "ignore")
        await harness.report(w.worker_id)
        await harness.hang(w.worker_id)  # ignores SIGTERM: SIGKILL after the grace period
        t0 = time.monotonic()
        await wd.stop_workers(0, grace_ms=300)
        (ex,) = await harness.exited(1)
        assert ex.reason == "stopped" and not ex.restarting and ex.signal == 9
        assert 0.25 < time.monotonic() - t0 < 2
        await wd.start_workers(0)
        await harness.started(2)
        await wd.restart_workers()
        ex2 = (await harness.exited(2))[1]
        assert ex2.reason == "restart" and not ex2.restarting
        await harness.started(3)
        await wd.shutdown(0)

    run(body())


def test_health_readings_and_recovery_action(harness: Harness) -> None:
    async def body() -> None:
        wd = await harness.start(harness.configure(gpus=1, health_interval_seconds=1))
        harness.nvml("health 0 temperature=66 utilization=12 memory_used=1000 remapped_rows=2")
        await harness.wait_for(
            lambda: any(e.device.device.temperature_celsius == 66 for e in harness.of("device")),
            3,
            "periodic reading",
        )
        d = [e.device.device for e in harness.of("device")][-1]
        assert (d.utilization_percent, d.memory_used_bytes, d.remapped_row_count) == (12, 1000, 2)
        harness.nvml("health 0 recovery_action=node_reboot")
        await harness.wait_for(
            lambda: any(e.device.device.health == UNHEALTHY for e in harness.of("device")),
            3,
            "unhealthy from recovery action",
        )
        status = await wd.status()
        assert "node_reboot" in status.devices[0].health_reason
        await wd.shutdown(0)

    run(body())


def test_missing_job_user_marks_the_devices_unhealthy_never_root(harness: Harness) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (user switching)")

    async def body() -> None:
        cfg = harness.configure(gpus=1, sandbox=pb.SandboxConfig(user="no-such-user-kew"))
        wd = await harness.start(cfg)
        await harness.wait_for(
            lambda: any(e.device.device.health == UNHEALTHY for e in harness.of("device")),
            5,
            "unhealthy",
        )
        warning = [
            e.warning for e in harness.of("warning") if e.warning.feature == "unprivileged_user"
        ]
        assert len(warning) == 1 and "no-such-user-kew" in warning[0].message
        status = await wd.status()
        assert "no-such-user-kew" in status.devices[0].health_reason
        await asyncio.sleep(0.3)
        assert not harness.of("worker_started") and list(status.workers) == []
        with pytest.raises(WatchdogError, match="no-such-user-kew"):
            await wd.start_workers(0)
        await wd.shutdown(0)

    run(body())


def test_ctest_unit_tests_pass(watchdog_binary: str) -> None:
    r = subprocess.run(
        ["ctest", "--test-dir", str(BUILD), "--output-on-failure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tests passed" in r.stdout


def test_binary_links_only_libc_level_libraries(watchdog_binary: str) -> None:
    out = subprocess.run(["ldd", watchdog_binary], capture_output=True, text=True).stdout
    libs = {line.split()[0] for line in out.splitlines() if line.strip()}
    allowed = (
        "linux-vdso",
        "libc.so",
        "libm.so",
        "libdl.so",
        "libpthread.so",
        "/lib64/ld-linux",
        "ld-linux",
    )
    assert libs and all(lib.startswith(allowed) for lib in libs), libs


def test_missing_zygote_command_is_reported_and_trips_the_intensity(harness: Harness) -> None:
    async def body() -> None:
        cfg = harness.configure(max_restarts=2, backoff_initial_ms=10)
        cfg.worker_command[:] = ["/nonexistent/zygote"]
        wd = await harness.start(cfg)
        await harness.wait_for(
            lambda: any(e.device.device.health == UNHEALTHY for e in harness.of("device")),
            5,
            "unhealthy",
        )
        assert not harness.of("worker_exited") and not harness.of("worker_started")
        warnings = [
            e.warning for e in harness.of("warning") if e.warning.feature == "worker_command"
        ]
        assert len(warnings) == 1 and "No such file" in warnings[0].message
        status = await wd.status()
        assert "the zygote did not start" in status.devices[0].health_reason
        await wd.shutdown(0)

    run(body())
