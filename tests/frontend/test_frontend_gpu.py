"""On a GPU: a short run of bench/gpu_service_soak.py (good kernels mixed with illegal-address
ones) must finish with every good job correct, every bad one VERDICT_DEVICE_FAULT, none lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl"), reason="needs an NVIDIA GPU")
def test_short_service_soak_on_the_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_service_soak.py"),
         "--duration", "45", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = json.loads((tmp_path / "gpu_service_soak.json").read_text())
    assert report["jobs_lost"] == 0, proc.stdout[-3000:]
    assert report["good_succeeded"] == report["good_jobs"] > 0, report["good_failures"]
    assert report["bad_classified"] == report["bad_jobs"] > 0, report["bad_misclassified"]
    assert proc.returncode == 0
