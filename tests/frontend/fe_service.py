"""A service that runs the fake engine (fe_fake_engine.py) on fake-NVML GPUs: what the
front-end tests of GPU behaviour start, each with its own GPUs and flags."""

from __future__ import annotations

import os
from pathlib import Path

from ke_service import ServiceProcess

HERE = Path(__file__).resolve().parent
ONE_GPU = "device 0 name=FakeGPU uuid=GPU-fake-1 memory_total=1000000\n"


def fake_engine_service(
    root: Path, *args: str, nvml: str = ONE_GPU, engine: str = "fe_fake_engine"
) -> ServiceProcess:
    """Not started. `nvml`: the fake NVML's lines (written to root/fake_nvml, which a test may
    append to: XIDs, clocks); `args`: the service's own flags; `engine`: fe_fake_engine, or
    fe_fake_engine_judges (its job processes judge)."""
    (root / "fake_nvml").write_text(nvml)
    return ServiceProcess(
        root / "state",
        [
            "--nvml", "fake", "--fake-nvml-path", str(root / "fake_nvml"),
            "--engine", engine,
            *args,
        ],
        env={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
