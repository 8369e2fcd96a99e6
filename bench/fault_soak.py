"""Fault soak: good kernels mixed with every kind of bad one, for a given time, on one GPU.

Two client threads keep jobs flowing through the real service (one GPU, one worker, a warm
spare): every other job is a good kernel (compared with a reference; it must be correct) and
the rest cycle through the bad kinds:
  triton_oob, cuda_oob      illegal address (Triton store / raw CUDA write 4 TiB out of bounds)
  cuda_misaligned           misaligned address (raw CUDA)
  hang                      a kernel that never ends (CUDA spin; a Python busy loop on the CPU),
                            with a short job timeout (--hang-timeout, 5 s)
  device_oom                allocate device memory in 4 GiB pieces until it runs out
  segfault                  ctypes.string_at(0) in the host process
  exit                      os._exit(3)
  exception                 raise ValueError
  fork_bomb                 fork until refused or --fork-cap children (each sleeps 1 s, reaped)
  memory_bomb               fill host memory in 256 MiB pieces until MemoryError or a cap of
                            min(--memory-cap-gib, MemTotal / 3)
  network                   connect to a TCP listener this script opens on 127.0.0.1
  write_outside             write /etc/..., a file in the repo's bench/ and in this run's folder
Per kind: jobs, verdicts as expected, lost, worker restarts, time to recover (the bad job's
end -> the next job's start on that GPU, p50/p99), and for the sandbox probes whether the
sandbox stopped them (checked from outside: the listener's accept count, the files; the
service runs with --job-max-pids and --job-memory-mib below the bombs' caps). Service
restarts must be 0 (the server's pid and the watchdog's pid are the same at the end).

    PYTHONPATH=server:clients/python/src python3 bench/fault_soak.py --duration-s 480 --out DIR
    ... --cpu-smoke [--duration-s 90]    # here: CUDA kinds skipped, OOB -> CRASHED

Results: <out>/fault_soak.json and .md.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

V = job_pb2.Verdict.Name

TORCH_WRAP = """
import ctypes
import os
import socket
import time
import torch

class Model(torch.nn.Module):
    def forward(self, x):
BODY
        return x

def get_inputs():
    return [torch.zeros(16)]

def get_init_inputs():
    return []
"""

BODIES = {
    "segfault": "ctypes.string_at(0)",
    "exit": "os._exit(3)",
    "exception": 'raise ValueError("planted exception")',
    "hang_cpu": "while True:\n    pass",
    "device_oom": """held = []
for _ in range(100000):
    held.append(torch.empty(4 << 30, dtype=torch.uint8, device=x.device))""",
    "fork_bomb": """pids, err = [], ""
for _ in range(FORK_CAP):
    try:
        pid = os.fork()
    except OSError as e:
        err = f"{type(e).__name__}: {e}"
        break
    if pid == 0:
        time.sleep(1.0)
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
if err:
    raise RuntimeError(f"fork bomb stopped after {len(pids)} forks: {err}")
raise RuntimeError(f"fork bomb reached its own cap of FORK_CAP forks: not stopped")""",
    "memory_bomb": """held, total = [], 0
try:
    while total < MEM_CAP:
        held.append(b"\\x01" * (256 << 20))
        total += 256 << 20
except MemoryError:
    del held
    raise MemoryError(f"memory bomb stopped at {total >> 20} MiB")
del held
raise RuntimeError(f"memory bomb reached its own cap of {total >> 20} MiB: not stopped")""",
    "network": """try:
    s = socket.create_connection(("127.0.0.1", LISTEN_PORT), timeout=2)
    s.sendall(b"kerneleval-soak-probe")
    s.close()
    msg = "connected"
except OSError as e:
    msg = f"blocked ({type(e).__name__}: {e})"
raise RuntimeError("network probe: " + msg)""",
    "write_outside": """out = []
for p in PROBE_PATHS:
    try:
        with open(p, "w") as f:
            f.write("kerneleval soak probe")
        out.append(f"{p}: written")
    except OSError as e:
        out.append(f"{p}: blocked ({type(e).__name__})")
