"""The clients on the GPU machine, for the docs and as a check.

Starts `python -m kerneleval_server serve` (real NVML, one GPU, a reset command that only
records its calls), then:
  1. `kerneleval doctor` without and with the service (the reports for docs/CLIENTS.md);
  2. `kerneleval compare` on KernelBench's example pairs (Triton, load_inline), as files;
  3. a planted illegal-address Triton kernel through the Python client's `run` (its events and
     verdict), the next job on the same GPU, `kerneleval devices` and `kerneleval events`;
  4. the C++ and Node examples, when built here (build/clients-cpp, clients/node/node_modules).

  python tests/clients/gpu_clients_check.py --out DIR
  python tests/clients/gpu_clients_check.py --out DIR --cpu-smoke   # here, without a GPU

Writes to DIR: doctor_gpu.md, doctor_gpu_service.md, cli_<pair>.txt, cli_<pair>.json,
fault_events.txt, devices_after_fault.txt, events.txt, cpp_example.txt, node_example.txt,
gpu_clients_summary.json (each step: ok, what was seen). Exit code 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "clients" / "python" / "src"), str(REPO / "server")]

from kerneleval import errors  # noqa: E402
from kerneleval.client import Client  # noqa: E402
from kerneleval.kernelbench import kernel_source  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

KERNELBENCH = next(
    (
        p
        for p in (
            Path(os.environ.get("KERNELBENCH_DIR", "/nonexistent")),
            REPO / "shared" / "kernelbench",
            REPO.parent / "shared" / "kernelbench",
        )
        if (p / "examples").is_dir()
    ),
    REPO.parent / "shared" / "kernelbench",
)
PAIRS = {
    "add_triton": ("model_ex_add.py", "model_new_ex_add_triton.py"),
    "add_cuda": ("model_ex_add.py", "model_new_ex_add.py"),
    "fuse_gelu_cuda": ("model_ex_fuse_gelu.py", "model_new_ex_fuse_gelu.py"),
    "tiled_matmul_cuda": ("model_ex_tiled_matmul.py", "model_new_ex_tiled_matmul.py"),
}
TRITON_OOB = """import torch
import triton
import triton.language as tl


@triton.jit
def oob_store(x_ptr, n):
    offs = tl.arange(0, 1024)
    tl.store(x_ptr + offs + (1 << 40), tl.zeros((1024,), dtype=tl.float32))


class ModelNew(torch.nn.Module):
    def forward(self, x):
        oob_store[(1,)](x, x.numel())
        return x


def get_inputs():
    return [torch.zeros(16, device="cuda" if torch.cuda.is_available() else "cpu")]


def get_init_inputs():
    return []
"""
GOOD = """import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0


def get_inputs():
    return [torch.randn(4096, device="cuda" if torch.cuda.is_available() else "cpu")]


def get_init_inputs():
    return []
