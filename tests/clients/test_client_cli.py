"""The `kerneleval` command against the fake server: results, exit codes, JSON, progress."""

from __future__ import annotations

import io
import json
import os
import pty
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_server import ADMIN_TOKEN, FakeServer, FakeState
from kerneleval import cli, progress, render
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2, kernel_pb2

KERNELEVAL = Path(sys.executable).parent / "kerneleval"
TRITON_FILE = """import torch
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
             mask=mask)
"""
IO_JSON = {
    "args": [
        {"name": "x", "tensor": {"shape": ["1000"], "dtype": "DTYPE_FLOAT32"}},
        {"name": "y", "tensor": {"shape": ["1000"], "dtype": "DTYPE_FLOAT32"}},
        {
            "name": "out",
            "role": "ARG_ROLE_OUTPUT",
            "tensor": {"shape": ["1000"], "dtype": "DTYPE_FLOAT32"},
        },
        {"name": "n", "intValue": "1000"},
        {"name": "BLOCK", "meta": True, "intValue": "256"},
    ],
    "launch": {"grid": {"x": 4}},
}


def run(fake: FakeServer, capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["--address", fake.address, "--timeout", "20", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def triton_file(tmp_path: Path) -> Path:
    p = tmp_path / "add_triton.py"
    p.write_text(TRITON_FILE)
    return p


def test_evaluate_prints_progress_and_a_result_table(fake, capsys, triton_file, tmp_path):
    io_file = tmp_path / "io.json"
    io_file.write_text(json.dumps(IO_JSON))
    code, out, err = run(
        fake, capsys, "evaluate", str(triton_file), "--io", str(io_file), "--perf-trials", "9"
    )
    assert code == 0, err
    assert "queued" in err and "validating 3/3" in err and "profiling 3/3" in err
    assert "verdict   OK" in out or "verdict    OK" in out
    assert "median 1.2500 ms" in out
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)][-1]
    assert sent.spec.kernel.type == kernel_pb2.KERNEL_TYPE_TRITON
    assert sent.spec.kernel.source_code == TRITON_FILE
    assert sent.spec.kernel.io.args[4].meta and sent.spec.kernel.io.launch.grid.x == 4
    assert sent.spec.options.perf_trial_count == 9
    assert not sent.spec.options.HasField("flush_l2")


def test_compare_json_and_exit_code_of_a_bad_verdict(fake, capsys, tmp_path, triton_file):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    code, out, _ = run(fake, capsys, "compare", str(ref), str(triton_file), "--json")
    assert code == 0
    [entry] = json.loads(out)  # one shape for one file or many: a list of {file, job}
    assert entry["file"] == str(triton_file)
    job = entry["job"]
    assert job["result"]["verdict"] == "VERDICT_OK" and job["result"]["speedup"] == 2.0
    bad = tmp_path / "bad.py"
    bad.write_text("# INCORRECT on purpose\nimport torch\n")
    code, out, err = run(fake, capsys, "evaluate", str(bad), "--no-flush-l2")
    assert code == cli.EXIT_VERDICT
    assert "INCORRECT" in out and "12 of 1024 elements differ" in out
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)][-1]
    assert sent.spec.options.HasField("flush_l2") and not sent.spec.options.flush_l2
    broken = tmp_path / "broken.py"
    broken.write_text("# COMPILE_ERROR\n")
    code, out, err = run(fake, capsys, "evaluate", str(broken))
    assert code == cli.EXIT_VERDICT and "expected ';'" in out and "| error" in err


def test_reject_flagged_reaches_the_options(fake, capsys, triton_file):
    code, _, err = run(fake, capsys, "evaluate", str(triton_file), "--reject-flagged")
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)][-1]
    assert sent.spec.options.reject_flagged
    code, _, err = run(fake, capsys, "evaluate", str(triton_file))
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)][-1]
    assert not sent.spec.options.reject_flagged


def test_no_check_precision_reaches_the_options(fake, capsys, triton_file):
    for args, has in ((["--no-check-precision"], True), ([], False)):
        run(fake, capsys, "evaluate", str(triton_file), *args)
        sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)]
        o = sent[-1].spec.options
        assert o.HasField("check_precision") == has and not o.check_precision


def test_compile_baseline_reaches_the_options(fake, capsys, triton_file):
    for args, wanted in ((["--compile-baseline"], True), ([], False)):
        run(fake, capsys, "evaluate", str(triton_file), *args)
        sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)]
        assert sent[-1].spec.options.compile_baseline == wanted


def test_device_model_reaches_the_options(fake, capsys, triton_file):
    for args, model in ((["--device-model", "H100"], "H100"), ([], "")):
        run(fake, capsys, "evaluate", str(triton_file), *args)
        sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)]
        assert sent[-1].spec.options.device_model == model


