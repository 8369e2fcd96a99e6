"""bench/gpu_watchdog_check.py: rehearsed on the CPU (fake NVML, a fake kernel log, the real zygote
with the script's job main), and for real on a GPU (real NVML, a planted out-of-bounds Triton
store, a recording reset command)."""

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


def run_check(out: Path, binary: str, *extra: str, rc: int = 0) -> dict:
    env = dict(os.environ, KERNELEVAL_WATCHDOG=binary)
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=REPO,
    )
    assert r.returncode == rc, r.stdout[-4000:] + r.stderr[-4000:]
    results = json.loads((out / "gpu_watchdog_check.json").read_text())
    assert (out / "gpu_watchdog_check.md").read_text().startswith("# Watchdog GPU check")
    return dict(results)


def test_gpu_check_script_dry_run(tmp_path: Path, watchdog_binary: str) -> None:
    results = run_check(tmp_path, watchdog_binary, "--dry-run")
    assert results["passed"]
    checks = results["checks"]
    assert checks["job_processes_started"] is True and checks["job_user_not_root"] is True
    assert checks["victim_killed_for_xid"] and checks["replacement_cuda_op"] is True
    assert checks["xid_observed"] and checks["xid_pid_is_victim"] is True
    assert checks["survivor_same_pid"] and checks["reset_all_steps_ok"]
    assert checks["reset_command_recorded_only"]
    assert results["xid"]["action"] == "restart_worker"
    victim = results["xid"]["worker_ids"][0]
    assert results["xid"]["pid"] == results["job_processes"][victim]["host_pid"]
    assert results["job_processes"][victim]["pid"] == 1  # PID 1 of its own namespace


def test_gpu_check_reports_why_job_processes_did_not_start(
    tmp_path: Path, watchdog_binary: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the job user is chosen only when the watchdog runs as root")
    results = run_check(
        tmp_path, watchdog_binary, "--dry-run", "--worker-user", "kew-no-such-user", rc=1
    )
    assert not results["passed"]
    why = results["checks"]["job_processes_started"]
    assert why.startswith("no: ") and "kew-no-such-user" in why


@pytest.mark.gpu
def test_gpu_check_real_nvml(tmp_path: Path, watchdog_binary: str) -> None:
    if not has_nvidia_gpu():
        pytest.skip("no NVIDIA GPU (libnvidia-ml.so.1)")
    results = run_check(tmp_path, watchdog_binary)
    assert results["passed"], results["checks"]
