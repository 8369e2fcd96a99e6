"""Fixtures for the watchdog tests (helpers in wd_harness.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from wd_harness import BUILD, Harness, build, pid_alive


@pytest.fixture(scope="session")
def watchdog_binary() -> str:
    if os.environ.get("KERNELEVAL_WATCHDOG"):
        return os.environ["KERNELEVAL_WATCHDOG"]
    return str(build(BUILD))


@pytest.fixture
def harness(watchdog_binary: str) -> Iterator[Harness]:
    root = Path(tempfile.mkdtemp(prefix="kew-test-", dir="/tmp"))
    h = Harness(watchdog_binary, root)
    yield h
    if h.wd is not None and pid_alive(h.wd.pid):
        os.kill(h.wd.pid, 9)  # its workers die with it (parent-death signal)
    shutil.rmtree(root, ignore_errors=True)
