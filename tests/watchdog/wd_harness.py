"""Helpers for the watchdog tests: building the binary and a harness that runs it for real.

`Harness` starts the real kerneleval-watchdog through kerneleval_server.fleet.watchdog. Its
zygote is the real one (python -m kerneleval_server.jobproc.zygote) with the stand-in job main
(stand_in_job.py, also the light engine), copied into a code folder that the sandbox shows
read-only; the repository's tests and .git are not shown. Each job process's channel reaches the
harness as a descriptor (on_channel); the stand-in reports over it and takes commands on it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval_server.fleet.watchdog import AttachedFd, Watchdog

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from gpu_watchdog_check import Channel  # noqa: E402 - the same JSON-lines channel end

HERE = Path(__file__).resolve().parent
BUILD = REPO / "build" / "watchdog"
STAND_IN = HERE / "stand_in_job.py"
RECORD_RESET = HERE / "record_reset.sh"
ZYGOTE = [sys.executable, "-m", "kerneleval_server.jobproc.zygote"]

Event = watchdog_pb2.WatchdogEvent


def build(build_dir: Path, *extra: str) -> Path:
    subprocess.run(
        ["cmake", "-S", str(REPO / "watchdog"), "-B", str(build_dir), *extra],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build_dir), "-j2"], check=True, stdout=subprocess.DEVNULL
    )
    return build_dir / "kerneleval-watchdog"


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def code_paths() -> list[str]:
    """What the zygote needs to run, shown read-only at the same path in the sandbox."""
    paths = {sys.base_prefix, sys.prefix, str(REPO / "server"), str(REPO / "clients/python/src")}
    return sorted(paths)


class JobChannel(Channel):
    """The front end's end of one job process's channel (JSON lines with the stand-in)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id
        self.fd_count = 0

    def send(self, text: str) -> bool:
        assert self.writer is not None, "no channel yet"
        self.writer.write(text.encode() + b"\n")
        return True

    def of(self, key: str) -> list:
        return [m[key] for m in self.messages if key in m]


