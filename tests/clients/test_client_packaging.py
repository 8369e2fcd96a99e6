"""`pip install clients/python` from a clone: the build generates kerneleval.v1 and
kerneleval.internal from ../../proto (they are not in git) and the wheel ships them."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import kerneleval
import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT_PKG = REPO / "clients" / "python"
# What git ignores there: a clone has none of it.
NOT_IN_A_CLONE = shutil.ignore_patterns("v1", "internal", "build", "*.egg-info", "__pycache__")


def clone_of_the_client(root: Path) -> Path:
    """clients/python and proto/ as a fresh clone has them: no generated code."""
    pkg = root / "clients" / "python"
    shutil.copytree(CLIENT_PKG, pkg, ignore=NOT_IN_A_CLONE)
    shutil.copytree(REPO / "proto", root / "proto")
    assert not (pkg / "src" / "kerneleval" / "v1").exists()
    return pkg


def build_wheel(source: Path, out: Path) -> Path:
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0 and "Could not find a version" in p.stdout + p.stderr:
        pytest.skip(f"the package index is unreachable: {p.stderr[-500:]}")
    assert p.returncode == 0, p.stdout + p.stderr
    (wheel,) = out.glob("kerneleval_client-*.whl")
    return wheel


def test_wheel_from_a_clone_has_the_generated_code(tmp_path: Path) -> None:
    pkg = clone_of_the_client(tmp_path / "clone")
    wheel = build_wheel(pkg, tmp_path / "dist")
    assert wheel.name.startswith(f"kerneleval_client-{kerneleval.__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = email.message_from_bytes(
            zf.read(f"kerneleval_client-{kerneleval.__version__}.dist-info/METADATA")
        )
    for module in (
        "kerneleval/v1/__init__.py",
        "kerneleval/v1/kernel_eval_service_pb2.py",
        "kerneleval/v1/kernel_eval_service_pb2_grpc.py",
        "kerneleval/v1/kernel_eval_service_pb2.pyi",
        "kerneleval/v1/kernel_eval_service_pb2_grpc.pyi",  # typed by mypy-protobuf
        "kerneleval/internal/v1/watchdog_pb2.py",
        "kerneleval/cli/__init__.py",
        "kerneleval/cli/__main__.py",
        "kerneleval/py.typed",
    ):
        assert module in names, sorted(names)
    assert not (pkg / "src" / "kerneleval" / "v1").exists()  # the build left the tree alone
    assert "rich" in meta.get_all("Provides-Extra", [])
    assert any(r.startswith("rich>=13") for r in meta.get_all("Requires-Dist", []))

    # Installed alone, it imports: the generated code loads against this grpcio and protobuf.
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel],
        check=True,
        capture_output=True,
        timeout=120,
    )
    probe = (
        "import kerneleval, kerneleval.v1.kernel_eval_service_pb2_grpc as g, "
        "kerneleval.internal.v1.watchdog_pb2 as w; "
        "print(kerneleval.__file__, kerneleval.__version__, g.KernelEvalServiceStub.__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    path, version, stub = out.stdout.split()
    assert Path(path).is_relative_to(site) and version == kerneleval.__version__
    assert stub == "KernelEvalServiceStub"


def test_a_tree_without_protos_or_generated_code_says_so(tmp_path: Path) -> None:
    pkg = tmp_path / "python"
    shutil.copytree(CLIENT_PKG, pkg, ignore=NOT_IN_A_CLONE)  # no ../../proto beside it
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(pkg)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode != 0
    assert "neither the protos" in p.stdout + p.stderr