def test_no_cache_reaches_the_options(fake, capsys, triton_file):
    for args, bypass in ((["--no-cache"], True), ([], False)):
        run(fake, capsys, "evaluate", str(triton_file), *args)
        sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)]
        assert sent[-1].spec.options.bypass_cache is bypass


def test_invalid_argument_exit_code_and_field_violations(fake, capsys, tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("")
    code, _, err = run(fake, capsys, "evaluate", str(empty))
    assert code == cli.EXIT_SERVICE
    assert "INVALID_ARGUMENT" in err and "spec.kernel.source_code" in err


def test_usage_errors(fake, capsys, tmp_path):
    code, _, err = run(fake, capsys, "evaluate", str(tmp_path / "missing.py"))
    assert code == cli.EXIT_USAGE and "missing.py" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["evaluate"])
    assert e.value.code == 2


def test_detach_watch_get_cancel_and_jobs(fake, capsys, triton_file):
    code, out, _ = run(fake, capsys, "evaluate", str(triton_file), "--detach", "--tag", "cli")
    assert code == 0
    job_id = out.strip()
    code, out, err = run(fake, capsys, "watch", job_id)
    assert code == 0 and job_id in out and "OK" in out
    code, out, _ = run(fake, capsys, "watch", job_id, "--after", "3", "--json")
    assert json.loads(out)["jobId"] == job_id  # watch, get, cancel: the Job object
    code, out, _ = run(fake, capsys, "get", job_id)
    assert code == 0 and "verdict" in out
    code, out, _ = run(fake, capsys, "cancel", job_id)
    assert out.strip() == f"{job_id}: DONE"
    code, out, _ = run(fake, capsys, "jobs", "--tag", "cli")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["JOB", "STATE", "VERDICT"]
    assert any(job_id in ln and "DONE" in ln and "OK" in ln for ln in lines[2:])
    code, out, _ = run(fake, capsys, "jobs", "--state", "done", "--limit", "2", "--json")
    assert len(json.loads(out)) == 2
    code, _, err = run(fake, capsys, "get", "nope")
    assert code == cli.EXIT_SERVICE and "NOT_FOUND" in err


def test_operations_commands(fake, capsys, monkeypatch):
    code, _, err = run(fake, capsys, "devices")
    assert code == cli.EXIT_SERVICE and "admin token" in err
    monkeypatch.setenv("KERNELEVAL_ADMIN_TOKEN", ADMIN_TOKEN)
    code, out, _ = run(fake, capsys, "devices")
    assert code == 0
    assert "NVIDIA H200" in out and "UNHEALTHY: XID 79" in out and "31(restart_worker)" in out
    assert "1+1 spare" in out
    code, out, _ = run(fake, capsys, "events", "--replay", "2")
    assert "XID 31 (application) -> restart_worker" in out
    assert "worker w0 exited (poisoned_context" in out
    code, out, _ = run(fake, capsys, "events", "--json")
    assert [json.loads(line)["sequence"] for line in out.splitlines()] == ["1", "2"]
    code, out, _ = run(fake, capsys, "restart-workers", "--device", "0")
    assert code == 0 and out.strip() == "asked 2 worker(s) on gpu 0 to restart"
    code, out, _ = run(fake, capsys, "cleanup", "--older-than-hours", "2")
    assert code == 0 and out.startswith("deleted 7200 finished job(s)")  # the fake echoes seconds
    code, out, _ = run(fake, capsys, "stats")
    assert code == 0 and "faults           1" in out and "XIDs             1" in out
    assert "sandbox          complete" in out
    assert "timing, gpu 0    40 windows held 9.8 s of 10.0 s wanted" in out
    assert "watchdog warning (kmsg): cannot read /dev/kmsg (EACCES)" in out
    code, out, _ = run(fake, capsys, "stats", "--json")
    assert json.loads(out)["faultCount"] == "1"
    assert json.loads(out)["sandboxState"] == "SANDBOX_STATE_COMPLETE"
    code, out, _ = run(fake, capsys, "builders")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == [
        "BUILDER", "ADDRESS", "STATE", "SLOTS", "BUILDING", "WAITING", "BUILT", "LAST", "BEAT",
        "VERSIONS",
    ]  # fmt: skip
    live, lost = lines[2].split(), lines[3].split()
    assert live[:7] == ["cpu-1-builder-0a1b2c3d", "10.0.0.5:50051", "live", "6", "3", "2", "41"]
    assert live[7].startswith("2.") and live[8:] == ["ago", "yes"]  # 2 s since its last beat
    assert lost[:3] == ["cpu-2-builder-4e5f6a7b", "10.0.0.6:50051", "EXPIRED"]
    assert lost[7].startswith("5m0") and lost[8:] == ["ago", "differ"]
    assert "this server's versions: torch 2.13.0|cuda 13.0|" in out
    assert "  cpu-2-builder-4e5f6a7b builds with: torch 2.12.0|cuda 12.8|" in out
    code, out, _ = run(fake, capsys, "builders", "--json")
    listed = json.loads(out)
    assert [b["expired"] for b in listed["builders"]] == [False, True]
    assert listed["builders"][0]["leasedRequestCount"] == 3
    code, out, _ = run(fake, capsys, "reset-gpu", "0", "--yes", "--grace", "1")
    assert code == 0 and "check_health" in out and "healthy again" in out
    assert fake.state.reset_calls[-1] == 0


