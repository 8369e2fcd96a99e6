"""doctor's GPU paths: through a fake child interpreter here, for real on a GPU machine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from kerneleval import doctor


def _fake_python(tmp_path: Path, payload: dict, code: int = 0) -> str:
    exe = tmp_path / "fake-python"
    exe.write_text(f"#!/bin/sh\necho '{json.dumps(payload)}'\nexit {code}\n")
    exe.chmod(0o755)
    return str(exe)


def test_child_report_of_a_working_gpu(tmp_path):
    py = _fake_python(
        tmp_path,
        {
            "torch": "2.11.0+cu128",
            "torch_cuda": "12.8",
            "cuda_available": True,
            "device_count": 1,
            "device_name": "NVIDIA H200",
            "capability": "9.0",
            "kernel_ok": True,
            "triton": "3.6.0",
        },
    )
    r = doctor.Report()
    doctor.check_python_stack(r, python=py)
    text = r.text()
    assert "torch: 2.11.0+cu128 (CUDA 12.8)" in text
    assert "device: NVIDIA H200 (sm 9.0), 1 visible" in text
    assert "tiny kernel: ok" in text and "triton: 3.6.0" in text


def test_child_report_of_a_broken_driver(tmp_path):
    py = _fake_python(
        tmp_path,
        {
            "torch": "2.11.0+cu128",
            "torch_cuda": "12.8",
            "cuda_available": True,
            "torch_error": "RuntimeError: CUDA error: an illegal memory access was encountered",
            "triton_error": "ImportError: no triton",
        },
        code=1,
    )
    r = doctor.Report()
    doctor.check_python_stack(r, python=py)
    text = r.text()
    assert "illegal memory access" in text and "ImportError: no triton" in text
    assert "child exit: 1" in text


def test_child_that_hangs_is_cut_off(tmp_path, monkeypatch):
    exe = tmp_path / "hang"
    exe.write_text("#!/bin/sh\nsleep 30 &\nsleep 30\n")  # a grandchild holds the pipe too
    exe.chmod(0o755)
    monkeypatch.setattr(doctor, "CHILD_TIMEOUT_S", 0.5)
    r = doctor.Report()
    doctor.check_python_stack(r, python=str(exe))
    assert "timed out after 0.5 s" in r.text()


def test_a_failing_check_leaves_a_hole_not_a_crash():
    def boom(r: doctor.Report) -> None:
        raise RuntimeError("kaboom")

    r = doctor.run_doctor(None, None, 1.0, checks=[doctor.check_host, boom])
    text = r.text()
    assert "## host" in text and "## boom" in text and "kaboom" in text


@pytest.mark.gpu
def test_doctor_on_a_gpu():
    if not Path("/dev/nvidiactl").exists():
        pytest.skip("no NVIDIA driver")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    r = doctor.Report()
    doctor.check_python_stack(r, python=sys.executable)
    doctor.check_nvidia_smi(r)
    text = r.text()
    assert "cuda available: True" in text and "tiny kernel: ok" in text
    assert "driver/CUDA:" in text
