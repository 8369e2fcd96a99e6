"""Issue 6's "done when": a new user installs only the client package in a fresh virtual
environment (no torch), evaluates a Triton kernel from a file with the CLI and sees progress
and a result table. pip downloads grpcio and protobuf from PyPI here (one such test only).
Issue 17: from a clone, whose clients/python has no generated code (the build makes it)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf import json_format
from test_client_e2e import TRITON_ADD, TRITON_IO
from test_client_packaging import clone_of_the_client


def _read_all(fd: int, deadline: float) -> str:
    chunks = []
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_fresh_venv_cli_evaluates_a_triton_file(kerneleval_service, tmp_path: Path):
    clone = clone_of_the_client(tmp_path / "clone")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    p = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", str(clone)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if p.returncode != 0 and "Could not find a version" in p.stdout + p.stderr:
        pytest.skip(f"PyPI unreachable: {p.stderr[-500:]}")
    assert p.returncode == 0, p.stdout + p.stderr
    # Only the client and its three dependencies (and theirs): no torch, no server.
    assert subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode != 0
    assert (
        subprocess.run([str(py), "-c", "import kerneleval_server"], capture_output=True).returncode
        != 0
    )
    installed = subprocess.run(
        [str(py), "-c", "import kerneleval, kerneleval.v1.job_pb2; print(kerneleval.__file__)"],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, installed.stderr
    assert Path(installed.stdout.strip()).is_relative_to(venv)  # the wheel's, not the checkout's

    kernel = tmp_path / "add_triton.py"
    kernel.write_text(TRITON_ADD)
    io_file = tmp_path / "io.json"
    io_file.write_text(json.dumps(json_format.MessageToDict(TRITON_IO)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["KERNELEVAL_ADDRESS"] = kerneleval_service.address
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    primary, secondary = pty.openpty()  # a terminal, as the user has: live progress bars
    proc = subprocess.Popen(
        ["kerneleval", "evaluate", str(kernel), "--io", str(io_file), "--perf-trials", "20"],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        cwd=tmp_path,
        close_fds=True,
    )
    os.close(secondary)
    text = _read_all(primary, time.monotonic() + 300)
    code = proc.wait(timeout=60)
    os.close(primary)
    assert code == 0, text
    assert "queued" in text and "started on" in text
    assert "\r\x1b[2K  profiling  [" in text and "20/20" in text
    table = text.split("finished: DONE OK", 1)[1]
    for row in ("job", "verdict", "compiled", "correct", "runtime"):
        assert f"\n{row}" in table.replace("\r\n", "\n"), table
    assert "OK" in table and "median" in table
