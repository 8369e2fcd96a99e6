"""Stand-in job main for the watchdog tests (stdlib only): the real zygote
(kerneleval_server.jobproc.zygote) runs it in each job process as KERNELEVAL_JOB_MAIN
"stand_in_job:main", and imports this module as its light engine (KERNELEVAL_ENGINE
"stand_in_job").

It talks JSON lines over its channel (descriptor 3), which the front end (the test harness)
got from the watchdog as SCM_RIGHTS: first a report of what the job process sees, then it
answers commands, one a line:
  "report"          the report again
  "segv"            a real segmentation fault (PID 1 of a namespace ignores a plain kill)
  "exit N"          returns N (the job process's exit code)
  "hang"            ignores SIGTERM (answers {"hanging": true})
  "daemon"          double fork + setsid, a grandchild that ignores SIGTERM and sleeps
  "try_escape"      what the seccomp filter answers to unshare/setns/mount/ptrace
  "burn"            a thread that keeps a CPU busy (answers {"burning": true}): the tests of
                    timing windows watch its CPU time stop while it is frozen
STANDIN_MODE: "idle" (default); "crash" segfaults at once; "exit" returns $STANDIN_EXIT
(default 3) at once, before the report.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import socket
import threading
import time

PLAIN_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "TMPDIR",
    "HOME",
    "TRITON_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "PATH",
    "PYTHONPATH",
)


def configure_process_environment() -> None:
    """The light engine's configuration (the zygote calls it before importing anything)."""
    os.environ["STANDIN_ENGINE_CONFIGURED"] = "1"


def _status() -> dict[str, str]:
    with open("/proc/self/status") as f:
        return {
            k: v.strip() for k, v in (line.rstrip("\n").split(":", 1) for line in f if ":" in line)
        }


def _mounts() -> dict[str, str]:
    out = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            out[parts[1]] = parts[2] + " " + parts[3]
    return out


def report() -> dict:
    status = _status()
    tmp = os.statvfs("/tmp")
    probes = [p for p in os.environ.get("STANDIN_PROBE", "").split(":") if p]
    try:
        root_listing = sorted(os.listdir("/root"))
    except OSError as exc:
        root_listing = [f"error {exc.errno}"]
    tmp_file = f"/tmp/standin-{os.environ.get('KERNELEVAL_WORKER_ID', '')}"
    with open(tmp_file, "w") as f:
        f.write("x")
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "groups": os.getgroups(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("KERNELEVAL_", "STANDIN_"))}
        | {k: os.environ.get(k, "") for k in PLAIN_ENV},
        "no_new_privs": status.get("NoNewPrivs", ""),
        "seccomp": status.get("Seccomp", ""),
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE)[0],
        "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "netns": os.readlink("/proc/self/ns/net"),
        "mntns": os.readlink("/proc/self/ns/mnt"),
        "pidns": os.readlink("/proc/self/ns/pid"),
        "visible": {p: os.path.exists(p) for p in probes},
        "root_listing": root_listing,
        "tmp_bytes": tmp.f_blocks * tmp.f_frsize,
        "tmp_listing": sorted(os.listdir("/tmp")),
        "tmp_mount": _mounts().get("/tmp", ""),
        "root_mount": _mounts().get("/", ""),
        "dev": sorted(os.listdir("/dev")),
        "proc_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "cgroup": open("/proc/self/cgroup").read().splitlines(),
        "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")),
    }


def try_escape() -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    calls = {
        "unshare": lambda: libc.unshare(0x00020000),  # CLONE_NEWNS
        "unshare_user": lambda: libc.unshare(0x10000000),  # CLONE_NEWUSER
        "setns": lambda: libc.setns(0, 0),
        "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
        "ptrace": lambda: libc.ptrace(0, 0, None, None),  # PTRACE_TRACEME
    }
    for name, call in calls.items():
        r = call()
        out[name] = "ok" if r == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    out["getpid"] = os.getpid()
    return out


def daemon() -> None:
    """A grandchild in its own session that ignores SIGTERM and outlives its parent."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(1)
        os._exit(0)
    os.wait()


def burn() -> None:
    def spin() -> None:
        n = 0
        while True:
            n += 1

    threading.Thread(target=spin, daemon=True).start()


def main(channel_fd: int) -> int:
    mode = os.environ.get("STANDIN_MODE", "idle")
    if mode == "crash":
        ctypes.string_at(0)
    if mode == "exit":
        return int(os.environ.get("STANDIN_EXIT", "3"))
    sock = socket.socket(fileno=channel_fd)
    f = sock.makefile("rwb", buffering=0)

    def send(obj: dict) -> None:
        f.write(json.dumps(obj).encode() + b"\n")

    send({"report": report()})
    for line in f:
        cmd = line.decode().split()
        if not cmd:
            continue
        if cmd[0] == "report":
            send({"report": report()})
        elif cmd[0] == "segv":
            ctypes.string_at(0)
        elif cmd[0] == "exit":
            return int(cmd[1])
        elif cmd[0] == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            send({"hanging": True})
        elif cmd[0] == "daemon":
            daemon()
            send({"daemon": True})
        elif cmd[0] == "try_escape":
            send({"escape": try_escape()})
        elif cmd[0] == "burn":
            burn()
            send({"burning": True})
    return 0  # the front end closed the channel
