"""bench/bench_hardening.py's CPU smoke: both arms run the same jobs, every one OK, and the
armed child's own check finds nothing changed (the jobs are honest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_smoke_run_compares_an_armed_and_an_unarmed_child(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_hardening.py"), "--cpu-smoke",
         "--out", str(tmp_path), "--jobs", "2", "--warmup", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "bench_hardening_smoke.json").read_text())
    assert data["problems"] == []
    arms = {run["arm"]: run for run in data["runs"]}
    assert set(arms) == {"armed", "unarmed"}
    assert arms["armed"]["times"].keys() == arms["unarmed"]["times"].keys()
    assert all(len(t) == 2 for run in arms.values() for t in run["times"].values())
    assert arms["armed"]["steps"]["check_timers() found changes"] == 0
    assert arms["unarmed"]["steps"] == {}