def test_reset_gpu_asks_first(fake, capsys, monkeypatch):
    calls = len(fake.state.reset_calls)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "no")
    code, _, err = run(fake, capsys, "--admin-token", ADMIN_TOKEN, "reset-gpu", "1")
    assert code == cli.EXIT_USAGE and "not reset" in err
    assert len(fake.state.reset_calls) == calls
    code, _, err = run(fake, capsys, "reset-gpu", "1", "--yes")
    assert code == cli.EXIT_USAGE and "admin-token" in err
    monkeypatch.setattr("builtins.input", lambda prompt: "yes")
    code, _, _ = run(fake, capsys, "--admin-token", ADMIN_TOKEN, "reset-gpu", "1")
    assert code == 0 and fake.state.reset_calls[-1] == 1


def test_live_progress_bars_on_a_tty(tmp_path, triton_file):
    """The installed command on a pseudo-terminal redraws one bar per phase."""
    server = FakeServer(FakeState(event_delay=0.02))
    try:
        # The plain display, as where rich is not installed.
        env = {**os.environ, "KERNELEVAL_ADDRESS": server.address, "KERNELEVAL_NO_RICH": "1"}
        primary, secondary = pty.openpty()
        proc = subprocess.Popen(
            [str(KERNELEVAL), "evaluate", str(triton_file)],
            stdin=secondary,
            stdout=secondary,
            stderr=secondary,
            env=env,
            close_fds=True,
        )
        os.close(secondary)
        chunks = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                data = os.read(primary, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=30) == 0
        os.close(primary)
        text = b"".join(chunks).decode()
        assert "\r\x1b[2K  validating [" in text
        assert "profiling  [########################] 3/3" in text
        assert "verdict" in text
    finally:
        server.stop()