raise RuntimeError("write probe: " + "; ".join(out))""",
}

GOOD = {"good_triton", "good_torch", "good_cuda"}
EXPECTED_GPU: dict[str, set[str]] = {
    "triton_oob": {"VERDICT_DEVICE_FAULT"},
    "cuda_oob": {"VERDICT_DEVICE_FAULT"},
    "cuda_misaligned": {"VERDICT_DEVICE_FAULT"},
    "hang": {"VERDICT_TIMEOUT"},
    "device_oom": {"VERDICT_OUT_OF_MEMORY"},
    "segfault": {"VERDICT_CRASHED"},
    "exit": {"VERDICT_CRASHED"},
    "exception": {"VERDICT_RUNTIME_ERROR"},
    "fork_bomb": {"VERDICT_RUNTIME_ERROR"},
    "memory_bomb": {"VERDICT_OUT_OF_MEMORY", "VERDICT_RUNTIME_ERROR"},
    "network": {"VERDICT_RUNTIME_ERROR"},
    "write_outside": {"VERDICT_RUNTIME_ERROR"},
}
CPU_SKIP = {"cuda_oob", "cuda_misaligned", "device_oom", "good_cuda"}


@dataclass
class Rec:
    kind: str
    job_id: str = ""
    state: str = ""
    verdict: str = ""
    correct: bool = False
    device: int = -2
    worker_id: str = ""
    start: float = 0.0
    end: float = 0.0
    attempts: int = 0
    worker_restarted: bool = False
    message: str = ""
    error: str = ""
    probe: str = ""


class Listener:
    """A TCP listener on 127.0.0.1 that counts connections (the network probe's target)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.smoke = args.cpu_smoke
        self.listener = Listener()
        self.probe_paths = [
            "/etc/kerneleval_soak_probe",
            str(C.REPO / "bench" / ".kerneleval_soak_probe"),
            str(root / "outside_probe"),
        ]
        cap_gib = min(args.memory_cap_gib, C.mem_total_bytes() / 3 / 2**30)
        self.mem_cap = int(cap_gib * 2**30)
        kinds = ["good_triton", "good_torch", "good_cuda"]
        self.good = [k for k in kinds if not (self.smoke and k in CPU_SKIP)]
        self.bad = [k for k in EXPECTED_GPU if not (self.smoke and k in CPU_SKIP)]
        self.write_lock = threading.Lock()

    def expected(self, kind: str) -> set[str]:
        if kind in GOOD:
            return {"VERDICT_OK"}
        if self.smoke and kind == "triton_oob":
            return {"VERDICT_CRASHED"}
        return EXPECTED_GPU[kind]

    def spec(self, kind: str, i: int) -> kernel_pb2.JobSpec:
        n = 4096 if self.smoke else 1 << 20
        opts = K.options(correct=2, perf=0 if self.smoke else 10, timeout_s=60)
        if kind == "good_triton":
            spec = K.triton_add_spec(n, block=[256, 512, 1024][i % 3])
        elif kind == "good_torch":
            spec = kernel_pb2.JobSpec(client_tag="soak-good_torch")
            spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
            spec.kernel.source_code = K.torch_ref(n).replace("a + b", "torch.add(a, b)")
            spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
            spec.reference.source_code = K.torch_ref(n)
        elif kind == "good_cuda":
            spec = K.cuda_add_spec(n)
        elif kind == "triton_oob":
            spec = K.triton_oob_spec()
        elif kind == "cuda_oob":
            spec = K.cuda_bad_spec(K.CUDA_OOB, "soak-cuda_oob")
        elif kind == "cuda_misaligned":
            spec = K.cuda_bad_spec(K.CUDA_MISALIGNED, "soak-cuda_misaligned")
        elif kind == "hang" and not self.smoke:
            spec = K.cuda_bad_spec(K.CUDA_HANG, "soak-hang")
        else:
            body = BODIES["hang_cpu" if kind == "hang" else kind]
            body = (
                body.replace("FORK_CAP", str(self.args.fork_cap))
                .replace("MEM_CAP", str(self.mem_cap))
                .replace("LISTEN_PORT", str(self.listener.port))
                .replace("PROBE_PATHS", repr(self.probe_paths))
            )
            indented = "\n".join("        " + line for line in body.splitlines())
            spec = K.torch_spec(TORCH_WRAP.replace("BODY", indented), f"soak-{kind}")
        if kind == "hang":
            opts.timeout.seconds = self.args.hang_timeout
        spec.options.CopyFrom(opts)
        spec.client_tag = f"soak-{kind}"
        return spec

    def probe_outside(self) -> str:
        """Which probe files exist (the write got through); removes them."""
        written = []
        for p in self.probe_paths:
            path = Path(p)
            if path.exists():
                written.append(p)
                path.unlink(missing_ok=True)
        return "written: " + ", ".join(written) if written else "stopped: no file written"

    def run_one(self, svc: C.Service, rec: Rec, spec: kernel_pb2.JobSpec) -> None:
        accepted_before = self.listener.accepted
        try:
            with svc.client(timeout=900) as c:
                for ev in c.run(spec):
                    rec.job_id = ev.job_id
                    if ev.HasField("finished"):
                        self._finish(rec, ev.finished)
        except Exception as e:  # noqa: BLE001 - counted as lost
            rec.error = repr(e)[:300]
        if rec.kind == "network":
            time.sleep(0.6)
            got = self.listener.accepted - accepted_before
            rec.probe = f"listener accepted {got}; job said: {rec.message[-120:]}"
        elif rec.kind == "write_outside":
            with self.write_lock:
                rec.probe = self.probe_outside() + f"; job said: {rec.message[-240:]}"
        elif rec.kind in ("fork_bomb", "memory_bomb"):
            rec.probe = rec.message[-200:]

    def _finish(self, rec: Rec, job: job_pb2.Job) -> None:
        r = job.result
        rec.state = job_pb2.JobState.Name(job.state)
        rec.verdict = V(r.verdict)
        rec.correct = r.correctness
        rec.device = job.device_index
        rec.worker_id = job.worker_id
        rec.start = C.ts(job.start_time)
        rec.end = C.ts(job.end_time)
        rec.attempts = job.attempt_count
        rec.worker_restarted = r.fault.worker_restarted
        rec.message = (
            r.error.message or r.compilation_error or r.validation_error or r.fault.description
        )[:400]


def watch_ops(svc: C.Service, exits: list[dict[str, Any]], stop: threading.Event) -> None:
    try:
        with svc.client() as c:
            stream = c.watch_events()

            def closer() -> None:
                stop.wait()
                c.close()

            threading.Thread(target=closer, daemon=True).start()
            for ev in stream:
                if ev.HasField("worker_exited"):
                    w = ev.worker_exited
                    exits.append({"time": C.ts(ev.time), "worker_id": w.worker.worker_id,
                                  "job_id": w.worker.job_id, "reason": w.reason,
                                  "device": ev.device_index})  # fmt: skip
    except Exception:  # noqa: BLE001 - the stream ends when the service stops
        pass


def watchdog_pid(server_pid: int) -> int:
    for pid in C.child_pids(server_pid):
        try:
            if "kerneleval-watchdog" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                return pid
        except OSError:
            pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--duration-s", type=float, default=None, help="600 (GPU) / 90 (smoke)")
    ap.add_argument("--concurrency", type=int, default=2, help="client threads")
    ap.add_argument("--hang-timeout", type=int, default=5, help="job timeout of `hang`, s")
    ap.add_argument("--fork-cap", type=int, default=256, help="the fork bomb's own cap")
    ap.add_argument("--memory-cap-gib", type=float, default=8.0, help="the memory bomb's cap")
    ap.add_argument("--device", default="0")
    args = ap.parse_args()
    if args.cpu_smoke and args.memory_cap_gib == 8.0:
        args.memory_cap_gib = 2.0
    duration = args.duration_s or (90.0 if args.cpu_smoke else 600.0)
    info = C.machine_info()
    flags = [] if args.cpu_smoke else ["--devices", args.device]
    # The job sandbox's limits sit below the bombs' own caps, so a bomb that reaches its cap
    # was not stopped by the sandbox (the limits are what is tested, not the caps).
    cap_mib = min(args.memory_cap_gib * 1024, C.mem_total_bytes() / 3 / 2**20)
    flags += ["--job-max-pids", str(max(64, args.fork_cap // 2)),
              "--job-memory-mib", str(max(1024, int(cap_mib * 3 / 4)))]  # fmt: skip
    svc = C.Service(flags, nvml="none" if args.cpu_smoke else "real")
    soak = Soak(args, svc.root)
    svc.start()
    records: list[Rec] = []
    exits: list[dict[str, Any]] = []
    stop_ops = threading.Event()
    lock = threading.Lock()
    counter = [0]
    try:
        svc.wait_workers(1)
        server_pid, wd_pid = svc.pid, watchdog_pid(svc.pid)
        with svc.client() as c:
            stats0 = c.get_stats()
        threading.Thread(target=watch_ops, args=(svc, exits, stop_ops), daemon=True).start()
        end_at = time.monotonic() + duration
        t0 = time.monotonic()

        def loop() -> None:
            while time.monotonic() < end_at and svc.alive():
                with lock:
                    i = counter[0]
                    counter[0] += 1
                if i % 2 == 0:
                    kind = soak.good[(i // 2) % len(soak.good)]
                else:
                    kind = soak.bad[(i // 2) % len(soak.bad)]
                rec = Rec(kind=kind)
                with lock:
                    records.append(rec)
                soak.run_one(svc, rec, soak.spec(kind, i))

        threads = [threading.Thread(target=loop) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(10)
            with lock:
                done = sum(1 for r in records if r.verdict)
            print(f"  {time.monotonic() - t0:.0f} s: {len(records)} jobs, {done} finished",
                  flush=True)  # fmt: skip
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        time.sleep(1.0)
        lost_ids = []
        with svc.client() as c:
            for r in records:
                if not r.job_id:
                    lost_ids.append(r.kind)
                    continue
                job = c.get_job(r.job_id)
                if job.state not in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED):
                    lost_ids.append(r.job_id)
            stats = c.get_stats()
        alive = svc.alive()
        same_server = alive and svc.pid == server_pid
        wd_now = watchdog_pid(svc.pid)
    finally:
        stop_ops.set()
        svc.stop()
        warnings = svc.warnings()
        soak.listener.close()
        soak.probe_outside()

    # Time to recover: the bad job's end -> the next job's start on that GPU.
    starts = sorted((r.start, r.device) for r in records if r.start)
    by_job = {r.job_id: r for r in records if r.job_id}
    exits_by_kind: dict[str, int] = {}
    for e in exits:
        owner = by_job.get(e["job_id"])
        k = owner.kind if owner else "(no job)"
        exits_by_kind[k] = exits_by_kind.get(k, 0) + 1
    kinds = soak.good + soak.bad
    rows: list[list[Any]] = []
    per_kind: dict[str, Any] = {}
    for kind in kinds:
        rs = [r for r in records if r.kind == kind]
        exp = soak.expected(kind)
        as_expected = sum(1 for r in rs if r.verdict in exp and (kind not in GOOD or r.correct))
        lost = sum(1 for r in rs if not r.job_id or r.job_id in lost_ids or not r.verdict)
        gaps = []
        for r in rs:
            if kind in GOOD or not r.end:
                continue
            nxt = next((s for s, d in starts if d == r.device and s >= r.end - 0.001), None)
            if nxt is not None:
                gaps.append(max(0.0, nxt - r.end))
        g = C.summary(gaps)
        verdicts: dict[str, int] = {}
        for r in rs:
            key = r.verdict or f"no result: {r.error[:80]}"
            verdicts[key] = verdicts.get(key, 0) + 1
        per_kind[kind] = {"jobs": len(rs), "as_expected": as_expected, "expected": sorted(exp),
                          "verdicts": verdicts, "lost": lost,
                          "worker_restarts": exits_by_kind.get(kind, 0),
                          "worker_restarted_flag": sum(1 for r in rs if r.worker_restarted),
                          "recover_s": g}  # fmt: skip
        rows.append(
            [kind, len(rs), f"{as_expected}/{len(rs)}", lost, exits_by_kind.get(kind, 0),
             g["median"] * 1e3 if gaps else "-", g["p99"] * 1e3 if gaps else "-",
             ", ".join(f"{k.removeprefix('VERDICT_')}:{v}" for k, v in verdicts.items())]
        )  # fmt: skip
    sandbox_rows = []
    for kind in ("fork_bomb", "memory_bomb", "network", "write_outside"):
        rs = [r for r in records if r.kind == kind and r.probe]
        if not rs:
            continue
        if kind == "network":
            stopped = all(r.probe.startswith("listener accepted 0") for r in rs)
        elif kind == "write_outside":
            stopped = all(r.probe.startswith("stopped") for r in rs)
        else:
            stopped = all("not stopped" not in r.probe for r in rs)
        sandbox_rows.append([kind, len(rs), "yes" if stopped else "NO", rs[-1].probe[:200]])
    good = [r for r in records if r.kind in GOOD]
    good_ok = sum(1 for r in good if r.verdict == "VERDICT_OK" and r.correct)
    data = {
        "duration_s": wall, "jobs": len(records), "good_jobs": len(good), "good_correct": good_ok,
        "lost": len(lost_ids), "server_pid_same": same_server, "watchdog_pid_before": wd_pid,
        "watchdog_pid_after": wd_now,
        "worker_restarts_getstats": stats.worker_restart_count - stats0.worker_restart_count,
        "faults_getstats": stats.fault_count - stats0.fault_count,
        "gpu_resets_recorded": svc.resets_recorded(), "per_kind": per_kind,
        "worker_exits": exits, "records": [asdict(r) for r in records],
    }  # fmt: skip
    notes = [
        f"{len(records)} jobs in {wall:.0f} s ({args.concurrency} client threads, one GPU "
        f"{'cpu' if args.cpu_smoke else args.device}, one worker + warm spare); good jobs "
        f"correct: {good_ok}/{len(good)}; jobs lost: {len(lost_ids)}.",
        f"Service restarts: {0 if same_server else 'the server process changed or died'}; "
        f"watchdog pid {wd_pid} -> {wd_now} ({'same' if wd_pid == wd_now else 'CHANGED'}); "
        f"worker restarts (GetStats): {data['worker_restarts_getstats']}; GPU resets recorded "
        f"(recording command only): {data['gpu_resets_recorded']}.",
        "Recover = the bad job's end -> the next job's start on that GPU (job timestamps).",
        f"Caps: fork bomb {args.fork_cap} forks, memory bomb {soak.mem_cap >> 20} MiB "
        "(a probe that reaches its own cap was not stopped by the sandbox).",
    ]
    notes += [f"Service warning: {w}" for w in warnings]
    if args.cpu_smoke:
        notes.append("CPU smoke: CUDA kinds skipped; the Triton OOB store segfaults (CRASHED).")
    C.write_results(
        args.out, "fault_soak", f"Fault soak ({duration:g} s)", info, data,
        [("Per kind", ["kind", "jobs", "as expected", "lost", "worker exits",
                       "recover p50 ms", "recover p99 ms", "verdicts"], rows),
         ("Sandbox probes (checked from outside the worker)",
          ["probe", "jobs", "stopped", "evidence (last job)"], sandbox_rows)],
        notes,
    )  # fmt: skip
    all_expected = all(v["as_expected"] == v["jobs"] for v in per_kind.values())
    ok = all_expected and not lost_ids and same_server and good_ok == len(good)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
