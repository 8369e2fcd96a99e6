"""A stand-in job main for the zygote tests (stdlib only, everything imported up front: after the
drop the job user cannot read this machine's Python under /root).

`main(fd)` looks around from inside the job process, sends one JSON frame with what it saw over
the channel, leaves a setsid daemon behind, then waits for one frame from the test: its text is
the exit code to return.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import struct
import time

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
_libc = ctypes.CDLL(None, use_errno=True)


def _status() -> dict[str, str]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def _try_unshare(flags: int) -> int:
    """0 if unshare worked, else the errno."""
    if _libc.unshare(flags) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def _daemon() -> int:
    """Double fork + setsid, SIGTERM ignored; returns the daemon's pid (in this namespace)."""
    r, w = os.pipe()
    first = os.fork()
    if first == 0:
        os.setsid()
        second = os.fork()
        if second == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.write(w, struct.pack("i", os.getpid()))
            while True:
                time.sleep(1)
        os._exit(0)
    os.waitpid(first, 0)
    os.close(w)
    pid = struct.unpack("i", os.read(r, 4))[0]
    os.close(r)
    return int(pid)


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return b""
            buf += chunk
        return buf

    header = exactly(4)
    return exactly(struct.unpack(">I", header)[0]) if header else b""


def main(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    status = _status()
    report: dict[str, object] = {
        "fd": fd,
        "pid": os.getpid(),
        "resuid": list(os.getresuid()),
        "resgid": list(os.getresgid()),
        "groups": os.getgroups(),
        "no_new_privs": status.get("NoNewPrivs"),
        "seccomp": status.get("Seccomp"),
        "proc_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "open_fds": sorted(int(p) for p in os.listdir("/proc/self/fd")),
        "cgroup": open("/proc/self/cgroup").read(),
        "env": dict(os.environ),
        "marker_existed": os.path.exists("/tmp/jp-marker"),
        "unshare_user_errno": _try_unshare(CLONE_NEWUSER),
        "unshare_ns_errno": _try_unshare(CLONE_NEWNS),
    }
    st = os.statvfs("/tmp")
    report["tmp_bytes"] = st.f_blocks * st.f_frsize
    with open("/tmp/jp-marker", "w") as f:
        f.write("left by the previous job")
    report["daemon_pid"] = _daemon()
    report["proc_pids_after"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    _send(sock, json.dumps(report).encode())
    answer = _recv(sock)
    return int(answer or b"0")
