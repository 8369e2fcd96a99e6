"""What the tests that run builders and nodes as real `kerneleval serve` processes on one
PostgreSQL database share: the admin token and the arguments every one of them gets (their
`services` fixture is in conftest.py)."""

from __future__ import annotations

TOKEN = "ket_builder-test-token"


def common_args(url: str) -> list[str]:
    """One build process, no precompiled headers (seconds, not a minute, to start), a short
    lease, no result cache (the same job must run again)."""
    return ["--store", url, "--build-processes", "1", "--build-pch", "false",
            "--lease-seconds", "3", "--admin-token", TOKEN,
            "--result-cache-hours", "0"]  # fmt: skip
