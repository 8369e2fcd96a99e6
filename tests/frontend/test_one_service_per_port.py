"""One service per port (issue 41): a second `kerneleval serve` on a gRPC, HTTP or metrics port
that a first one holds is refused at start, with "address in use" naming the flag and a
non-zero exit, never a traceback; the first one keeps serving. Before, gRPC's listener shared
its port (SO_REUSEPORT) and connections were spread over both services.

The services run with a watchdog that exits at once: the listeners are what is tested, and
they are bound before the watchdog starts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ke_service import REPO, ServiceProcess, free_port

NO_WATCHDOG = ["--watchdog", "/bin/false"]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    http, metrics = free_port(), free_port()
    svc = ServiceProcess(
        tmp_path_factory.mktemp("first") / "state",
        ["--http-port", str(http), "--metrics-port", str(metrics), *NO_WATCHDOG],
    )
    svc.start(wait_serving=False)
    svc.http_port = http  # type: ignore[attr-defined]
    svc.metrics_port = metrics  # type: ignore[attr-defined]
    try:
        yield svc
    finally:
        svc.stop()


def second(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Another service, in a state folder of its own, on the given ports."""
    command = [sys.executable, "-m", "kerneleval_server", "serve", "--state-dir", str(state)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELEVAL_")}
    proc = subprocess.Popen(
        [*command, *args, *NO_WATCHDOG],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # it started: stop it, and say so
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        err = f"[the second service started and ran for 30 s]\n{err}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def answers_health(svc: ServiceProcess) -> bool:
    with svc.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
    return True


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_taken_port_is_refused_at_start(
    first: ServiceProcess, tmp_path: Path, flag: str
) -> None:
    port = {
        "--port": first.port,
        "--http-port": first.http_port,  # type: ignore[attr-defined]
        "--metrics-port": first.metrics_port,  # type: ignore[attr-defined]
    }[flag]
    # The other listeners of the second service on free ports (gRPC's: any).
    args = ["--port", "0", flag, str(port)] if flag != "--port" else ["--port", str(port)]
    done = second(tmp_path / "state", *args)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"{flag} {port}: address in use" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "never awaited" not in done.stderr, done.stderr[-3000:]
    assert answers_health(first)  # the first service is untouched
    assert first.proc is not None and first.proc.poll() is None


def test_a_port_in_use_by_another_program_is_named_too(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        done = second(tmp_path / "state", "--port", str(port))
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"--port {port}: address in use" in done.stderr, done.stderr[-3000:]
