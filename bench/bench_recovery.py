"""Recovery from a planted illegal memory access, against a fresh process per evaluation.

N times: a Triton kernel stores 4 TiB out of bounds (cudaErrorIllegalAddress, XID 31; the
worker's CUDA context is dead), and a good job is submitted the moment the bad one has
started, so it waits in the queue for that GPU. From the jobs' own event timestamps:
  - the fault reported (the job's `fault` event: its job process gave the GPU up) -> next job
    `started` on that GPU (the service's recovery gap);
  - faulted job finished -> next job started (negative where the result waited for NVML's
    XID while the next job already ran);
  - faulted job's last event -> its result reaching the client, and started -> result.
N hung kernels (a CUDA spin) with a short timeout: job timed out -> next job started.
Baseline, in the same run: a fresh process that imports torch and creates a CUDA context
(what a process-per-evaluation evaluator pays after every fault).

    PYTHONPATH=server:clients/python/src python3 bench/bench_recovery.py --out DIR [--faults 10]
    ... --cpu-smoke     # here: the OOB store segfaults under the interpreter (CRASHED)

Results: <out>/bench_recovery.json and .md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
from _baseline import parse_output  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

BASELINE = Path(__file__).resolve().parent / "_baseline.py"


class Tracked:
    """Every event of one job with the client's receive time of `finished`."""

    def __init__(self) -> None:
        self.events: list[job_pb2.JobEvent] = []
        self.started = threading.Event()
        self.client_done = 0.0
        self.job: job_pb2.Job | None = None
        self.error = ""

    def event_time(self, kind: str) -> float:
        for ev in self.events:
            if ev.WhichOneof("kind") == kind:
                return C.ts(ev.time)
        return 0.0

    def last_before_finished(self) -> float:
        times = [C.ts(e.time) for e in self.events if e.WhichOneof("kind") != "finished"]
        return max(times) if times else 0.0


def follow(svc: C.Service, spec: kernel_pb2.JobSpec, out: Tracked) -> None:
    try:
        with svc.client() as c:
            for ev in c.run(spec):
                out.events.append(ev)
                if ev.HasField("started"):
                    out.started.set()
                if ev.HasField("finished"):
                    out.client_done = time.time()
                    out.job = ev.finished
    except Exception as e:  # noqa: BLE001 - reported in the results
        out.error = repr(e)
    finally:
        out.started.set()


HANG_CPU = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        while True:
            pass

def get_inputs():
    return [torch.ones(4)]