def test_serve_without_the_server_package_says_so(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kerneleval_server.main", None)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"exec'd the server: {a}"))
    assert cli.main(["serve", "--port", "1"]) == cli.EXIT_USAGE
    assert "kerneleval-server" in capsys.readouterr().err


def test_doctor_without_a_gpu(fake, capsys, tmp_path, monkeypatch):
    """A full report with fake NVIDIA tools on PATH and the fake service's devices."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in --query-gpu*) echo "0, NVIDIA H200, 570.86, 143771 MiB, 31, 0 %, '
        '00000000:00:06.0";; *) echo "| NVIDIA-SMI 570.86  Driver Version: 570.86  '
        'CUDA Version: 12.8 |";; esac\n'
    )
    san = bin_dir / "compute-sanitizer"
    san.write_text("#!/bin/sh\necho 'NVIDIA (R) Compute Sanitizer'\necho 'Version 2025.1.0'\n")
    for p in (smi, san):
        p.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    crash = tmp_path / "crash.py"
    crash.write_text("# CRASH on purpose\nimport torch\n")
    code, _, err = run(fake, capsys, "evaluate", str(crash))
    assert code == cli.EXIT_VERDICT and "fault: worker w0 killed by SIGSEGV" in err
    code, out, _ = run(fake, capsys, "--admin-token", ADMIN_TOKEN, "doctor")
    assert code == 0
    assert "## nvidia-smi" in out and "0, NVIDIA H200, 570.86" in out
    assert "driver/CUDA: NVIDIA-SMI 570.86 Driver Version: 570.86 CUDA Version: 12.8" in out
    assert "compute-sanitizer: " in out and "Version 2025.1.0" in out
    assert "## torch and triton (child process)" in out and "triton: " in out
    assert f"## service at {fake.address}" in out and "health: SERVING" in out
    assert "recent XID on 0: 31 (application) -> restart_worker" in out
    assert "faults in the last 200 jobs: 1" in out
    assert "CRASHED" in out and "killed by SIGSEGV" in out
    assert "sandbox: complete" in out and "MISSING" not in out
    assert "watchdog warning (kmsg): cannot read /dev/kmsg (EACCES)" in out
    from kerneleval import doctor

    monkeypatch.setattr(doctor, "check_python_stack", lambda r: r.section("torch").add("x", "y"))
    code, out, _ = run(fake, capsys, "doctor", "--json")
    report = json.loads(out)
    assert "devices: skipped" in " ".join(report[f"service at {fake.address}"])
    assert "sandbox: skipped" in " ".join(report[f"service at {fake.address}"])


def test_doctor_with_nothing_reachable(capsys, monkeypatch, tmp_path):
    from kerneleval import doctor

    monkeypatch.setattr(doctor, "check_python_stack", lambda r: r.section("torch").add("x", "y"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no tools at all
    code = cli.main(["--address", "127.0.0.1:1", "doctor", "--service-timeout", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "nvidia-smi: not found" in out and "ncu: not found" in out
    assert "health: unreachable (UNAVAILABLE" in out


def test_tls_with_a_ca_file(tmp_path, capsys, triton_file):
    """--tls-ca reaches a TLS server whose certificate that CA signed (self-signed here)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    from concurrent import futures

    import grpc
    from fake_server import FakeEvalService
    from kerneleval.v1 import kernel_eval_service_pb2_grpc

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    kernel_eval_service_pb2_grpc.add_KernelEvalServiceServicer_to_server(
        FakeEvalService(FakeState()), server
    )
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        code = cli.main(
            [
                "--address",
                address,
                "--tls-ca",
                str(cert),
                "--timeout",
                "20",
                "evaluate",
                str(triton_file),
            ]
        )
        assert code == 0, capsys.readouterr().err
        code = cli.main(["--address", address, "--timeout", "5", "evaluate", str(triton_file)])
        assert code == cli.EXIT_SERVICE  # plaintext to a TLS port
    finally:
        server.stop(None)


def test_serve_hands_its_arguments_to_the_server():
    p = subprocess.run(
        [str(KERNELEVAL), "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0
    assert "usage: kerneleval serve" in p.stdout and "--state-dir" in p.stdout


def test_several_files_run_as_one_batch(fake, capsys, tmp_path, triton_file):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    bad = tmp_path / "bad.py"
    bad.write_text("# INCORRECT on purpose\nimport torch\n")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    files = [str(triton_file), str(bad), str(empty)]
    code, out, err = run(fake, capsys, "compare", str(ref), *files, "--max-in-flight", "2")
    assert code == cli.EXIT_VERDICT
    assert err.count("[") >= 3 and "/3] " in err
    lines = out.splitlines()
    assert lines[0].split() == ["FILE", "JOB", "VERDICT", "MEDIAN", "MS", "SPEEDUP", "DETAIL"]
    rows = {ln.split()[0]: ln for ln in lines[2:]}
    assert "OK" in rows[str(triton_file)] and "2x" in rows[str(triton_file)]
    assert "INCORRECT" in rows[str(bad)] and "12 of 1024 elements differ" in rows[str(bad)]
    assert "REFUSED" in rows[str(empty)] and "spec.kernel.source_code" in rows[str(empty)]
    batch = [
        r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunBatchRequest)
    ]
    # Tagged by position, so that the same file twice is two submissions.
    assert [r.request_tag for r in batch[-3:]] == ["0", "1", "2"]
    assert [r.spec.kernel.source_code for r in batch[-3:]] == [Path(f).read_text() for f in files]
    assert all(r.spec.reference.source_code for r in batch[-3:])
    code, out, _ = run(fake, capsys, "evaluate", str(triton_file), str(triton_file), "--json")
    both = json.loads(out)
    assert code == 0 and [e["job"]["result"]["verdict"] for e in both] == ["VERDICT_OK"] * 2
    # The same file twice: two jobs, two results, none lost.
    assert [e["file"] for e in both] == [str(triton_file)] * 2
    assert both[0]["job"]["jobId"] != both[1]["job"]["jobId"]
    code, out, _ = run(fake, capsys, "evaluate", str(triton_file), str(triton_file))
    rows = [ln for ln in out.splitlines()[2:] if ln.startswith(str(triton_file))]
    assert len(rows) == 2 and rows[0].split()[1] != rows[1].split()[1]
    assert all(r.split()[2] == "OK" for r in rows)


# --- a CLI that fits a terminal ------------------------------------------------------------


def test_global_options_go_before_or_after_the_command(fake, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("KERNELEVAL_ADMIN_TOKEN", raising=False)
    for args in (
        ["--server", fake.address, "--admin-token", ADMIN_TOKEN, "devices"],
        ["devices", "--server", fake.address, "--admin-token", ADMIN_TOKEN],
        ["devices", "--address", fake.address, f"--admin-token={ADMIN_TOKEN}", "--json"],
    ):
        assert cli.main(args) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert "NVIDIA H200" in out
    assert json.loads(out)[0]["name"] == "NVIDIA H200"  # --json after the command too
    token_file = tmp_path / "admin_token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    assert cli.main(["stats", "--server", fake.address, "--admin-token-file", str(token_file)]) == 0
    assert "uptime" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [
        ["devices", "--admin-token", "tok-9f8e7d", "--bogus"],
        ["--admin-token=tok-9f8e7d", "devices", "extra"],
        ["--admin-token", "tok-9f8e7d", "no-such-command"],
    ],
)
def test_a_usage_error_never_prints_the_admin_token(capsys, args):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == cli.EXIT_USAGE and "error:" in err
    assert "tok-9f8e7d" not in err


def test_json_has_every_field_even_false_and_zero(fake, capsys, tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    bad = tmp_path / "bad.py"
    bad.write_text("# INCORRECT on purpose\nimport torch\n")
    broken = tmp_path / "broken.py"
    broken.write_text("# COMPILE_ERROR\n")
    code, out, _ = run(fake, capsys, "compare", str(ref), str(bad), "--json")
    [entry] = json.loads(out)
    result = entry["job"]["result"]
    assert code == cli.EXIT_VERDICT and result["correctness"] is False
    assert result["speedup"] == 0 and result["flags"] == []
    code, out, _ = run(fake, capsys, "compare", str(ref), str(broken), str(bad), "--json")
    entries = json.loads(out)
    assert [e["file"] for e in entries] == [str(broken), str(bad)]
    assert entries[0]["job"]["result"]["compiled"] is False
    code, out, _ = run(fake, capsys, "get", entries[0]["job"]["jobId"], "--json")
    assert json.loads(out)["result"]["compiled"] is False


def test_jsonl_streams_every_event(fake, capsys, triton_file):
    code, out, err = run(fake, capsys, "evaluate", str(triton_file), "--jsonl")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and err == ""
    assert {e["file"] for e in lines} == {str(triton_file)}
    kinds = [next(k for k in ("queued", "started", "phase", "progress", "finished")
                  if k in e["event"]) for e in lines]  # fmt: skip
    assert kinds[0] == "queued" and kinds[-1] == "finished" and "progress" in kinds
    job_id = lines[0]["event"]["jobId"]
    code, out, _ = run(fake, capsys, "watch", job_id, "--jsonl")
    events = [json.loads(line) for line in out.splitlines()]
    assert [int(e["sequence"]) for e in events] == list(range(1, len(lines) + 1))
    assert events[-1]["finished"]["result"]["verdict"] == "VERDICT_OK"


def test_source_from_stdin(fake, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "stdin", io.StringIO(TRITON_FILE))
    ref = tmp_path / "ref.py"
    ref.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    code, out, _ = run(fake, capsys, "compare", str(ref), "-", "--json")
    assert code == 0 and json.loads(out)[0]["file"] == "-"
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)][-1]
    assert sent.spec.kernel.source_code == TRITON_FILE
    assert sent.spec.kernel.type == kernel_pb2.KERNEL_TYPE_TRITON


def test_version_and_help_with_examples(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("kerneleval 0.")
    text = cli.build_parser().format_help()
    assert "examples:" in text and "kerneleval kernelbench" in text
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--help"])
    text = capsys.readouterr().out
    for needle in ("absolute tolerance", "relative tolerance", "seed of inputs", "examples:",
                   "--admin-token", "--preset"):  # fmt: skip
        assert needle in text


def test_kernelbench_preset_and_overrides(fake, capsys, triton_file):
    run(fake, capsys, "evaluate", str(triton_file), "--preset", "kernelbench", "--seed", "7")
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)][-1]
    o = sent.spec.options
    assert (o.correct_trial_count, o.perf_trial_count, o.warmup_count) == (1, 10, 3)
    assert o.atol == o.rtol == 1e-4 and o.seed == 7 and o.flush_l2


