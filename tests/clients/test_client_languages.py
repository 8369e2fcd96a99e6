"""The Node.js and C++ clients, built from proto/ and run against the real service.

CI has node/npm and the C++ toolchain; these tests skip (with the reason) only where the tool
itself is missing. `npm ci` and the CMake build are done here when not done yet (`make`
normally does them first, so that the time is not spent inside the test run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kerneleval import Client

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = REPO / "clients" / "node"
CPP_DIR = REPO / "clients" / "cpp"
CPP_BUILD = REPO / "build" / "clients-cpp"
CPP_EXAMPLE = CPP_BUILD / "kerneleval_evaluate"

MODEL = """import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 3.0


def get_inputs():
    return [torch.randn(512)]


def get_init_inputs():
    return []
"""
BROKEN = MODEL.replace("class Model(torch.nn.Module):", "class Model(torch.nn.Module)")


def _env(svc) -> dict[str, str]:
    return {
        **os.environ,
        "KERNELEVAL_ADDRESS": svc.address,
        "KERNELEVAL_ADMIN_TOKEN": svc.admin_token,
    }


def _need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed here: {', '.join(missing)}")


def test_node_client_against_the_real_service(kerneleval_service):
    _need("node", "npm")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        p = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run(
        ["node", "--test", "test/client.test.js", "test/reattach.test.js"],
        cwd=NODE_DIR,
        env=_env(kerneleval_service),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert "# fail 0" in p.stdout and "# skipped 0" in p.stdout, p.stdout[-3000:]


@contextlib.contextmanager
def tenants_service(tmp_path: Path) -> Iterator[tuple[Any, str, str]]:
    """(a service with --tenants-file, alice's token, bob's): the CPU stand-in watchdog of
    tests/frontend, as its hostile tenant tests use."""
    from ke_service import ServiceProcess
    from kerneleval_server.api import tenants

    frontend = REPO / "tests" / "frontend"
    watchdog = tmp_path / "fake-watchdog"
    watchdog.write_text(
        f'#!/bin/sh\nexec {sys.executable} {frontend / "fe_fake_watchdog.py"} "$@"\n'
    )
    watchdog.chmod(0o755)
    (alice, alice_line), (bob, bob_line) = tenants.new_token("alice"), tenants.new_token("bob")
    (tmp_path / "tenants").write_text(f"{alice_line}\n{bob_line}\n")
    svc = ServiceProcess(
        tmp_path / "state",
        [
            "--nvml",
            "none",
            "--watchdog",
            str(watchdog),
            "--tenants-file",
            str(tmp_path / "tenants"),
        ],
        env={"PYTHONPATH": os.pathsep.join([str(frontend), os.environ.get("PYTHONPATH", "")])},
    )
    svc.start()
    try:
        yield svc, alice, bob
    finally:
        svc.stop()


def _env_of(svc: Any, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELEVAL_")}
    return env | {"KERNELEVAL_ADDRESS": svc.address} | more


def test_node_client_sends_a_tenant_token(tmp_path: Path) -> None:
    """clients/node's `tenantToken` (env KERNELEVAL_TENANT_TOKEN) against a service with
    --tenants-file: the job is the tenant's, another tenant's token gets NOT_FOUND, none or a
    wrong one UNAUTHENTICATED."""
    _need("node")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip("clients/node has no node_modules (make runs npm ci)")
    with tenants_service(tmp_path) as (svc, alice, bob):
        env = _env_of(
            svc,
            KERNELEVAL_TENANT_TOKEN=alice,
            KERNELEVAL_OTHER_TENANT_TOKEN=bob,
            KERNELEVAL_TENANT_NAME="alice",
        )
        p = subprocess.run(
            ["node", "--test", "test/tenant.test.js"],
            cwd=NODE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert "# fail 0" in p.stdout and "# skipped 0" in p.stdout, p.stdout[-3000:]


@pytest.fixture(scope="module")
def cpp_example() -> Path:
    _need("cmake", "protoc", "grpc_cpp_plugin", "g++")
    if not (CPP_BUILD / "CMakeCache.txt").exists():
        p = subprocess.run(
            ["cmake", "-S", str(CPP_DIR), "-B", str(CPP_BUILD)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stdout + p.stderr
    # Incremental: a no-op when `make` already built it.
    p = subprocess.run(
        ["cmake", "--build", str(CPP_BUILD), "-j2"], capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-5000:]
    return CPP_EXAMPLE


def test_cpp_example_against_the_real_service(kerneleval_service, cpp_example, tmp_path):
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    p = subprocess.run(
        [str(cpp_example), str(model), str(model)],
        env=_env(kerneleval_service),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("Evaluate: job ") and lines[0].endswith(
        "JOB_STATE_DONE verdict VERDICT_OK"
    )
    assert lines[1].startswith("#1 queued")
    seqs = [int(ln.split()[0][1:]) for ln in lines if ln.startswith("#")]
    assert seqs == list(range(1, len(seqs) + 1))
    assert "phase PHASE_PROFILING" in p.stdout and "verdict: VERDICT_OK" in p.stdout
    assert "speedup: " in p.stdout


def test_cpp_example_exit_codes(kerneleval_service, cpp_example, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(BROKEN)
    p = subprocess.run(
        [str(cpp_example), str(broken)],
        env=_env(kerneleval_service),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verdict: VERDICT_COMPILE_ERROR" in p.stdout
    env = {**_env(kerneleval_service), "KERNELEVAL_ADDRESS": "127.0.0.1:1"}
    p = subprocess.run(
        [str(cpp_example), str(broken)], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 3 and "Evaluate failed: 14" in p.stderr
    p = subprocess.run([str(cpp_example)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "usage" in p.stderr


def test_cpp_example_sends_a_tenant_token(cpp_example: Path, tmp_path: Path) -> None:
    """The C++ example sends $KERNELEVAL_TENANT_TOKEN with its calls: against a service with
    --tenants-file it runs with one (the job is that tenant's) and fails UNAUTHENTICATED (16)
    without one or with a wrong one."""
    model = tmp_path / "model.py"
    model.write_text(MODEL)
    with tenants_service(tmp_path) as (svc, alice, _bob):
        runs = {
            name: subprocess.run(
                [str(cpp_example), str(model), str(model)],
                env=_env_of(svc, **({"KERNELEVAL_TENANT_TOKEN": token} if token else {})),
                capture_output=True,
                text=True,
                timeout=300,
            )
            for name, token in (("alice", alice), ("none", ""), ("wrong", alice[::-1]))
        }
        with Client(svc.address, tenant_token=alice) as c:
            mine = [j.job_id for j in c.list_jobs()]
    ok = runs["alice"]
    assert ok.returncode in (0, 1), ok.stdout + ok.stderr  # a verdict, whichever it is
    job_id = ok.stdout.splitlines()[0].split()[2]
    assert job_id in mine
    for name in ("none", "wrong"):
        p = runs[name]
        assert p.returncode == 3, (name, p.stdout, p.stderr)
        assert "\nEvaluate failed: 16 " in "\n" + p.stderr, (name, p.stderr)
