"""Stand-in worker for the watchdog tests (stdlib only, so any user can run it).

STANDIN_MODE: "idle" (default) reports itself in $STANDIN_DIR/<worker id>.json, then waits for
a command in $STANDIN_DIR/<worker id>.cmd: "segv", "exit N", or "hang" (ignore SIGTERM);
"crash" segfaults at once; "exit" exits with $STANDIN_EXIT (default 3) at once.
STANDIN_CHILD=1 starts a grandchild (sleep) first, to check that whole process groups die.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

PLAIN_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TMPDIR", "HOME", "TRITON_CACHE_DIR",
             "TORCH_EXTENSIONS_DIR")


def report(path: str, child_pid: int) -> None:
    with open("/proc/self/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    info = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "uid": os.getuid(),
        "child_pid": child_pid,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("KERNELEVAL_", "STANDIN_"))}
        | {k: os.environ.get(k, "") for k in PLAIN_ENV},
        "no_new_privs": status.get("NoNewPrivs", "").strip(),
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE)[0],
        "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "netns": os.readlink("/proc/self/ns/net"),
        "tmpdir_writable": os.access(os.environ.get("TMPDIR", "/nonexistent"), os.W_OK),
        "stdin_is_devnull": os.path.samefile("/proc/self/fd/0", "/dev/null"),
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def main() -> None:
    mode = os.environ.get("STANDIN_MODE", "idle")
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "exit":
        sys.exit(int(os.environ.get("STANDIN_EXIT", "3")))
    child_pid = 0
    if os.environ.get("STANDIN_CHILD") == "1":
        child_pid = subprocess.Popen(["sleep", "300"]).pid
    base = os.path.join(os.environ["STANDIN_DIR"], os.environ["KERNELEVAL_WORKER_ID"])
    report(base + ".json", child_pid)
    while True:
        time.sleep(0.02)
        try:
            with open(base + ".cmd") as f:
                cmd = f.read().split()
            os.unlink(base + ".cmd")
        except FileNotFoundError:
            continue
        if cmd[:1] == ["segv"]:
            os.kill(os.getpid(), signal.SIGSEGV)
        elif cmd[:1] == ["exit"]:
            sys.exit(int(cmd[1]))
        elif cmd[:1] == ["hang"]:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with open(base + ".hanging", "w"):
                pass


if __name__ == "__main__":
    main()
