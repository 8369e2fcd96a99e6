"""Shared fixtures: a real `python -m kerneleval_server serve` process on a free port.

`ServiceProcess` (tests/ke_service.py) starts the service in a fresh state folder, waits until
its health check says SERVING, and hands out channels and the admin token. The session-scoped
`kerneleval_service` is one such server (a fake-NVML GPU 0, a recording reset command, a
unix socket listener, metrics on); reuse it, since every worker imports torch on start.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from ke_service import ServiceProcess, free_port

# Most tests run one job again after another (a hostile job, then the next tenant's) and need
# it to run: every service the tests start has the result cache off unless the test turns it
# on (tests/frontend/test_result_cache.py passes --result-cache-hours).
os.environ.setdefault("KERNELEVAL_RESULT_CACHE_HOURS", "0")


@pytest.fixture(scope="session")
def kerneleval_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One shared service: fake-NVML GPU 0, recording reset command, unix socket, metrics."""
    root = tmp_path_factory.mktemp("kerneleval-service")
    nvml = root / "fake_nvml"
    nvml.write_text(
        "device 0 name=FakeGPU-H200 uuid=GPU-fake-0000 memory_total=150000000000\n"
        "health 0 memory_used=1000000 temperature=41 utilization=3 ok=1\n"
    )
    resets = root / "resets.log"
    reset_script = root / "record_reset.sh"
    reset_script.write_text(f'#!/bin/sh\necho "reset $1" >> {resets}\n')
    reset_script.chmod(0o755)
    unix_path = root / "grpc.sock"
    metrics_port = free_port()
    service = ServiceProcess(
        root / "state",
        [
            "--nvml",
            "fake",
            "--fake-nvml-path",
            str(nvml),
            "--reset-command",
            f"{reset_script} {{index}}",
            "--unix-socket",
            str(unix_path),
            "--metrics-port",
            str(metrics_port),
            "--health-interval-s",
            "1",
        ],
    )
    service.unix_socket = str(unix_path)
    service.metrics_port = metrics_port  # type: ignore[attr-defined]
    service.fake_nvml = nvml  # type: ignore[attr-defined]
    service.resets_log = resets  # type: ignore[attr-defined]
    service.start()
    yield service
    service.stop()
