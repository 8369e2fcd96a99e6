"""The real zygote driven by a fake watchdog (socketpair + framing), with a light engine and a
stand-in job main (jp_probe_job.py) that reports what it sees from inside the job process.

Needs root, cgroup v1 (memory, pids, freezer) and PID/mount namespaces, as on CI; the watchdog's
fresh root is not made here (helper A's C++), so the zygote runs in the host's mount namespace
and the per-job unshare alone makes /tmp private.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from jp_helpers import (
    NOBODY,
    FakeWatchdog,
    JobCgroup,
    seccomp_supported,
    start_zygote,
    unshare_eperm_filter,
    wait_pid,
    zygote_env,
)
from kerneleval.internal.v1 import zygote_pb2
from kerneleval_server.framing import FdFrameReader, FrameError, recv_frame, send_frame
from kerneleval_server.jobproc import CONFIG_EXIT, SETUP_FAILED_EXIT, sandbox

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, cgroups, setuid)"),
    pytest.mark.skipif(
        not Path("/sys/fs/cgroup/memory/cgroup.procs").exists(), reason="needs cgroup v1 memory"
    ),
]

TMP_BYTES = 8 << 20
JOB_ENV = {
    "PATH": "/usr/bin:/bin",
    "TMPDIR": "/tmp",
    "HOME": "/tmp",
    "JP_JOB_VAR": "from job_env",
}


def config(**overrides: object) -> zygote_pb2.ZygoteConfig:
    fields: dict[str, object] = {
        "seccomp_filter": unshare_eperm_filter() if seccomp_supported() else b"",
        "uid": NOBODY,
        "gid": NOBODY,
        "tmp_bytes": TMP_BYTES,
        "shm_bytes": 4 << 20,
        "job_env": JOB_ENV,
        "max_open_files": 256,
        "new_namespaces": True,
    }
    fields.update(overrides)
    return zygote_pb2.ZygoteConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def subreaper() -> Iterator[None]:
    """Job processes are reparented to us (the watchdog's role) when their parent C exits."""
    sandbox.set_child_subreaper(True)
    yield
    sandbox.set_child_subreaper(False)


@pytest.fixture
def cgroups() -> Iterator[list[JobCgroup]]:
    made: list[JobCgroup] = []
    yield made
    for group in made:
        group.remove()


@pytest.fixture
def zygote() -> Iterator[FakeWatchdog]:
    proc, sock = start_zygote(zygote_env())
    watchdog = FakeWatchdog(sock)
    yield watchdog
    sock.close()
    try:
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, proc.stderr.read() if proc.stderr else ""


def _frame(sock: object) -> bytes:
    data = recv_frame(sock)  # type: ignore[arg-type]
    assert data is not None
    return data


def _send_code(sock: object, code: int) -> None:
    send_frame(sock, str(code).encode())  # type: ignore[arg-type]


def test_job_process_is_sealed(
    zygote: FakeWatchdog, subreaper: None, cgroups: list[JobCgroup]
) -> None:
    ready = zygote.configure(config())
    assert ready.torch_version == "" and ready.triton_version == ""  # the light engine

    group = JobCgroup(f"jp-test-{os.getpid()}-1")
    cgroups.append(group)
    spawned, channel = zygote.spawn("w-1", group.open_procs())
    assert spawned.worker_id == "w-1" and spawned.pid > 0, spawned.error
    report = json.loads(_frame(channel))

    # PID namespace: PID 1, and only its own processes in /proc
    assert report["pid"] == 1
    assert report["proc_pids"] == [1]
    assert report["daemon_pid"] in report["proc_pids_after"]
    # the job user, no way back
    assert report["resuid"] == [NOBODY] * 3 and report["resgid"] == [NOBODY] * 3
    assert report["groups"] == [NOBODY]
    assert report["no_new_privs"] == "1"
    if seccomp_supported():
        assert report["seccomp"] == "2"
        assert report["unshare_user_errno"] == errno.EPERM  # the filter's answer
    assert report["unshare_ns_errno"] != 0
    # only the channel, as descriptor 3 (0-2 are /dev/null; one more is listdir's own)
    assert report["fd"] == 3
    assert {0, 1, 2, 3} <= set(report["open_fds"]) and len(report["open_fds"]) <= 5
    # environment: job_env + the worker id + what the engine's configuration set
    env = report["env"]
    assert env["JP_JOB_VAR"] == "from job_env" and env["KERNELEVAL_WORKER_ID"] == "w-1"
    assert env["JP_LIGHT_ENGINE_CONFIGURED"] == "1" and env["TRITON_INTERPRET"] == "1"
    assert env["TRITON_STORE_BINARY_ONLY"] == "1"  # a compile cache of binaries only
    assert "JP_ZYGOTE_ONLY" not in env and "KERNELEVAL_JOB_MAIN" not in env
    # private, size-limited /tmp
    assert report["tmp_bytes"] == TMP_BYTES
    assert not report["marker_existed"]
    assert not Path("/tmp/jp-marker").exists()  # not in the host's /tmp either
    # the cgroup given (memory, pids, freezer), with its daemon in it
    relative = group.dirs["memory"].relative_to("/sys/fs/cgroup/memory")
    assert f"memory:/{relative}" in report["cgroup"]
    members = group.pids()
    assert spawned.pid in members and len(members) == 2  # G and the setsid daemon
    assert sorted(group.pids("pids")) == sorted(members)
    assert sorted(group.pids("freezer")) == sorted(members)

    _send_code(channel, 7)
    assert wait_pid(spawned.pid) == 7  # the job main's return value is the exit code
    assert group.wait_empty() == []  # the daemon died with the PID namespace
    channel.close()

    # the next job process sees nothing of the previous one's /tmp
    group2 = JobCgroup(f"jp-test-{os.getpid()}-2")
    cgroups.append(group2)
    spawned2, channel2 = zygote.spawn("w-2", group2.open_procs())
    assert spawned2.pid > 0, spawned2.error
    report2 = json.loads(_frame(channel2))
    assert report2["pid"] == 1 and not report2["marker_existed"]
    assert report2["env"]["KERNELEVAL_WORKER_ID"] == "w-2"
    channel2.close()  # the probe's read ends: exit 0
    assert wait_pid(spawned2.pid) == 0
    assert group2.wait_empty() == []


def test_spawn_failure_is_answered(zygote: FakeWatchdog, cgroups: list[JobCgroup]) -> None:
    zygote.configure(config())
    group = JobCgroup(f"jp-test-{os.getpid()}-ro")
    cgroups.append(group)
    read_only = os.open(group.dirs["memory"] / "cgroup.procs", os.O_RDONLY | os.O_CLOEXEC)
    spawned, channel = zygote.spawn("w-bad", [read_only])
    assert spawned.pid == 0 and "join cgroup" in spawned.error
    assert recv_frame(channel) is None  # nobody holds the job end
    assert group.pids() == []


def test_root_job_user_is_refused() -> None:
    proc, sock = start_zygote(zygote_env())
    watchdog = FakeWatchdog(sock)
    watchdog.send(zygote_pb2.ZygoteRequest(config=config(uid=0, gid=0)))
    assert watchdog.event() is None
    assert proc.wait(timeout=20) == CONFIG_EXIT
    assert b"never run as root" in (proc.stderr.read() if proc.stderr else b"")
    sock.close()


def test_setup_failure_exits_before_the_job_main(
    zygote: FakeWatchdog, subreaper: None, cgroups: list[JobCgroup]
) -> None:
    zygote.configure(config(seccomp_filter=b"\x00" * 7))  # not whole instructions
    group = JobCgroup(f"jp-test-{os.getpid()}-setup")
    cgroups.append(group)
    spawned, channel = zygote.spawn("w-setup", group.open_procs())
    assert spawned.pid > 0
    assert wait_pid(spawned.pid) == SETUP_FAILED_EXIT
    assert recv_frame(channel) is None


def test_frames_carry_descriptors_in_order() -> None:
    a, b = __import__("socket").socketpair()
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    send_frame(a, b"first", [w1])
    send_frame(a, b"second", [])
    send_frame(a, b"third", [w2, r2])
    reader = FdFrameReader(b)
    assert reader.recv_frame() == b"first"
    (got1,) = reader.take_fds(1)
    assert reader.recv_frame() == b"second"
    assert reader.recv_frame() == b"third"
    got2, got3 = reader.take_fds(2)
    with pytest.raises(FrameError):
        reader.take_fds(1)
    os.write(got1, b"x")
    assert os.read(r1, 1) == b"x"
    os.write(got2, b"y")
    assert os.read(got3, 1) == b"y"
    a.sendall(struct.pack(">I", 17 << 20))
    with pytest.raises(FrameError, match="over"):
        reader.recv_frame()
    for fd in (r1, w1, r2, w2, got1, got2, got3):
        os.close(fd)
    a.close()
    b.close()


@pytest.mark.skipif(
    not Path("/proc/sys/user/max_user_namespaces").exists()
    or Path("/proc/sys/user/max_user_namespaces").read_text().strip() == "0",
    reason="no user namespaces",
)
def test_without_a_filter_unshare_works(
    zygote: FakeWatchdog, subreaper: None, cgroups: list[JobCgroup]
) -> None:
    """The control of the seccomp check above: the EPERM there is the filter's."""
    zygote.configure(config(seccomp_filter=b""))
    group = JobCgroup(f"jp-test-{os.getpid()}-nofilter")
    cgroups.append(group)
    spawned, channel = zygote.spawn("w-nofilter", group.open_procs())
    report = json.loads(_frame(channel))
    assert report["seccomp"] == "0" and report["no_new_privs"] == "1"
    assert report["unshare_user_errno"] == 0
    channel.close()
    assert wait_pid(spawned.pid) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root")
def test_private_tmp_keeps_code_paths_mounted_below_it(tmp_path: Path) -> None:
    """A checkout under /tmp (CI clones there) is bound read-only into the fresh root; the job
    process's private /tmp must keep it, read-only, and hide everything else of /tmp."""
    code = Path(tempfile.mkdtemp(prefix="ke-code-", dir="/tmp"))
    (code / "module.py").write_text("VALUE = 1\n")
    other = Path(tempfile.mkdtemp(prefix="ke-other-", dir="/tmp"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the zygote's child C, in short
        os.close(r)
        try:
            sandbox.unshare(sandbox.CLONE_NEWNS)
            sandbox.make_mounts_private()
            sandbox.mount(str(code), str(code), None, sandbox.MS_BIND)
            sandbox.mount(None, str(code), None,
                          sandbox.MS_REMOUNT | sandbox.MS_BIND | sandbox.MS_RDONLY)  # fmt: skip
            sandbox.mount_private_tmpfs("/tmp", 16 << 20)
            seen = {
                "kept": (code / "module.py").read_text(),
                "other_hidden": not other.exists(),
                "listing": sorted(os.listdir("/tmp")),
            }
            try:
                (code / "new.py").write_text("x")
                seen["read_only"] = False
            except OSError:
                seen["read_only"] = True
            os.write(w, json.dumps(seen).encode())
        finally:
            os._exit(0)
    os.close(w)
    seen = json.loads(os.read(r, 65536) or b"{}")
    os.waitpid(pid, 0)
    shutil.rmtree(code)
    shutil.rmtree(other)
    assert seen == {"kept": "VALUE = 1\n", "other_hidden": True, "listing": [code.name],
                    "read_only": True}  # fmt: skip
