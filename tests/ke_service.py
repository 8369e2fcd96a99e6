"""A real `python -m kerneleval_server serve` process for tests (see tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[1]
WATCHDOG_BINARY = REPO / "build" / "watchdog" / "kerneleval-watchdog"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def real_watchdog_available() -> bool:
    client = REPO / "server" / "kerneleval_server" / "fleet" / "watchdog.py"
    return WATCHDOG_BINARY.exists() and client.exists()


def gpu_service_marks() -> list[pytest.MarkDecorator]:
    """A test module's marks for a real service on a GPU: the gpu mark, skipped without an
    NVIDIA GPU or the built watchdog."""
    return [
        pytest.mark.gpu,
        pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs an NVIDIA GPU"),
        pytest.mark.skipif(not real_watchdog_available(), reason="needs the watchdog"),
    ]


class ServiceProcess:
    """One service process; `start()` again after `kill()` reuses the state folder."""

    def __init__(
        self, state_dir: Path, args: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.state_dir = state_dir
        self.args = list(args or [])
        self.env = dict(env or {})
        self.tls_root: bytes | None = None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = state_dir / "service.log"
        self.unix_socket = ""
        state_dir.mkdir(parents=True, exist_ok=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def admin_token(self) -> str:
        return (self.state_dir / "admin_token").read_text().strip()

    def auth(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.admin_token}")]

    def command(self) -> list[str]:
        port_file = self.state_dir / "port"
        port_file.unlink(missing_ok=True)
        return [
            sys.executable,
            "-m",
            "kerneleval_server",
            "serve",
            "--port",
            str(self.port or 0),
            "--port-file",
            str(port_file),
            "--state-dir",
            str(self.state_dir),
            "--watchdog",
            str(WATCHDOG_BINARY),
            "--log-level",
            "DEBUG",
            *self.args,
        ]

    def start(self, timeout: float = 90.0, wait_serving: bool = True) -> None:
        if "--watchdog" not in self.args and not real_watchdog_available():
            pytest.skip(f"the watchdog is not built ({WATCHDOG_BINARY}): run `make watchdog`")
        env = dict(os.environ)
        env.pop("KERNELEVAL_ADMIN_TOKEN", None)
        env.update(self.env)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, env=env, cwd=REPO)
        log.close()
        port_file = self.state_dir / "port"
        deadline = time.monotonic() + timeout
        while not port_file.exists() or not port_file.read_text().strip():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no port file; log:\n{self.log_tail()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        if wait_serving:
            self.wait_serving(deadline - time.monotonic())

    def wait_serving(self, timeout: float = 60.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with self.channel() as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                self._check_alive()
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not SERVING; log:\n{self.log_tail()}")
                time.sleep(0.1)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log_tail()}")

    def channel(self) -> grpc.Channel:
        if self.tls_root is not None:  # a test CA: the certificate names 127.0.0.1
            creds = grpc.ssl_channel_credentials(root_certificates=self.tls_root)
            return grpc.secure_channel(self.address, creds)
        return grpc.insecure_channel(self.address)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown at all (the watchdog sees its channel close)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)