"""
FAST = kernel_pb2.EvalOptions(correct_trial_count=3, perf_trial_count=20, warmup_count=3)


class Check:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.steps: dict[str, dict[str, Any]] = {}

    def record(self, name: str, ok: bool, **seen: Any) -> None:
        self.steps[name] = {"ok": ok, **seen}
        print(f"[{'ok' if ok else 'FAIL'}] {name} {json.dumps(seen)[:300]}", flush=True)

    def write(self, name: str, text: str) -> None:
        (self.out / name).write_text(text)


def cli(address: str, token: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "KERNELEVAL_ADDRESS": address, "KERNELEVAL_ADMIN_TOKEN": token}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "clients" / "python" / "src"), str(REPO / "server"), env.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-m", "kerneleval.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def start_service(state: Path, cpu_smoke: bool) -> tuple[subprocess.Popen, str, str]:
    recorder = state / "record_reset.sh"
    state.mkdir(parents=True, exist_ok=True)
    recorder.write_text(f'#!/bin/sh\necho "reset $1 (recorded only)" >> {state}/resets.log\n')
    recorder.chmod(0o755)
    port_file = state / "port"
    cmd = [
        sys.executable,
        "-m",
        "kerneleval_server",
        "serve",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--state-dir",
        str(state / "state"),
        "--watchdog",
        str(REPO / "build" / "watchdog" / "kerneleval-watchdog"),
        "--reset-command",
        f"{recorder} {{index}}",
    ]
    if cpu_smoke:
        cmd += ["--nvml", "none"]
    env = {**os.environ}
    env.pop("KERNELEVAL_ADMIN_TOKEN", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "clients" / "python" / "src"), str(REPO / "server"), env.get("PYTHONPATH", "")]
    )
    log = open(state / "service.log", "ab")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=REPO)
    deadline = time.monotonic() + 180
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"service did not start; see {state / 'service.log'}")
        time.sleep(0.1)
    address = f"127.0.0.1:{int(port_file.read_text())}"
    token = (state / "state" / "admin_token").read_text().strip()
    with Client(address, timeout=5) as c:
        while True:
            try:
                if c.health() == "SERVING":
                    break
            except errors.KernelEvalError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("service not SERVING")
            time.sleep(0.2)
    return proc, address, token


def doctor_steps(chk: Check, address: str, token: str) -> None:
    p = cli("127.0.0.1:1", "", "doctor", "--service-timeout", "2")
    chk.write("doctor_gpu.md", p.stdout + p.stderr)
    chk.record(
        "doctor",
        p.returncode == 0 and "## CUDA tools" in p.stdout,
        tiny_kernel=[ln for ln in p.stdout.splitlines() if "tiny kernel" in ln],
    )


def doctor_service_step(chk: Check, address: str, token: str) -> None:
    """After the planted fault, so that the report shows it."""
    p = cli(address, token, "doctor")
    chk.write("doctor_gpu_service.md", p.stdout + p.stderr)
    chk.record("doctor_service", p.returncode == 0 and "health: SERVING" in p.stdout)


def compare_steps(chk: Check, address: str, token: str, cpu_smoke: bool) -> None:
    for name, (ref, new) in PAIRS.items():
        if cpu_smoke and name != "add_triton":
            continue
        p = cli(
            address,
            token,
            "--timeout",
            "900",
            "compare",
            str(KERNELBENCH / "examples" / ref),
            str(KERNELBENCH / "examples" / new),
            "--perf-trials",
            "50",
        )
        chk.write(f"cli_{name}.txt", f"$ kerneleval compare {ref} {new}\n{p.stderr}\n{p.stdout}")
        job_id = p.stdout.split()[1] if p.stdout.startswith("job ") else ""
        if job_id:
            chk.write(f"cli_{name}.json", cli(address, token, "get", job_id, "--json").stdout)
        verdict = next(
            (ln.split()[-1] for ln in p.stdout.splitlines() if ln.startswith("verdict")), "?"
        )
        chk.record(f"compare_{name}", p.returncode == 0, verdict=verdict, exit_code=p.returncode)


def fault_steps(chk: Check, address: str, token: str, cpu_smoke: bool) -> None:
    with Client(address, timeout=600, admin_token=token) as c:
        spec = kernel_pb2.JobSpec(kernel=kernel_source(TRITON_OOB), options=FAST)
        lines = []
        job = None
        for ev in c.run(spec):
            lines.append(
                f"#{ev.sequence} {ev.WhichOneof('kind')}: "
                + str(getattr(ev, ev.WhichOneof("kind") or "job_id")).replace("\n", " ")[:300]
            )
            if ev.HasField("finished"):
                job = ev.finished
        chk.write("fault_events.txt", "\n".join(lines) + "\n")
        assert job is not None
        verdict = job_pb2.Verdict.Name(job.result.verdict)
        want = "VERDICT_CRASHED" if cpu_smoke else "VERDICT_DEVICE_FAULT"
        chk.record(
            "planted_illegal_address",
            verdict == want,
            verdict=verdict,
            xid=job.result.fault.xid,
            fault=job.result.fault.description,
            cuda_error=job.result.error.cuda_error_name,
        )
        t0 = time.monotonic()
        good = c.evaluate(kernel_pb2.JobSpec(kernel=kernel_source(GOOD), options=FAST))
        chk.record(
            "next_job_after_fault",
            good.result.verdict == job_pb2.VERDICT_OK,
            verdict=job_pb2.Verdict.Name(good.result.verdict),
            seconds=round(time.monotonic() - t0, 2),
        )
    time.sleep(3)  # NVML's XID arrives within ~2 s
    p = cli(address, token, "devices")
    chk.write("devices_after_fault.txt", p.stdout + p.stderr)
    chk.record(
        "devices", p.returncode == 0, xid_lines=[ln for ln in p.stdout.splitlines() if "XID" in ln]
    )
    p = cli(address, token, "--timeout", "3", "events", "--replay", "100", timeout=60)
    chk.write("events.txt", p.stdout)
    chk.record("events", "worker" in p.stdout)


def other_language_steps(chk: Check, address: str, token: str, tmp: Path) -> None:
    model = tmp / "model.py"
    model.write_text(GOOD)
    env = {**os.environ, "KERNELEVAL_ADDRESS": address, "KERNELEVAL_ADMIN_TOKEN": token}
    example = REPO / "build" / "clients-cpp" / "kerneleval_evaluate"
    if example.exists():
        p = subprocess.run(
            [str(example), str(model), str(model)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        chk.write("cpp_example.txt", p.stdout + p.stderr)
        chk.record("cpp_example", p.returncode == 0, tail=p.stdout.splitlines()[-3:])
    else:
        chk.record("cpp_example", True, skipped=f"{example} not built")
    node_dir = REPO / "clients" / "node"
    if shutil.which("node") and (node_dir / "node_modules").is_dir():
        p = subprocess.run(
            ["node", "examples/evaluate.js", str(model), str(model)],
            cwd=node_dir,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        chk.write("node_example.txt", p.stdout + p.stderr)
        chk.record("node_example", p.returncode == 0, tail=p.stdout.splitlines()[-3:])
    else:
        chk.record("node_example", True, skipped="node or clients/node/node_modules missing")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_clients_out"))
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: --nvml none, CPU workers")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    chk = Check(out)
    tmp = Path(tempfile.mkdtemp(prefix="kerneleval-gpu-clients-"))
    proc = None
    try:
        proc, address, token = start_service(tmp / "svc", a.cpu_smoke)
        for step in (
            lambda: doctor_steps(chk, address, token),
            lambda: compare_steps(chk, address, token, a.cpu_smoke),
            lambda: fault_steps(chk, address, token, a.cpu_smoke),
            lambda: other_language_steps(chk, address, token, tmp),
            lambda: doctor_service_step(chk, address, token),
        ):
            try:
                step()
            except Exception as e:  # keep going: one broken step must not hide the others
                chk.record(f"error_{len(chk.steps)}", False, error=repr(e))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log = tmp / "svc" / "service.log"
        if log.exists():
            shutil.copy(log, out / "service.log")
        shutil.rmtree(tmp, ignore_errors=True)
    ok = all(s["ok"] for s in chk.steps.values())
    (out / "gpu_clients_summary.json").write_text(
        json.dumps({"ok": ok, "cpu_smoke": a.cpu_smoke, "steps": chk.steps}, indent=2) + "\n"
    )
    print("all steps passed" if ok else "SOME STEPS FAILED", f"(results in {out})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
