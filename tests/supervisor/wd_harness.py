"""Helpers for the watchdog tests: building the binary and a harness that runs it for real.

`Harness` starts the real kerneleval-watchdog through kerneleval_server.watchdog with the
stand-in worker (stand_in_worker.py), a fake NVML file, a kernel log file and state folders
that the unprivileged worker user can use, and records every event it sends.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kerneleval.internal.v1 import supervisor_pb2
from kerneleval_server.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = REPO / "build" / "supervisor"
STAND_IN = HERE / "stand_in_worker.py"
RECORD_RESET = HERE / "record_reset.sh"
# A system python the "nobody" user can run (the venv's may live under /root).
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

Event = supervisor_pb2.SupervisorEvent


def build(build_dir: Path, *extra: str) -> Path:
    subprocess.run(
        ["cmake", "-S", str(REPO / "supervisor"), "-B", str(build_dir), *extra],
        check=True, stdout=subprocess.DEVNULL,
    )
    subprocess.run(["cmake", "--build", str(build_dir), "-j2"], check=True,
                   stdout=subprocess.DEVNULL)
    return build_dir / "kerneleval-watchdog"


def pid_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class Harness:
    def __init__(self, binary: str, root: Path) -> None:
        self.binary = binary
        self.root = root
        self.standin_dir = root / "standin"
        self.state_dir = root / "state"
        self.fake_nvml = root / "fake_nvml"
        self.kmsg = root / "kmsg"
        self.reset_record = root / "reset_record"
        for d in (self.standin_dir, self.state_dir):
            d.mkdir()
        os.chmod(root, 0o755)
        os.chmod(self.standin_dir, 0o777)
        self.fake_nvml.write_text("")
        self.kmsg.write_text("")
        self.events: list[Event] = []
        self.wd: Watchdog | None = None

    def configure(self, *, gpus: int = 0, mode: str = "idle", **fields: object
                  ) -> supervisor_pb2.Configure:
        """A Configure for the stand-in worker; gpus > 0 declares fake GPUs."""
        cfg = supervisor_pb2.Configure(
            worker_command=[PYTHON, str(STAND_IN)],
            worker_env={"STANDIN_DIR": str(self.standin_dir), "STANDIN_MODE": mode},
            state_dir=str(self.state_dir),
            backoff_initial_ms=20,
            backoff_max_ms=200,
            reset_command=f"{RECORD_RESET} {self.reset_record} {{index}}",
            kmsg_path=str(self.kmsg),
        )
        if gpus:
            self.fake_nvml.write_text("".join(f"device {i}\n" for i in range(gpus)))
            cfg.nvml_source = supervisor_pb2.NVML_SOURCE_FAKE
            cfg.fake_nvml_path = str(self.fake_nvml)
        else:
            cfg.nvml_source = supervisor_pb2.NVML_SOURCE_NONE
        for key, value in fields.items():
            if key == "worker_env":
                cfg.worker_env.update(value)  # type: ignore[call-overload]
            elif key == "sandbox":
                cfg.sandbox.CopyFrom(value)  # type: ignore[arg-type]
            elif key == "xid_policy":
                cfg.xid_policy.extend(value)  # type: ignore[arg-type]
            elif key in ("device_indices", "retire_exit_codes"):
                getattr(cfg, key).extend(value)
            else:
                setattr(cfg, key, value)
        return cfg

    async def start(self, cfg: supervisor_pb2.Configure) -> Watchdog:
        self.wd = await Watchdog.start(self.binary, cfg, self.events.append)
        return self.wd

    def nvml(self, line: str) -> None:
        with open(self.fake_nvml, "a") as f:
            f.write(line + "\n")

    def kernel_log(self, line: str) -> None:
        with open(self.kmsg, "a") as f:
            f.write(line + "\n")

    def command(self, worker_id: str, text: str) -> None:
        (self.standin_dir / f"{worker_id}.cmd").write_text(text)

    async def hang(self, worker_id: str) -> None:
        """Makes the stand-in ignore SIGTERM, and waits until it does."""
        self.command(worker_id, "hang")
        marker = self.standin_dir / f"{worker_id}.hanging"
        await self.wait_for(marker.exists, 5, f"{worker_id} to ignore SIGTERM")

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.WhichOneof("kind") == kind]

    async def wait_for(self, pred: Callable[[], object], timeout: float = 5.0,
                       what: str = "condition") -> object:
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

    async def report(self, worker_id: str, timeout: float = 5.0) -> dict:
        path = self.standin_dir / f"{worker_id}.json"
        await self.wait_for(path.exists, timeout, f"{worker_id} to report")
        return json.loads(path.read_text())

    async def started(self, n: int, timeout: float = 5.0) -> list[supervisor_pb2.Worker]:
        await self.wait_for(lambda: len(self.of("worker_started")) >= n, timeout,
                            f"{n} workers started")
        return [e.worker_started.worker for e in self.of("worker_started")]

    async def exited(self, n: int = 1, timeout: float = 5.0) -> list[supervisor_pb2.WorkerExited]:
        await self.wait_for(lambda: len(self.of("worker_exited")) >= n, timeout,
                            f"{n} workers exited")
        return [e.worker_exited for e in self.of("worker_exited")]
