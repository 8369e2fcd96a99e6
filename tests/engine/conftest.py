"""Fixtures for the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import RecordingReporter
from kerneleval.v1 import kernel_pb2
from kerneleval_server.engine import DeviceLimits, EngineConfig, Outcome, run_job
from kerneleval_server.spec.validation import Limits

RunFn = Callable[..., tuple[Outcome, RecordingReporter]]


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture
def run(engine_dir: Path) -> RunFn:
    def _run(
        spec: kernel_pb2.JobSpec,
        limits: Limits | None = None,
        device_limits: DeviceLimits | None = None,
    ) -> tuple[Outcome, RecordingReporter]:
        rep = RecordingReporter()
        cfg = EngineConfig(work_dir=engine_dir, device_limits=device_limits)
        if limits is not None:
            cfg.limits = limits
        return run_job(spec, rep, cfg), rep

    return _run


@pytest.fixture(autouse=True)
def _judge_keeps_nothing_from_another_test() -> None:
    """A judge keeps what it prepared ahead for its next job with the same inputs
    (engine/judge.py KEPT_MAX_BYTES): each test starts as a fresh judge."""
    from kerneleval_server.engine import judge

    judge.forget_kept()