def test_stats_prints_uptime_in_minutes_and_seconds():
    assert render.fmt_duration(297.75707) == "4m57s"
    assert render.fmt_duration(3725) == "1h02m"
    assert render.fmt_duration(0.75) == "0.8s"
    assert render.fmt_duration(2 * 86400 + 4 * 3600) == "2d04h"


def test_tables_fit_the_terminal_and_colour_follows_no_color(fake, capsys, monkeypatch, tmp_path):
    deep = tmp_path / ("a_rather_long_folder_name_" * 3)
    deep.mkdir()
    files = []
    for name in ("first_kernel_with_a_long_name.py", "second_kernel_with_a_long_name.py"):
        (deep / name).write_text(TRITON_FILE)
        files.append(str(deep / name))
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, out, _ = run(fake, capsys, "evaluate", *files, "--color", "always")
    lines = out.splitlines()
    assert code == 0 and "\x1b[32mOK\x1b[0m" in out
    plain = [ln.replace("\x1b[32m", "").replace("\x1b[0m", "") for ln in lines]
    assert all(len(ln) <= 80 for ln in plain), plain
    assert any(ln.split()[0].endswith("name.py") for ln in plain[2:])  # the path's tail kept
    monkeypatch.setenv("NO_COLOR", "1")
    code, out, _ = run(fake, capsys, "evaluate", *files)
    assert "\x1b[" not in out
    monkeypatch.delenv("COLUMNS")
    code, out, _ = run(fake, capsys, "evaluate", *files)  # not a terminal: nothing shortened
    assert all(f in out for f in files)


