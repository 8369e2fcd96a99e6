"""bench/gpu_watchdog_check.py: rehearsed on the CPU (fake NVML, a fake kernel log), and for real
on a GPU (real NVML, a planted out-of-bounds Triton store, a recording reset command)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from wd_harness import REPO

SCRIPT = REPO / "bench" / "gpu_watchdog_check.py"


def has_nvidia_gpu() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def run_check(out: Path, binary: str, *extra: str) -> dict:
    env = dict(os.environ, KERNELEVAL_WATCHDOG=binary)
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    results = json.loads((out / "gpu_watchdog_check.json").read_text())
    assert (out / "gpu_watchdog_check.md").read_text().startswith("# Watchdog GPU check")
    return dict(results)


def test_gpu_check_script_dry_run(tmp_path: Path, watchdog_binary: str) -> None:
    results = run_check(tmp_path, watchdog_binary, "--dry-run")
    assert results["passed"]
    checks = results["checks"]
    assert checks["xid_observed"] and checks["xid_pid_is_victim"] is True
    assert checks["survivor_same_pid"] and checks["reset_all_steps_ok"]
    assert checks["reset_command_recorded_only"]
    assert results["xid"]["action"] == "restart_worker"


@pytest.mark.gpu
def test_gpu_check_real_nvml(tmp_path: Path, watchdog_binary: str) -> None:
    if not has_nvidia_gpu():
        pytest.skip("no NVIDIA GPU (libnvidia-ml.so.1)")
    results = run_check(tmp_path, watchdog_binary)
    assert results["passed"], results["checks"]