"""


def hang_spec(smoke: bool) -> kernel_pb2.JobSpec:
    """A kernel that never ends: a CUDA spin on the GPU, a Python loop on the CPU."""
    if smoke:
        return K.torch_spec(HANG_CPU, "bench-hang")
    return K.cuda_bad_spec(K.CUDA_HANG, "bench-hang")


def one_fault(
    svc: C.Service, n: int, timeout_s: int, bad_spec: kernel_pb2.JobSpec | None = None
) -> dict[str, Any]:
    bad_spec = bad_spec or K.triton_oob_spec()
    bad_spec.options.CopyFrom(K.options(correct=1, perf=0, timeout_s=timeout_s))
    good_spec = K.triton_add_spec(n)
    good_spec.options.CopyFrom(K.options(correct=1, perf=0, timeout_s=timeout_s))
    bad, good = Tracked(), Tracked()
    tb = threading.Thread(target=follow, args=(svc, bad_spec, bad))
    tb.start()
    bad.started.wait(timeout_s + 60)
    tg = threading.Thread(target=follow, args=(svc, good_spec, good))
    tg.start()
    tb.join()
    tg.join()
    assert bad.job is not None and good.job is not None, (bad.error, good.error)
    finished = C.ts(bad.job.end_time) or bad.event_time("finished")
    last = bad.last_before_finished()
    fault = bad.event_time("fault") or finished
    started = bad.event_time("started")
    nxt = good.event_time("started")
    return {
        "bad_job": bad.job.job_id,
        "verdict": job_pb2.Verdict.Name(bad.job.result.verdict),
        "xid": bad.job.result.fault.xid,
        "worker_restarted": bad.job.result.fault.worker_restarted,
        "good_verdict": job_pb2.Verdict.Name(good.job.result.verdict),
        "same_device": bad.job.device_index == good.job.device_index,
        "fault_to_next_start_s": nxt - fault,
        "finished_to_next_start_s": nxt - finished,
        "last_event_to_client_result_s": bad.client_done - last,
        "started_to_client_result_s": bad.client_done - started,
    }


def faster(baseline: float, value: float) -> float | str:
    """baseline / value; a gap of zero or less (the next job did not wait) has no ratio."""
    return C.ratio(baseline, value) if value > 0 else "n/a (did not wait)"


def fresh_cuda(count: int) -> list[dict[str, float]]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(BASELINE), "cuda-init"],
            capture_output=True, text=True, env=C.child_env(), timeout=300,
        )  # fmt: skip
        wall = time.perf_counter() - t
        res = parse_output(proc.stdout)
        out.append({"wall_s": wall, **res})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--faults", type=int, default=None, help="faults (10; 3 smoke)")
    ap.add_argument("--baseline-count", type=int, default=None, help="fresh processes (5)")
    ap.add_argument("--device", default="0")
    ap.add_argument("--timeout", type=int, default=60, help="job timeout, s")
    ap.add_argument("--hangs", type=int, default=None, help="hung kernels (5; 2 smoke)")
    ap.add_argument("--hang-timeout", type=int, default=3, help="their job timeout, s")
    C.add_service_flags(ap)
    args = ap.parse_args()
    smoke = args.cpu_smoke
    faults = args.faults or (3 if smoke else 10)
    hangs = args.hangs if args.hangs is not None else (2 if smoke else 5)
    base_count = args.baseline_count or (2 if smoke else 5)
    n = 4096
    info = C.machine_info()
    flags = [] if smoke else ["--devices", args.device]
    flags += C.service_flags(args)
    svc = C.Service(flags, nvml="none" if smoke else "real").start()
    samples: list[dict[str, Any]] = []
    hung: list[dict[str, Any]] = []
    try:
        svc.wait_workers(1)
        with svc.client() as c:
            warm = K.triton_add_spec(n)
            warm.options.CopyFrom(K.options(correct=1, perf=0))
            c.evaluate(warm)  # compile once, as in steady state
            restarts0 = c.get_stats().worker_restart_count
        for i in range(faults):
            s = one_fault(svc, n, args.timeout)
            samples.append(s)
            print(
                f"fault {i + 1}/{faults}: {s['verdict']} xid={s['xid']} next start "
                f"{s['fault_to_next_start_s'] * 1e3:.0f} ms after the fault, "
                f"{s['finished_to_next_start_s'] * 1e3:.0f} ms after finished; "
                f"good job {s['good_verdict']}",
                flush=True,
            )
        for i in range(hangs):
            s = one_fault(svc, n, args.hang_timeout, hang_spec(smoke))
            hung.append(s)
            print(
                f"hang {i + 1}/{hangs}: {s['verdict']}; next start "
                f"{s['finished_to_next_start_s'] * 1e3:.0f} ms after the timeout; "
                f"good job {s['good_verdict']}",
                flush=True,
            )
        with svc.client() as c:
            restarts = c.get_stats().worker_restart_count - restarts0
        alive = svc.alive()
    finally:
        svc.stop()
    base = fresh_cuda(base_count)
    base_wall = C.summary([b["wall_s"] for b in base])
    base_ctx = C.summary([b["since_interpreter_start_s"] for b in base])

    metrics = [
        ("fault_to_next_start_s", "fault reported -> next job started"),
        ("finished_to_next_start_s", "faulted job finished (after the XID wait) -> next started"),
        ("last_event_to_client_result_s", "faulted job's last event -> result at client"),
        ("started_to_client_result_s", "faulted job started -> result at client"),
    ]
    data: dict[str, Any] = {"faults": samples, "hangs": hung, "worker_restarts": restarts,
                            "service_alive": alive, "baseline": base}  # fmt: skip
    rows: list[list[Any]] = []
    for key, label in metrics:
        s = C.summary([x[key] for x in samples])
        data[key] = s
        rows.append([label, s["n"], s["median"] * 1e3, s["p99"] * 1e3, s["max"] * 1e3,
                     faster(base_wall["median"], s["median"])])  # fmt: skip
    if hung:
        s = C.summary([x["finished_to_next_start_s"] for x in hung])
        data["hang_finished_to_next_start_s"] = s
        rows.append(["hung kernel: job timed out -> next job started", s["n"],
                     s["median"] * 1e3, s["p99"] * 1e3, s["max"] * 1e3,
                     faster(base_wall["median"], s["median"])])  # fmt: skip
    rows.append(
        ["baseline: fresh process, import torch + CUDA context (wall)", base_wall["n"],
         base_wall["median"] * 1e3, base_wall["p99"] * 1e3, base_wall["max"] * 1e3, 1.0]
    )  # fmt: skip
    rows.append(
        ["baseline: same, from interpreter start (in-process clock)", base_ctx["n"],
         base_ctx["median"] * 1e3, base_ctx["p99"] * 1e3, base_ctx["max"] * 1e3,
         C.ratio(base_wall["median"], base_ctx["median"])]
    )  # fmt: skip
    verdicts: dict[str, int] = {}
    for s in samples:
        verdicts[s["verdict"]] = verdicts.get(s["verdict"], 0) + 1
    good_ok = sum(1 for s in samples if s["good_verdict"] == "VERDICT_OK")
    hang_ok = sum(
        1 for s in hung if s["verdict"] == "VERDICT_TIMEOUT" and s["good_verdict"] == "VERDICT_OK"
    )
    expected = "VERDICT_CRASHED" if smoke else "VERDICT_DEVICE_FAULT"
    notes = [
        f"Faulted job verdicts: {verdicts} (expected {expected}); with an XID: "
        f"{sum(1 for s in samples if s['xid'])}/{len(samples)}.",
        f"Good job after each fault OK: {good_ok}/{len(samples)}; same GPU: "
        f"{sum(1 for s in samples if s['same_device'])}/{len(samples)}; worker restarts "
        f"{restarts}; service alive at the end: {alive}.",
        f"Hung kernels: {hang_ok}/{len(hung)} ended VERDICT_TIMEOUT with the next job OK "
        f"(job timeout {args.hang_timeout} s; the job's finish is when the timeout fired).",
        "x faster = baseline wall median / this median.",
        "The service waits for NVML's XID (about 2.5 s with --nvml real) before it returns a "
        "device fault's result, so that the result names the XID; the next job does not wait.",
    ]
    if smoke:
        notes.append("CPU smoke run: no GPU, no CUDA context in the baseline; not a benchmark.")
    C.write_results(
        args.out, "bench_recovery", "Recovery after an illegal memory access", info, data,
        [("Time (ms)", ["measure", "n", "median ms", "p99 ms", "max ms", "x faster"], rows)],
        notes,
    )  # fmt: skip
    ok = (
        verdicts.get(expected, 0) == len(samples)
        and good_ok == len(samples)
        and hang_ok == len(hung)
        and alive
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
