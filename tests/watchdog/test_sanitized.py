"""The watchdog built with AddressSanitizer and UndefinedBehaviorSanitizer
(-DKERNELEVAL_SANITIZE=ON, into build/watchdog-asan) runs its unit tests and every integration
scenario of test_watchdog.py and test_windows.py. Any sanitizer report aborts the watchdog, and a
leak turns its exit status non-zero, so either fails a scenario."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from wd_harness import HERE, REPO, build

ASAN_BUILD = REPO / "build" / "watchdog-asan"


@pytest.mark.slow
def test_sanitized_watchdog_passes_unit_and_integration_tests() -> None:
    if os.environ.get("KERNELEVAL_WATCHDOG"):
        pytest.skip("a specific watchdog binary was given")
    binary = build(ASAN_BUILD, "-DKERNELEVAL_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=Debug")
    r = subprocess.run(
        ["ctest", "--test-dir", str(ASAN_BUILD), "--output-on-failure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    env = dict(
        os.environ,
        KERNELEVAL_WATCHDOG=str(binary),
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "test_watchdog.py"),
            str(HERE / "test_windows.py"),
            "-k",
            "not links_only and not ctest",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    failed = [line for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
    summary = "\n".join(failed[:40])
    assert r.returncode == 0, summary + "\n...\n" + r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