def test_table_shortens_ids_paths_and_text():
    cols = [render.Column("JOB", "id"), render.Column("FILE", "path"), "STATE",
            render.Column("DETAIL", "text")]  # fmt: skip
    row = ["0123456789abcdef0123456789abcdef", "/very/long/path/to/level1/19_ReLU.py", "DONE",
           "a long explanation of what went wrong in this kernel"]  # fmt: skip
    text = render.table(cols, [row], width=60)
    line = text.splitlines()[2]
    assert len(line) <= 60 and line.split()[2] == "DONE"
    assert line.split()[0].startswith("012345") and line.split()[0].endswith("cdef")
    assert line.split()[1].endswith("19_ReLU.py")
    assert render.table(cols, [row]).splitlines()[2].split()[0] == row[0]


class Recorder:
    """A Display that records what it is asked to show."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.bars: list[tuple[str, int, int]] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def update(self, meter: progress.Meter) -> None:
        self.bars.append((meter.label, meter.done, meter.total))

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_profiling_bars_count_the_real_trials():
    """A job run whole in one process counts a candidate's and its reference's timed trials
    as one series of 2n: shown as n for the kernel, then n for the reference."""
    rec = Recorder()
    view = progress.JobView(rec, has_reference=True, trials=10)
    view.event(job_pb2.JobEvent(phase=job_pb2.JobPhase(phase=job_pb2.PHASE_PROFILING)))
    for done in (5, 10, 15, 20):
        view.event(job_pb2.JobEvent(progress=job_pb2.JobProgress(
            phase=job_pb2.PHASE_PROFILING, done_count=done, total_count=20)))  # fmt: skip
    assert rec.bars[1:] == [
        ("profiling kernel", 5, 10),
        ("profiling kernel", 10, 10),
        ("profiling reference", 5, 10),
        ("profiling reference", 10, 10),
    ]
    rec = Recorder()
    view = progress.JobView(rec, has_reference=False)
    view.event(job_pb2.JobEvent(progress=job_pb2.JobProgress(
        phase=job_pb2.PHASE_PROFILING, done_count=3, total_count=5)))  # fmt: skip
    assert rec.bars == [("profiling", 3, 5)]


def test_a_judged_job_shows_each_phase_once_in_the_terminal_and_in_jsonl(fake, capsys, tmp_path):
    """The kernel's process and then its judge each send compiling, validating and profiling:
    one bar each, the judge's timing the reference's."""
    ref = tmp_path / "ref.py"
    ref.write_text("import torch\nclass Model(torch.nn.Module):\n    pass\n")
    kernel = tmp_path / "k.py"
    kernel.write_text("# JUDGED\nimport torch\nclass ModelNew(torch.nn.Module):\n    pass\n")
    code, _, err = run(fake, capsys, "compare", str(ref), str(kernel), "--perf-trials", "3")
    assert code == 0, err
    shown = [ln.split()[:2] for ln in err.splitlines() if ln.startswith("  ")]
    assert shown == [
        ["waiting", "in"],
        ["compiling"],
        ["validating"], ["validating", "3/3"],
        ["profiling", "kernel"], ["profiling", "kernel"],  # "3/3 ..." on the line's end
        ["profiling", "reference"], ["profiling", "reference"],
    ], err  # fmt: skip
    assert "profiling kernel 3/3" in err and "profiling reference 3/3" in err
    code, out, _ = run(fake, capsys, "compare", str(ref), str(kernel), "--perf-trials", "3",
                       "--jsonl")  # fmt: skip
    lines = [json.loads(line) for line in out.splitlines()]
    bars = [(b["label"], b["done"], b["total"]) for e in lines for b in e.get("bars", [])]
    assert bars == [
        ("compiling", 0, 0),
        ("validating", 0, 0), ("validating", 1, 3), ("validating", 2, 3), ("validating", 3, 3),
        ("profiling kernel", 0, 0), ("profiling kernel", 1, 3), ("profiling kernel", 2, 3),
        ("profiling kernel", 3, 3),
        ("profiling reference", 0, 0), ("profiling reference", 1, 3),
        ("profiling reference", 2, 3), ("profiling reference", 3, 3),
    ]  # fmt: skip
    # Every event is still there: the judge's phases too, without a bar of their own.
    phases = [e["event"]["phase"]["phase"] for e in lines if "phase" in e["event"]]
    assert phases.count("PHASE_VALIDATING") == 2 and phases.count("PHASE_COMPILING") == 2


def test_meter_rate_and_eta():
    m = progress.Meter("validating", done=5, total=20, started=100.0)
    assert m.rate(110.0) == 0.5 and m.eta(110.0) == 30.0
    assert m.stats(110.0) == "5/20  0.5/s  ETA 30s  10s"
    assert progress.Meter("compiling", started=100.0).stats(112.5) == "12s"


def test_log_display_says_where_it_stands_during_a_long_wait():
    out = io.StringIO()
    display = progress.LogDisplay(out, heartbeat=0.2)
    try:
        display.update(progress.Meter("profiling", done=3, total=10))
        time.sleep(0.7)
    finally:
        display.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "  profiling"
    assert len(lines) >= 2 and all(ln.startswith("  profiling 3/10") for ln in lines[1:])


def test_a_dropped_stream_is_re_attached_and_said_so(capsys, triton_file):
    state = FakeState(event_delay=0.01)
    server = FakeServer(state)
    try:
        state.drop_after = 4  # the Run stream breaks after 4 events
        code = cli.main(["--server", server.address, "evaluate", str(triton_file)])
        err = capsys.readouterr().err
        assert code == 0, err
        assert "lost the stream of job job-0001 after event #4" in err
        assert "re-attached to job job-0001 at event #5" in err
    finally:
        server.stop()


def test_watch_follows_a_job_across_a_service_restart(capsys, monkeypatch, triton_file):
    """The client re-attaches (the CLI only says so): the server goes away mid-job and comes
    back on the same port; the job's every event is shown once and its result decides."""
    state = FakeState(event_delay=0.05)
    server = FakeServer(state)
    try:
        from kerneleval.client import Client

        with Client(server.address) as c:
            kernel = kernel_pb2.KernelSource(
                source_code=triton_file.read_text(), type=kernel_pb2.KERNEL_TYPE_TRITON
            )
            job = c.submit(kernel_pb2.JobSpec(kernel=kernel))
        real = progress.JobView.event
        seen: list[int] = []

        def bounce_after_three(self, event):  # type: ignore[no-untyped-def]
            real(self, event)
            seen.append(event.sequence)
            if len(seen) == 3:
                server.stop()
                time.sleep(0.7)  # past the client's quiet wait: it says it waits
                server.start()

        monkeypatch.setattr(progress.JobView, "event", bounce_after_three)
        code = cli.main(["--server", server.address, "--jsonl", "watch", job.job_id])
        out, err = capsys.readouterr()
        assert code == cli.EXIT_OK, err
        assert seen == list(range(1, len(seen) + 1)) and len(seen) > 3
        assert [int(json.loads(line)["sequence"]) for line in out.splitlines()] == seen
        assert f"lost the stream of job {job.job_id} after event #3" in err
        assert f"re-attached to job {job.job_id} at event #4" in err
    finally:
        server.stop()


