"""Helpers of the job process tests: a fake watchdog for the real zygote, test cgroups (v1) under
our own cgroup, and a small seccomp program."""

from __future__ import annotations

import errno
import os
import platform
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from kerneleval.internal.v1 import zygote_pb2
from kerneleval_server.framing import FdFrameReader, send_frame

# A tiny torch Model every job-process test can run (the engine checks it against itself).
ADD_MODEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b
def get_inputs():
    return [torch.randn(4, 64), torch.randn(4, 64)]
def get_init_inputs():
    return []
"""


HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NOBODY = 65534
CGROUP_V1 = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "freezer")

# seccomp: unshare -> EPERM, everything else allowed
_UNSHARE = {"x86_64": 272, "aarch64": 97}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def unshare_eperm_filter() -> bytes:
    machine = platform.machine()
    ld_abs, jeq, ret = 0x20, 0x15, 0x06
    return b"".join(
        [
            _insn(ld_abs, 0, 0, 4),  # seccomp_data.arch
            _insn(jeq, 0, 3, _AUDIT_ARCH[machine]),  # another arch: allow
            _insn(ld_abs, 0, 0, 0),  # seccomp_data.nr
            _insn(jeq, 0, 1, _UNSHARE[machine]),
            _insn(ret, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM),
            _insn(ret, 0, 0, SECCOMP_RET_ALLOW),
        ]
    )


def seccomp_supported() -> bool:
    return platform.machine() in _UNSHARE


def own_cgroup(controller: str) -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    raise LookupError(controller)


class JobCgroup:
    """One folder in each v1 hierarchy (memory, pids, freezer) under our own cgroup."""

    def __init__(self, name: str, memory_bytes: int = 512 << 20, max_pids: int = 64) -> None:
        self.dirs: dict[str, Path] = {}
        for controller in CONTROLLERS:
            base = CGROUP_V1 / controller / own_cgroup(controller).lstrip("/")
            path = base / name
            path.mkdir(exist_ok=True)
            self.dirs[controller] = path
        (self.dirs["memory"] / "memory.limit_in_bytes").write_text(str(memory_bytes))
        (self.dirs["pids"] / "pids.max").write_text(str(max_pids))

    def open_procs(self) -> list[int]:
        return [
            os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
            for path in self.dirs.values()
        ]

    def pids(self, controller: str = "memory") -> list[int]:
        text = (self.dirs[controller] / "cgroup.procs").read_text()
        return [int(p) for p in text.split()]

    def wait_empty(self, timeout_s: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            left = self.pids()
            if not left:
                return []
            time.sleep(0.05)
        return self.pids()

    def remove(self) -> None:
        for _ in range(50):
            left = self.pids()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for path in self.dirs.values():
            try:
                path.rmdir()
            except OSError:
                pass


def start_zygote(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """The real zygote with our end of its socket; its end is its descriptor 3."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = theirs.fileno()
    launcher = (
        "import os, runpy, sys\n"
        f"fd = {fd}\n"
        "if fd != 3:\n"
        "    os.dup2(fd, 3)\n"
        "    os.close(fd)\n"
        "runpy.run_module('kerneleval_server.jobproc.zygote', run_name='__main__')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher], pass_fds=[fd], env=env, stderr=subprocess.PIPE
    )
    theirs.close()
    ours.settimeout(60)
    return proc, ours


def zygote_env(**extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(
        [str(HERE), str(REPO / "server"), str(REPO / "clients" / "python" / "src")]
    )
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",
        "KERNELEVAL_ENGINE": "jp_light_engine",
        "KERNELEVAL_JOB_MAIN": "jp_probe_job:main",
        "CUDA_VISIBLE_DEVICES": "",
        "JP_ZYGOTE_ONLY": "not for jobs",
    }
    env.update(extra)
    return env


class FakeWatchdog:
    """Drives a zygote over its socket with zygote.proto frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FdFrameReader(sock)

    def send(self, request: zygote_pb2.ZygoteRequest, fds: list[int] | None = None) -> None:
        send_frame(self.sock, request.SerializeToString(), fds or [])

    def event(self) -> zygote_pb2.ZygoteEvent | None:
        frame = self.reader.recv_frame()
        return None if frame is None else zygote_pb2.ZygoteEvent.FromString(frame)

    def configure(self, config: zygote_pb2.ZygoteConfig) -> zygote_pb2.ZygoteReady:
        self.send(zygote_pb2.ZygoteRequest(config=config))
        event = self.event()
        assert event is not None and event.WhichOneof("kind") == "ready", event
        return event.ready

    def spawn(
        self, worker_id: str, cgroup_fds: list[int]
    ) -> tuple[zygote_pb2.JobProcessSpawned, socket.socket]:
        """Asks for a job process; returns the answer and the front end's end of its channel."""
        ours, job_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spawn = zygote_pb2.SpawnJobProcess(worker_id=worker_id, cgroup_fd_count=len(cgroup_fds))
        self.send(zygote_pb2.ZygoteRequest(spawn=spawn), [job_end.fileno(), *cgroup_fds])
        job_end.close()
        for fd in cgroup_fds:
            os.close(fd)
        event = self.event()
        assert event is not None and event.WhichOneof("kind") == "spawned", event
        ours.settimeout(60)
        return event.spawned, ours


def wait_pid(pid: int, timeout_s: float = 30.0) -> int:
    """Exit code of a (reparented) child of ours."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise TimeoutError(f"pid {pid} did not exit")
