"""Debug aids and the process started for one job
(python -m kerneleval_server.engine.isolated_child).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from engine_helpers import ADD_MODEL, HAS_GPU, TORCH, V, job, source
from kerneleval.v1 import job_pb2
from kerneleval_server.engine import EngineConfig, isolated


def test_debug_aids_without_a_gpu_are_noted_and_the_job_still_runs(run) -> None:
    if HAS_GPU:
        return
    spec = job(source(TORCH, ADD_MODEL))
    for flag in ("sanitize", "device_metrics", "launch_blocking", "device_side_assertions"):
        setattr(spec.options, flag, True)
    out, _ = run(spec)
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.runtime.trial_count == 3
    notes = "\n".join(r.notes)
    for flag in ("sanitize", "device_metrics", "launch_blocking", "device_side_assertions"):
        assert f"{flag} needs a CUDA GPU; this worker has none: not applied" in notes


def test_child_process_runs_a_job_and_writes_its_result(tmp_path: Path) -> None:
    spec = job(source(TORCH, ADD_MODEL), perf_trial_count=2)
    (tmp_path / "spec.pb").write_bytes(spec.SerializeToString())
    cmd = [
        sys.executable,
        "-m",
        "kerneleval_server.engine.isolated_child",
        "--spec",
        str(tmp_path / "spec.pb"),
        "--out",
        str(tmp_path / "out.pb"),
        "--work-dir",
        str(tmp_path / "work"),
    ]
    env = {**os.environ, isolated.CHILD_ENV: "1"}
    subprocess.run(cmd, check=True, env=env, timeout=120)
    r = job_pb2.EvalResult()
    r.ParseFromString((tmp_path / "out.pb").read_bytes())
    assert r.verdict == job_pb2.VERDICT_OK and r.runtime.trial_count == 2


def test_a_child_that_dies_is_a_crash_with_its_signal(tmp_path: Path) -> None:
    src = ADD_MODEL.replace(
        "return a + b", "import os, signal\n        os.kill(os.getpid(), signal.SIGSEGV)"
    )
    child = isolated._run_child(job(source(TORCH, src)), EngineConfig(work_dir=tmp_path), {}, [])
    assert child.result.verdict == job_pb2.VERDICT_CRASHED
    assert child.result.fault.signal == signal.SIGSEGV
    assert "SIGSEGV" in child.result.fault.description


FAKE_SANITIZER = """#!/bin/sh
# Stands in for compute-sanitizer: reports one bad write, then runs the command.
echo "========= COMPUTE-SANITIZER"
echo "========= Invalid __global__ write of size 4 bytes"
echo "=========     at add_kernel+0x70 in /tmp/k.py:12"
while [ "$1" != "--target-processes" ]; do shift; done; shift 2
[ "$PYTORCH_NO_CUDA_MEMORY_CACHING" = "1" ] || exit 9
"$@"
echo "========= ERROR SUMMARY: 1 error"
"""
FAKE_NCU = """#!/bin/sh
# Stands in for ncu: checks the NVTX filter reached the child, runs it, prints CSV rows.
while [ "$1" != "--csv" ]; do shift; done; shift
[ "$KERNELEVAL_NVTX" = "1" ] || exit 9
"$@" >/dev/null 2>&1
echo '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
echo '"0","add_kernel","gpu__time_duration.sum","nsecond","4,096"'
echo '"0","add_kernel","dram__throughput.avg.pct_of_peak_sustained_elapsed","%","81.5"'
"""


def fake_tool(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def pretend_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The isolated paths as on a GPU host; the child itself still runs on the CPU."""
    monkeypatch.setattr(isolated, "has_gpu", lambda: True)


def test_launch_blocking_runs_in_a_child_with_the_variable(run, pretend_gpu) -> None:
    check = ADD_MODEL.replace(
        "return a + b",
        "import os\n        assert os.environ['CUDA_LAUNCH_BLOCKING'] == '1'\n        return a + b",
    )
    spec = job(source(TORCH, check), launch_blocking=True, device_side_assertions=True)
    out, rep = run(spec)
    r = out.result
    assert r.verdict == V.VERDICT_OK, r
    assert any("CUDA_LAUNCH_BLOCKING" in n and "TORCH_USE_CUDA_DSA" in n for n in r.notes)
    assert rep.phases() == [V.PHASE_COMPILING, V.PHASE_PROFILING] and not out.context_poisoned


def test_sanitize_attaches_the_report_and_fails_a_kernel_with_errors(
    run, pretend_gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = fake_tool(tmp_path, "compute-sanitizer", FAKE_SANITIZER)
    monkeypatch.setattr(isolated, "cuda_tool", lambda name: tool)
    out, _ = run(job(source(TORCH, ADD_MODEL), sanitize=True))
    r = out.result
    assert r.verdict == V.VERDICT_DEVICE_FAULT and not r.correctness
    assert "Invalid __global__ write of size 4 bytes" in r.sanitizer_report
    assert r.error.message == "compute-sanitizer memcheck found 1 errors"
    assert r.runtime.trial_count == 0 and any("not timed" in n for n in r.notes)


def test_device_metrics_come_from_ncu_beside_a_normal_run(
    run, pretend_gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = fake_tool(tmp_path, "ncu", FAKE_NCU)
    monkeypatch.setattr(isolated, "cuda_tool", lambda name: tool)
    out, _ = run(job(source(TORCH, ADD_MODEL), device_metrics=True))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.runtime.trial_count == 3  # timed in-process
    assert r.device_metrics.kernel_name == "add_kernel"
    assert r.device_metrics.values["gpu__time_duration.sum"] == 4096
    assert r.device_metrics.values["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 81.5


def test_missing_tools_are_noted(run, pretend_gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isolated, "cuda_tool", lambda name: None)
    out, _ = run(job(source(TORCH, ADD_MODEL), sanitize=True, device_metrics=True))
    notes = "\n".join(out.result.notes)
    assert out.result.verdict == V.VERDICT_OK
    assert "compute-sanitizer was not found" in notes and "ncu was not found" in notes
