"""Fixtures of the client tests: an in-process fake server (real gRPC on a real socket)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_server import FakeServer  # noqa: E402

KERNELBENCH = Path("/work/shared/kernelbench")


@pytest.fixture(scope="session")
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def kernelbench() -> Path:
    if not KERNELBENCH.is_dir():
        pytest.skip(f"{KERNELBENCH} not present")
    return KERNELBENCH
