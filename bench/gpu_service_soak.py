"""Soak test of the whole service on a GPU: good kernels mixed with planted illegal-address ones.

Starts `python -m kerneleval_server serve` (real NVML, the GPU, a reset command that only
records its calls), then keeps --concurrency jobs in flight for --duration seconds through a
real gRPC client: good kernels (eager PyTorch, Triton, raw CUDA, each compared with a
reference) and bad ones (a Triton store and a raw CUDA write far out of bounds, which raise
cudaErrorIllegalAddress and poison the worker's CUDA context). It reports:

  good jobs that succeeded, bad jobs classified VERDICT_DEVICE_FAULT (with the XID where NVML
  saw one), jobs lost (accepted but not finished, or missing), worker restarts, and the time
  from a fault (the job's `fault` event: the poisoned worker's report, or its crash) to the
  start of the next job on that GPU (p50/p99).

  python bench/gpu_service_soak.py [--duration 180] [--out bench/results]
  python bench/gpu_service_soak.py --cpu-smoke      # here, without a GPU: Triton under the
                                                    # interpreter; a bad job is VERDICT_CRASHED

Results: <out>/gpu_service_soak.json and .md (cpu_smoke_service_soak.* with --cpu-smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from _kernels import CUDA_ADD_REF, CUDA_OOB, TRITON_OOB, cuda_io  # bench/, beside this script
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc

REPO = Path(__file__).resolve().parents[1]

TORCH_REF = """
import torch

class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b

def get_inputs():
    return [torch.randn(1 << 20), torch.randn(1 << 20)]

def get_init_inputs():
    return []
"""

TORCH_GOOD = TORCH_REF.replace("return a + b", "return torch.add(a, b)")

TRITON_GOOD = """
import torch
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)

class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        out = torch.empty_like(a)
        n = a.numel()
        add_kernel[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)
        return out
