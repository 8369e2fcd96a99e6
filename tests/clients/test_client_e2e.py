"""The Python client and the CLI against the real service (workers on the CPU, Triton under
its interpreter), through the shared session-scoped `kerneleval_service`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kerneleval import cli, contracts, errors
from kerneleval.client import Client
from kerneleval.kernelbench import job_from_files, kernel_source
from kerneleval.v1 import job_pb2, kernel_pb2

KERNELEVAL = Path(sys.executable).parent / "kerneleval"

# A Triton kernel launched from its IOContract (see TRITON_IO).
TRITON_ADD = """import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)
"""
N = 1000
TRITON_IO = contracts.io(
    contracts.tensor("x", N),
    contracts.tensor("y", N),
    contracts.output("out", N),
    contracts.scalar("n", N),
    contracts.constexpr("BLOCK", 256),
    grid=(4,),
)
TORCH_REF = """import torch


class Model(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def get_inputs():
    return [torch.randn(1000), torch.randn(1000)]


def get_init_inputs():
    return []
"""
# A KernelBench-style generated file: ModelNew wrapping a Triton kernel, CPU-friendly inputs.
TRITON_MODEL_NEW = (
    TRITON_ADD
    + """
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x, y):
        out = torch.empty_like(x)
        n = x.numel()
        add_kernel[(triton.cdiv(n, 256),)](x, y, out, n, BLOCK=256)
        return out


def get_inputs():
    return [torch.randn(1000), torch.randn(1000)]


def get_init_inputs():
    return []