class Harness:
    def __init__(self, binary: str, root: Path) -> None:
        self.binary = binary
        self.root = root
        # Not under /tmp: a job process's /tmp is its own tmpfs.
        self.code_dir = Path(tempfile.mkdtemp(prefix="kew-code-", dir="/var/tmp"))
        self.state_dir = root / "state"
        self.fake_nvml = root / "fake_nvml"
        self.kmsg = root / "kmsg"
        self.reset_record = root / "reset_record"
        self.state_dir.mkdir()
        os.chmod(root, 0o755)
        os.chmod(self.code_dir, 0o755)
        shutil.copy(STAND_IN, self.code_dir / "stand_in_job.py")
        os.chmod(self.code_dir / "stand_in_job.py", 0o644)
        self.fake_nvml.write_text("")
        self.kmsg.write_text("")
        self.events: list[Event] = []
        self.channels: dict[str, JobChannel] = {}
        self.tasks: list[asyncio.Task] = []
        self.wd: Watchdog | None = None

    def configure(
        self, *, gpus: int = 0, mode: str = "idle", **fields: object
    ) -> watchdog_pb2.Configure:
        """A Configure for the real zygote and the stand-in job; gpus > 0 declares fake GPUs."""
        probes = [
            str(self.state_dir),
            str(REPO / "tests"),
            str(REPO / ".git"),
            str(self.root),
            str(self.fake_nvml),
            "/home",
            str(REPO / "server"),
            str(self.code_dir),
        ]
        cfg = watchdog_pb2.Configure(
            worker_command=ZYGOTE,
            worker_env={
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "PYTHONPATH": str(self.code_dir),
                "PYTHONUNBUFFERED": "1",
                "PYTHONDONTWRITEBYTECODE": "1",
                "KERNELEVAL_ENGINE": "stand_in_job",
                "KERNELEVAL_JOB_MAIN": "stand_in_job:main",
                "STANDIN_MODE": mode,
                "STANDIN_PROBE": ":".join(probes),
            },
            state_dir=str(self.state_dir),
            backoff_initial_ms=20,
            backoff_max_ms=200,
            reset_command=f"{RECORD_RESET} {self.reset_record} {{index}}",
            kmsg_path=str(self.kmsg),
            sandbox=watchdog_pb2.SandboxConfig(
                read_only_paths=[*code_paths(), str(self.code_dir)], isolate_network=True
            ),
        )
        if gpus:
            self.fake_nvml.write_text(
                "".join(f"device {i} uuid=GPU-fake-{i}\n" for i in range(gpus))
            )
            cfg.nvml_source = watchdog_pb2.NVML_SOURCE_FAKE
            cfg.fake_nvml_path = str(self.fake_nvml)
        else:
            cfg.nvml_source = watchdog_pb2.NVML_SOURCE_NONE
        for key, value in fields.items():
            if key == "worker_env":
                cfg.worker_env.update(value)  # type: ignore[call-overload]
            elif key == "sandbox":
                sb = watchdog_pb2.SandboxConfig()
                sb.CopyFrom(value)  # type: ignore[arg-type]
                if not sb.read_only_paths:
                    sb.read_only_paths.extend(cfg.sandbox.read_only_paths)
                cfg.sandbox.CopyFrom(sb)
            elif key == "xid_policy":
                cfg.xid_policy.extend(value)  # type: ignore[arg-type]
            elif key in ("device_indices", "retire_exit_codes"):
                getattr(cfg, key).extend(value)
            else:
                setattr(cfg, key, value)
        return cfg

    def _on_channel(self, event: Event, fd: AttachedFd) -> None:
        w = event.worker_started.worker
        ch = self.channels.setdefault(w.worker_id, JobChannel(w.worker_id))
        ch.fd_count += 1
        self.tasks.append(asyncio.get_running_loop().create_task(ch.serve(fd.take())))

    async def start(self, cfg: watchdog_pb2.Configure) -> Watchdog:
        self.wd = await Watchdog.start(self.binary, cfg, self.events.append, self._on_channel)
        return self.wd

    def nvml(self, line: str) -> None:
        with open(self.fake_nvml, "a") as f:
            f.write(line + "\n")

    def kernel_log(self, line: str) -> None:
        with open(self.kmsg, "a") as f:
            f.write(line + "\n")

    def command(self, worker_id: str, text: str) -> None:
        self.channels[worker_id].send(text)

    async def hang(self, worker_id: str) -> None:
        """Makes the stand-in ignore SIGTERM, and waits until it does."""
        self.command(worker_id, "hang")
        await self.wait_for(
            lambda: self.channels[worker_id].of("hanging"), 5, f"{worker_id} to ignore SIGTERM"
        )

    def cleanup(self) -> None:
        shutil.rmtree(self.code_dir, ignore_errors=True)

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.WhichOneof("kind") == kind]

    async def wait_for(
        self, pred: Callable[[], object], timeout: float = 5.0, what: str = "condition"
    ) -> object:
        deadline = time.monotonic() + timeout
        while True:
            value = pred()
            if value:
                return value
            if time.monotonic() > deadline:
                kinds = [e.WhichOneof("kind") for e in self.events]
                raise AssertionError(f"timed out waiting for {what}; events: {kinds}")
            await asyncio.sleep(0.02)

    async def count(self, kind: str, n: int, timeout: float = 10.0) -> list[Event]:
        """Waits until n events of this kind have arrived."""
        await self.wait_for(lambda: len(self.of(kind)) >= n, timeout, f"{n} {kind} events")
        return self.of(kind)

    async def report(self, worker_id: str, timeout: float = 10.0, index: int = 0) -> dict:
        """The stand-in's report (the first, or the index-th), sent over its channel."""
        await self.wait_for(
            lambda: (
                worker_id in self.channels and len(self.channels[worker_id].of("report")) > index
            ),
            timeout,
            f"{worker_id} to report",
        )
        return self.channels[worker_id].of("report")[index]

    async def started(self, n: int, timeout: float = 15.0) -> list[watchdog_pb2.Worker]:
        await self.wait_for(
            lambda: len(self.of("worker_started")) >= n, timeout, f"{n} workers started"
        )
        return [e.worker_started.worker for e in self.of("worker_started")]

    async def exited(self, n: int = 1, timeout: float = 10.0) -> list[watchdog_pb2.WorkerExited]:
        await self.wait_for(
            lambda: len(self.of("worker_exited")) >= n, timeout, f"{n} workers exited"
        )
        return [e.worker_exited for e in self.of("worker_exited")]


def cgroup_members(worker_cgroup_lines: list[str]) -> set[int]:
    """Host pids in a job process's cgroups (from the /proc/self/cgroup lines it reported)."""
    pids: set[int] = set()
    for line in worker_cgroup_lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") or [""]:
            base = Path("/sys/fs/cgroup") / c if c else Path("/sys/fs/cgroup")
            procs = base / path.lstrip("/") / "cgroup.procs"
            if procs.exists() and "kerneleval-" in path:
                pids |= {int(x) for x in procs.read_text().split()}
    return pids