"""

CUDA_GOOD = r"""
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}
"""

N = 1 << 20


def make_spec(kind: str, timeout_s: int, n: int = N) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag=f"soak-{kind}")
    torch_ref = TORCH_REF.replace("1 << 20", str(n))
    k, r = spec.kernel, spec.reference
    if kind == "torch":
        k.type, k.source_code = kernel_pb2.KERNEL_TYPE_TORCH, TORCH_GOOD
        r.type, r.source_code = kernel_pb2.KERNEL_TYPE_TORCH, torch_ref
    elif kind == "triton":
        k.type, k.source_code = kernel_pb2.KERNEL_TYPE_TRITON, TRITON_GOOD
        r.type, r.source_code = kernel_pb2.KERNEL_TYPE_TORCH, torch_ref
    elif kind == "cuda":
        k.type, k.source_code = kernel_pb2.KERNEL_TYPE_CUDA, CUDA_GOOD
        k.io.CopyFrom(cuda_io(n, True))
        r.type, r.source_code = kernel_pb2.KERNEL_TYPE_CUDA, CUDA_ADD_REF
        r.io.CopyFrom(cuda_io(n, True))
    elif kind == "triton_oob":
        spec.ClearField("reference")
        k.type, k.source_code = kernel_pb2.KERNEL_TYPE_TRITON, TRITON_OOB
    elif kind == "cuda_oob":
        spec.ClearField("reference")
        k.type, k.source_code = kernel_pb2.KERNEL_TYPE_CUDA, CUDA_OOB
        k.io.CopyFrom(cuda_io(1024, False))
    else:
        raise ValueError(kind)
    spec.options.correct_trial_count = 3
    spec.options.perf_trial_count = 20
    spec.options.warmup_count = 3
    spec.options.timeout.seconds = timeout_s
    return spec


@dataclass
class JobRecord:
    kind: str
    bad: bool
    job_id: str = ""
    verdict: str = ""
    state: str = ""
    correct: bool = False
    xid: int = 0
    device_index: int = -1
    worker_id: str = ""
    attempts: int = 0
    submit_time: float = 0.0
    start_time: float = 0.0
    fault_time: float = 0.0  # the job's `fault` event: when the service learned of the fault
    end_time: float = 0.0
    error: str = ""


@dataclass
class Report:
    mode: str
    duration_s: float
    concurrency: int
    jobs_submitted: int = 0
    good_jobs: int = 0
    good_succeeded: int = 0
    bad_jobs: int = 0
    bad_classified: int = 0
    bad_expected_verdict: str = ""
    bad_verdicts: dict[str, int] = field(default_factory=dict)
    bad_with_xid: int = 0
    good_failures: list[dict[str, Any]] = field(default_factory=list)
    bad_misclassified: list[dict[str, Any]] = field(default_factory=list)
    jobs_lost: int = 0
    worker_restarts: int = 0
    fault_to_next_start_ms_p50: float = 0.0
    fault_to_next_start_ms_p99: float = 0.0
    fault_to_next_start_samples: int = 0
    jobs_per_kind: dict[str, int] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    resets_recorded: int = 0


def ts(t: Any) -> float:
    return float(t.ToNanoseconds()) / 1e9


class Service:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.root = root
        self.resets = root / "resets.log"
        script = root / "record_reset.sh"
        script.write_text(f'#!/bin/sh\necho "reset $*" >> {self.resets}\n')
        script.chmod(0o755)
        port_file = root / "port"
        cmd = [
            sys.executable, "-m", "kerneleval_server", "serve",
            "--port", "0", "--port-file", str(port_file),
            "--state-dir", str(root / "state"),
            "--reset-command", f"{script} {{index}}",
            "--workers-per-device", str(args.workers_per_device),
            "--nvml", "none" if args.cpu_smoke else "real",
            "--log-file", str(root / "service.log"),
        ]  # fmt: skip
        if args.devices:
            cmd += ["--devices", args.devices]
        if args.max_restarts:
            cmd += ["--max-restarts", str(args.max_restarts)]
        if args.worker_user:
            cmd += ["--worker-user", args.worker_user]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [
                str(REPO / "server"),
                str(REPO / "clients" / "python" / "src"),
                env.get("PYTHONPATH", ""),
            ]
        )
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(root / "service.stderr", "wb"))  # fmt: skip
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the service did not start; see {root}/service.stderr")
            time.sleep(0.1)
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"
        self.token = (root / "state" / "admin_token").read_text().strip()
        self.channel = grpc.insecure_channel(self.address)
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    break
            except grpc.RpcError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the service never became SERVING; see {root}/service.log")
            time.sleep(0.2)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_job(stub: Any, rec: JobRecord, spec: kernel_pb2.JobSpec) -> None:
    rec.submit_time = time.time()
    try:
        # Longer than the job's own timeout plus a queue wait: a stuck service shows as lost.
        for resp in stub.Run(pb.RunRequest(spec=spec), timeout=spec.options.timeout.seconds + 180):
            ev = resp.event
            rec.job_id = ev.job_id
            if ev.HasField("started"):
                rec.start_time = ts(ev.time)
            if ev.HasField("fault") and not rec.fault_time:
                rec.fault_time = ts(ev.time)
            if ev.HasField("finished"):
                job = ev.finished
                rec.state = job_pb2.JobState.Name(job.state)
                rec.verdict = job_pb2.Verdict.Name(job.result.verdict)
                rec.correct = job.result.correctness
                rec.xid = job.result.fault.xid
                rec.device_index = job.device_index
                rec.worker_id = job.worker_id
                rec.attempts = job.attempt_count
                rec.end_time = ts(job.end_time)
                if job.result.verdict != job_pb2.VERDICT_OK:
                    r = job.result
                    rec.error = (
                        r.compilation_error or r.validation_error or r.error.message
                        or r.fault.description
                    )[:300]  # fmt: skip
    except grpc.RpcError as exc:
        rec.error = f"{exc.code().name}: {exc.details()}"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=None, help="seconds (default 180; 20 smoke)")
    ap.add_argument("--concurrency", type=int, default=4, help="jobs in flight")
    ap.add_argument("--bad-every", type=int, default=4, help="every Nth job is a planted fault")
    ap.add_argument("--workers-per-device", type=int, default=1)
    ap.add_argument("--devices", default="", help="GPU indices (default all)")
    ap.add_argument("--timeout", type=int, default=120, help="per-job timeout, seconds")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: CPU + Triton interpreter")
    ap.add_argument(
        "--worker-user",
        default="",
        help="user for workers when run as root (default nobody; 'root' if the checkout\n"
        "is not world-readable: service.log warns about it)",
    )
    ap.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="watchdog restart intensity (default: its own, 5 in 30 s; 1000 with --cpu-smoke,\n"
        "where every planted fault is a SIGSEGV, which counts as a worker failure)",
    )
    args = ap.parse_args()
    if args.max_restarts is None:
        args.max_restarts = 1000 if args.cpu_smoke else 0
    duration = args.duration if args.duration is not None else (20.0 if args.cpu_smoke else 180.0)
    good_kinds = ["torch", "triton"] if args.cpu_smoke else ["torch", "triton", "cuda"]
    bad_kinds = ["triton_oob"] if args.cpu_smoke else ["triton_oob", "cuda_oob"]
    expected_bad = "VERDICT_CRASHED" if args.cpu_smoke else "VERDICT_DEVICE_FAULT"
    size = 4096 if args.cpu_smoke else N  # the Triton interpreter is slow

    root = Path(tempfile.mkdtemp(prefix="kerneleval-soak-"))
    print(f"starting the service in {root} ...", flush=True)
    svc = Service(args, root)
    stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel)
    opstub = ops_grpc.OperationsServiceStub(svc.channel)
    auth = [("authorization", f"Bearer {svc.token}")]
    devices = opstub.ListDevices(ops.ListDevicesRequest(), metadata=auth).devices
    print("devices:", ", ".join(f"{d.index}:{d.name}" for d in devices), flush=True)
    restarts_before = opstub.GetStats(ops.GetStatsRequest(), metadata=auth).worker_restart_count

    records: list[JobRecord] = []
    lock = threading.Lock()
    counter = [0]
    end_at = time.monotonic() + duration

    def loop() -> None:
        while time.monotonic() < end_at:
            with lock:
                i = counter[0]
                counter[0] += 1
            bad = args.bad_every > 0 and i % args.bad_every == args.bad_every - 1
            kinds = bad_kinds if bad else good_kinds
            kind = kinds[(i // max(args.bad_every, 1) if bad else i) % len(kinds)]
            rec = JobRecord(kind=kind, bad=bad)
            with lock:
                records.append(rec)
            run_job(stub, rec, make_spec(kind, args.timeout, size))

    threads = [threading.Thread(target=loop) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(5)
        with lock:
            done = sum(1 for r in records if r.verdict)
        print(f"  {len(records)} submitted, {done} finished", flush=True)
    for t in threads:
        t.join()

    # Nothing lost: every accepted job is in the store, finished.
    lost = 0
    for rec in records:
        if not rec.job_id:
            lost += 1
            continue
        try:
            job = stub.GetJob(pb.GetJobRequest(job_id=rec.job_id)).job
            if job.state not in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED,
                                 job_pb2.JOB_STATE_FAILED):  # fmt: skip
                lost += 1
        except grpc.RpcError:
            lost += 1
    stats = opstub.GetStats(ops.GetStatsRequest(), metadata=auth)

    # Fault -> next start: a bad job's `fault` event (the poisoned worker's report, or its
    # exit) to the next job start on that device. Only faults with a job waiting count.
    starts = sorted((r.start_time, r.submit_time, r.device_index) for r in records if r.start_time)
    latencies = []
    for b in records:
        if not (b.bad and b.fault_time):
            continue
        nxt = next(
            (s for s, sub, d in starts if d == b.device_index and s >= b.fault_time - 0.001
             and sub < b.fault_time),
            None,
        )  # fmt: skip
        if nxt is not None:
            latencies.append(max(0.0, nxt - b.fault_time) * 1000.0)

    good = [r for r in records if not r.bad]
    bad = [r for r in records if r.bad]
    rep = Report(mode="cpu-smoke" if args.cpu_smoke else "gpu", duration_s=duration,
                 concurrency=args.concurrency)  # fmt: skip
    rep.jobs_submitted = len(records)
    rep.good_jobs = len(good)
    rep.good_succeeded = sum(1 for r in good if r.verdict == "VERDICT_OK" and r.correct)
    rep.good_failures = [asdict(r) for r in good if not (r.verdict == "VERDICT_OK" and r.correct)][
        :20
    ]
    rep.bad_jobs = len(bad)
    rep.bad_expected_verdict = expected_bad
    rep.bad_classified = sum(1 for r in bad if r.verdict == expected_bad)
    rep.bad_misclassified = [asdict(r) for r in bad if r.verdict != expected_bad][:20]
    for r in bad:
        rep.bad_verdicts[r.verdict or r.error] = rep.bad_verdicts.get(r.verdict or r.error, 0) + 1
    rep.bad_with_xid = sum(1 for r in bad if r.xid)
    rep.jobs_lost = lost
    rep.worker_restarts = stats.worker_restart_count - restarts_before
    rep.fault_to_next_start_ms_p50 = round(statistics.median(latencies), 1) if latencies else 0.0
    rep.fault_to_next_start_ms_p99 = round(percentile(latencies, 0.99), 1)
    rep.fault_to_next_start_samples = len(latencies)
    for r in records:
        rep.jobs_per_kind[r.kind] = rep.jobs_per_kind.get(r.kind, 0) + 1
    rep.devices = [f"{d.index}: {d.name} {d.uuid}".strip() for d in devices]
    rep.resets_recorded = len(svc.resets.read_text().splitlines()) if svc.resets.exists() else 0
    svc.stop()

    rows = [
        ("good jobs succeeded (correct)", f"{rep.good_succeeded} / {rep.good_jobs}"),
        (f"bad jobs {expected_bad}", f"{rep.bad_classified} / {rep.bad_jobs}"),
        ("bad jobs with an XID", f"{rep.bad_with_xid} / {rep.bad_jobs}"),
        ("jobs lost", str(rep.jobs_lost)),
        ("worker restarts", str(rep.worker_restarts)),
        ("fault -> next job start p50 (ms)", f"{rep.fault_to_next_start_ms_p50}"),
        ("fault -> next job start p99 (ms)", f"{rep.fault_to_next_start_ms_p99}"),
        ("samples", str(rep.fault_to_next_start_samples)),
    ]
    width = max(len(a) for a, _ in rows)
    table = "\n".join(f"{a.ljust(width)}  {b}" for a, b in rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "cpu_smoke_service_soak" if args.cpu_smoke else "gpu_service_soak"
    (out / f"{stem}.json").write_text(json.dumps(asdict(rep), indent=2) + "\n")
    md = [
        f"# Service soak ({rep.mode}, {duration:g} s, {args.concurrency} in flight)",
        "",
        f"Devices: {'; '.join(rep.devices)}. Jobs per kind: {rep.jobs_per_kind}.",
        "",
        "| measure | value |",
        "| --- | --- |",
        *[f"| {a} | {b} |" for a, b in rows],
        "",
        f"Bad job verdicts: {rep.bad_verdicts}.",
    ]
    if args.cpu_smoke:
        md += [
            "",
            "On the CPU every planted fault is a SIGSEGV, which the watchdog counts as a worker",
            "failure (restart backoff), and a replacement needs a fresh torch import (~2 s on a",
            "busy 2-core box): with a fault every few seconds the spare is often not warm yet,",
            "so the fault -> next start times here are not the GPU's.",
        ]
    if rep.good_failures:
        md += ["", "Good jobs that failed (first 20):", ""]
        md += [
            f"- {f['kind']} {f['job_id']}: {f['verdict']} {f['error']}" for f in rep.good_failures
        ]
    if rep.bad_misclassified:
        md += ["", f"Bad jobs not {expected_bad} (first 20):", ""]
        md += [
            f"- {f['kind']} {f['job_id']}: {f['verdict']} {f['error']}"
            for f in rep.bad_misclassified
        ]
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / stem}.json and .md")
    ok = (
        rep.good_succeeded == rep.good_jobs
        and rep.bad_classified == rep.bad_jobs
        and rep.jobs_lost == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