"""
)
FAST = kernel_pb2.EvalOptions(correct_trial_count=2, perf_trial_count=5, warmup_count=1)


@pytest.fixture(scope="module")
def svc(kerneleval_service):
    return kerneleval_service


@pytest.fixture(scope="module")
def client(svc):
    with Client(svc.address, timeout=240, admin_token=svc.admin_token) as c:
        yield c


def cli_env(svc) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KERNELEVAL_ADMIN_TOKEN"}
    env["KERNELEVAL_ADDRESS"] = svc.address
    return env


def test_cli_evaluates_a_triton_file_with_progress_and_table(svc, tmp_path):
    kernel = tmp_path / "add_triton.py"
    kernel.write_text(TRITON_ADD)
    io_file = tmp_path / "io.json"
    io_file.write_text(json.dumps(_io_json(TRITON_IO)))
    p = subprocess.run(
        [
            str(KERNELEVAL),
            "--timeout",
            "240",
            "evaluate",
            str(kernel),
            "--io",
            str(io_file),
            "--correct-trials",
            "2",
            "--perf-trials",
            "5",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        env=cli_env(svc),
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "queued" in p.stderr and "compiling" in p.stderr and "validating" in p.stderr
    assert "verdict" in p.stdout and "OK" in p.stdout and "median" in p.stdout


def _io_json(io: kernel_pb2.IOContract) -> dict:
    from google.protobuf import json_format

    return json_format.MessageToDict(io)


def test_client_compares_a_kernelbench_style_triton_model(client, tmp_path):
    new = tmp_path / "model_new.py"
    new.write_text(TRITON_MODEL_NEW)
    ref = tmp_path / "model.py"
    ref.write_text(TORCH_REF)
    spec = job_from_files(new, ref, options=FAST, client_tag="clients-e2e")
    assert spec.kernel.type == kernel_pb2.KERNEL_TYPE_TRITON
    events = list(client.run(spec))
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    job = events[-1].finished
    assert job.state == job_pb2.JOB_STATE_DONE, job
    assert job.result.verdict == job_pb2.VERDICT_OK, job.result
    assert job.result.correctness and job.result.speedup > 0
    replay = list(client.watch(job.job_id, after_sequence=2))
    assert [e.sequence for e in replay] == [e.sequence for e in events[2:]]
    assert client.get_job(job.job_id).result.verdict == job_pb2.VERDICT_OK
    listed = list(client.list_jobs(client_tag="clients-e2e", page_size=1))
    assert job.job_id in {j.job_id for j in listed}


def test_client_errors_are_typed(client):
    bad = kernel_pb2.JobSpec(kernel=kernel_source(TRITON_ADD, io=TRITON_IO))
    bad.kernel.io.args[0].tensor.shape[0] = -1
    with pytest.raises(errors.InvalidArgument) as info:
        client.evaluate(bad)
    assert any("args[0].tensor.shape" in v.field for v in info.value.field_violations)
    with pytest.raises(errors.NotFound):
        client.get_job("no-such-job")
    with Client(client.address, timeout=30, admin_token="wrong") as c:
        with pytest.raises(errors.Unauthenticated):
            c.list_devices()


def test_run_batch_and_operations(client):
    good = kernel_pb2.JobSpec(kernel=kernel_source(TRITON_ADD, io=TRITON_IO), options=FAST)
    bad = kernel_pb2.JobSpec()
    done: dict[str, job_pb2.Job] = {}
    refused = []
    for out in client.run_batch([("a", good), ("b", good), ("bad", bad)], max_in_flight=2):
        if out.error is not None:
            refused.append(out.request_tag)
        elif out.done:
            assert out.event is not None
            done[out.request_tag] = out.event.finished
    assert refused == ["bad"]
    assert {t: j.result.verdict for t, j in done.items()} == {
        "a": job_pb2.VERDICT_OK,
        "b": job_pb2.VERDICT_OK,
    }
    devices = client.list_devices()
    assert devices and all(d.name for d in devices)
    assert client.health() == "SERVING"
    stats = client.get_stats()
    assert stats.jobs_by_state


def test_cli_devices_and_jobs(svc):
    env = cli_env(svc)
    p = subprocess.run(
        [str(KERNELEVAL), "--admin-token", svc.admin_token, "devices"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[0].split()[:3] == ["GPU", "NAME", "HEALTH"], p.stdout
    admin = [str(KERNELEVAL), "--admin-token", svc.admin_token]
    p = subprocess.run([*admin, "stats"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "queue depth" in p.stdout, p.stdout + p.stderr
    p = subprocess.run(
        [*admin, "cleanup", "--older-than-hours", "1000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout.startswith("deleted 0 finished job(s)"), (
        p.stdout + p.stderr
    )
    p = subprocess.run(
        [str(KERNELEVAL), "jobs", "--limit", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == 0 and "JOB" in p.stdout, p.stdout + p.stderr


def test_kerneleval_serve_starts_a_working_server(tmp_path):
    """`kerneleval serve` (what `make serve` runs) starts the real service."""
    watchdog = Path(__file__).resolve().parents[2] / "build" / "watchdog" / "kerneleval-watchdog"
    if not watchdog.exists():
        pytest.skip("the watchdog is not built")
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k != "KERNELEVAL_ADMIN_TOKEN"}
    env["KERNELEVAL_WATCHDOG"] = str(watchdog)
    proc = subprocess.Popen(
        [
            str(KERNELEVAL),
            "serve",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--state-dir",
            str(tmp_path / "state"),
            "--workers-per-device",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        with Client(f"127.0.0.1:{int(port_file.read_text())}", timeout=5) as c:
            while True:
                try:
                    if c.health() == "SERVING":
                        break
                except errors.Unavailable:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert list(c.list_jobs()) == []
        # In an interpreter of its own, which loads gRPC after the server has set what gRPC
        # reads as it loads (tests/frontend/test_grpc_settings.py).
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:4] == [b"-c", cli.SERVE.encode(), b"serve"], cmdline
    finally:
        proc.terminate()
        assert proc.wait(60) == 0


def test_unix_socket_address(svc):
    if not getattr(svc, "unix_socket", ""):
        pytest.skip("the shared service has no unix socket")
    address = f"unix:{svc.unix_socket}"
    with Client(address, timeout=30) as c:
        assert c.health() == "SERVING"
    p = subprocess.run(
        [str(KERNELEVAL), "--address", address, "jobs", "--limit", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout.startswith("JOB"), p.stderr


def test_cli_compares_several_files_in_one_batch(svc, tmp_path):
    ref = tmp_path / "model.py"
    ref.write_text(TORCH_REF)
    good = tmp_path / "model_new.py"
    good.write_text(TRITON_MODEL_NEW)
    broken = tmp_path / "model_new_broken.py"
    broken.write_text(TRITON_MODEL_NEW.replace("class ModelNew", "class ModelNew("))
    p = subprocess.run(
        [
            str(KERNELEVAL),
            "--timeout",
            "240",
            "compare",
            str(ref),
            str(good),
            str(broken),
            "--perf-trials",
            "5",
            "--warmup",
            "1",
            "--correct-trials",
            "2",
        ],
        capture_output=True,
        text=True,
        env=cli_env(svc),
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    rows = {ln.split()[0]: ln.split()[2] for ln in p.stdout.splitlines()[2:]}
    assert rows == {str(good): "OK", str(broken): "COMPILE_ERROR"}, p.stdout
