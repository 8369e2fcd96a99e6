"""Fixtures for the watchdog tests (helpers in wd_harness.py)."""

from __future__ import annotations

import contextlib
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
        # Its zygotes die with it (parent-death signal); job processes are re-parented away
        # from a killed watchdog, so what is left in its cgroups is killed here.
        os.kill(h.wd.pid, 9)
        kill_cgroups_of(h.wd.pid)
    h.cleanup()
    shutil.rmtree(root, ignore_errors=True)


def kill_cgroups_of(pid: int) -> None:
    base = Path("/sys/fs/cgroup")
    for folder in [*base.glob(f"**/kerneleval-{pid}")] if base.is_dir() else []:
        for procs in folder.rglob("cgroup.procs"):
            for p in procs.read_text().split():
                with contextlib.suppress(OSError):
                    os.kill(int(p), 9)
