"""Debug aids and the process started for one job (python -m kerneleval_server.engine.isolated)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
        "kerneleval_server.engine.isolated",
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