def test_watch_says_it_waits_for_a_server_that_is_down(capsys):
    started = time.monotonic()
    code = cli.main(["--server", "127.0.0.1:1", "--reconnect-timeout", "1.5", "watch", "job-x"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_SERVICE
    assert "waiting for the server at 127.0.0.1:1" in err and "did not answer" in err
    assert time.monotonic() - started < 20


def test_ctrl_c_cancels_the_job_and_says_so(capsys, monkeypatch, triton_file):
    state = FakeState(event_delay=0.05)
    server = FakeServer(state)
    real = progress.JobView.event

    def interrupt_once_started(self, event):
        real(self, event)
        if event.HasField("started"):
            raise KeyboardInterrupt

    monkeypatch.setattr(progress.JobView, "event", interrupt_once_started)
    try:
        code = cli.main(["--server", server.address, "evaluate", str(triton_file)])
        err = capsys.readouterr().err
        assert code == cli.EXIT_INTERRUPTED
        assert "interrupted: cancelled job job-0001 (CANCELLED)" in err
        assert state.jobs["job-0001"].job.state == job_pb2.JOB_STATE_CANCELLED
    finally:
        server.stop()


def test_live_progress_with_rich_on_a_tty(tmp_path, triton_file):
    pytest.importorskip("rich")
    server = FakeServer(FakeState(event_delay=0.02))
    try:
        env = {**os.environ, "KERNELEVAL_ADDRESS": server.address, "COLUMNS": "100"}
        env.pop("KERNELEVAL_NO_RICH", None)
        env.pop("NO_COLOR", None)
        primary, secondary = pty.openpty()
        proc = subprocess.Popen(
            [str(KERNELEVAL), "evaluate", str(triton_file)],
            stdin=secondary, stdout=secondary, stderr=secondary, env=env, close_fds=True,
        )  # fmt: skip
        os.close(secondary)
        chunks = []
        while True:
            try:
                data = os.read(primary, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=30) == 0
        os.close(primary)
        text = b"".join(chunks).decode()
        assert "validating" in text and "3/3" in text and "━" in text  # rich's bar
        table = text.rsplit("\x1b[?25h", 1)[1]  # after rich gave the cursor back
        assert "verdict" in table and "\x1b[32mOK" in table
    finally:
        server.stop()


# -- clear first errors -------------------------------------------------------------------


def usage_error(capsys, *args: str) -> str:  # type: ignore[no-untyped-def]
    """argparse's error for `args` (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(args))
    assert e.value.code == cli.EXIT_USAGE
    return capsys.readouterr().err


def test_mistyped_commands_and_options_get_a_suggestion(capsys):
    err = usage_error(capsys, "evalute", "k.py")
    assert "invalid choice: 'evalute'" in err and "did you mean 'evaluate'?" in err
    err = usage_error(capsys, "evaluate", "k.py", "--perf-trails", "5")
    assert "--perf-trails: did you mean --perf-trials?" in err
    err = usage_error(capsys, "gpumode", "task", "--colr=never")
    assert "--colr: did you mean --color?" in err
    err = usage_error(capsys, "evaluate", "k.py", "--zzzzzz")
    assert "did you mean" not in err  # nothing close: nothing made up


def test_a_missing_file_names_its_role(fake, capsys, tmp_path, triton_file):
    code, _, err = run(fake, capsys, "compare", str(tmp_path / "nope.py"), str(triton_file))
    assert (
        code == cli.EXIT_USAGE
        and f"the reference file {tmp_path / 'nope.py'} does not exist" in err
    )
    code, _, err = run(fake, capsys, "compare", str(triton_file), str(tmp_path / "k.py"))
    assert code == cli.EXIT_USAGE and "the kernel file" in err and "k.py does not exist" in err
    code, _, err = run(
        fake, capsys, "evaluate", str(triton_file), "--io", str(tmp_path / "io.json")
    )
    assert code == cli.EXIT_USAGE and "the --io file" in err and "io.json does not exist" in err
    code, _, err = run(fake, capsys, "evaluate", str(triton_file), "--io", '{"args": 3}')
    assert code == cli.EXIT_USAGE and "--io is not an IOContract" in err
    code, _, err = run(fake, capsys, "evaluate", str(tmp_path))
    assert code == cli.EXIT_USAGE and "is a folder, not a file" in err


def test_a_bare_triton_file_without_io_is_told_about_io_once(fake, capsys, tmp_path):
    bare = tmp_path / "bare.py"
    bare.write_text("# REFUSE_WITHOUT_IO\n" + TRITON_FILE)
    code, _, err = run(fake, capsys, "evaluate", str(bare))
    assert code == cli.EXIT_SERVICE
    assert err.count("a TRITON source without a ModelNew class") == 1, err
    assert "--io JSON|FILE gives the kernel's IOContract" in err
    code, out, _ = run(fake, capsys, "evaluate", str(bare), str(bare), "--json")  # a batch
    (first, _) = json.loads(out)
    assert first["error"].count("a TRITON source without a ModelNew class") == 1, first
    assert first["error"].endswith("(--io JSON|FILE gives the kernel's IOContract)")


def test_a_host_without_a_port_dials_the_services_port():
    from kerneleval.client import Client, resolve_address

    assert resolve_address("gpu-host") == "gpu-host:50051"
    assert resolve_address("gpu-host:7000") == "gpu-host:7000"
    assert resolve_address("[::1]") == "[::1]:50051" and resolve_address("::1") == "[::1]:50051"
    assert resolve_address("dns:///gpu-host") == "dns:///gpu-host:50051"
    assert resolve_address("unix:/run/ke.sock") == "unix:/run/ke.sock"
    assert resolve_address("ipv4:10.0.0.1:80,10.0.0.2:80") == "ipv4:10.0.0.1:80,10.0.0.2:80"
    with Client("localhost") as c:
        assert c.address == "localhost:50051"


def test_the_cli_reaches_a_server_named_without_its_port(fake, capsys, monkeypatch):
    """`--server HOST` dials the service's port: a fake listening on it answers."""
    from kerneleval import client as client_mod

    port = int(fake.address.rsplit(":", 1)[1])
    monkeypatch.setattr(client_mod, "DEFAULT_PORT", port)
    code = cli.main(["--server", "127.0.0.1", "--timeout", "20", "jobs"])
    assert code == cli.EXIT_OK, capsys.readouterr().err


def test_a_missing_admin_token_says_where_the_right_one_is(fake, capsys, monkeypatch):
    monkeypatch.delenv("KERNELEVAL_ADMIN_TOKEN", raising=False)
    code, _, err = run(fake, capsys, "devices")
    assert code == cli.EXIT_SERVICE and "no admin token was given" in err
    assert "--admin-token-file STATE_DIR/admin_token" in err
    code, _, err = run(fake, capsys, "devices", "--admin-token", "wrong")
    assert code == cli.EXIT_SERVICE and "no admin token was given" not in err
