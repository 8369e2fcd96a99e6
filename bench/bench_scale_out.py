"""Scale-out on one PostgreSQL store (issue 18), CPU only: nodes, store latency, node loss.

A real PostgreSQL server (Debian's binaries, else the pgserver wheel's: _common.Postgres, a
temporary folder, unix socket, no fsync) and real `kerneleval_server serve` processes with the fake
engine of tests/frontend (`{"do": "time", "seconds": s}`: the job sleeps s seconds "compiling"
and s seconds in the device's timing window), so that the nodes, not the CPU, are the limit:
  1. jobs per second through one gateway (`--role gateway`) with 1, 2 and 4 nodes
     (`--role node`, one fake device each); one RunBatch stream of distinct jobs, timed from
     the first send to the last finished event; scaling efficiency = rate(n) / (n * rate(1));
  2. Submit latency (sequential, p50/p99) and Watch first-event latency (a new Watch on a
     queued job: call to first event) on a `--role all` service on SQLite, one on PostgreSQL
     and a `--role gateway` on PostgreSQL, up together, calls alternating between them (their
     one worker held by a long job, or no node: every job stays queued);
  3. a node's death: a gateway and two nodes, the default `--lease-seconds` (10); the first
     node runs jobs, the second is idle; SIGKILL the first at a chosen point after one of its
     lease renewals (a different one per trial: just after one, the lease has all of its 10 s
     left); time from the kill to the jobs' re-queue (their fault event) and to their
     `started` event on the other node (lease expiry + reap + pickup).
The machine's CPU use (from /proc/stat) is stated for every phase.

    PYTHONPATH=server:clients/python/src python3 bench/bench_scale_out.py --out DIR

Results: <out>/bench_scale_out.json and .md (default bench/results/cpu).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import grpc  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2  # noqa: E402
from kerneleval.v1 import kernel_eval_service_pb2 as pb  # noqa: E402

FRONTEND = C.REPO / "tests" / "frontend"
TOKEN = "ket_bench-scale-out-token"
NAME = "bench_scale_out"


# ---- pure helpers (tests/bench/test_bench_scale_out.py) -----------------------------------


def time_job(seconds: float, n: int, tag: str = "") -> kernel_pb2.JobSpec:
    """A distinct sleep-bound job of the fake engine: `seconds` "compiling", `seconds` in the
    device's timing window (distinct by `n`: no result cache answers it)."""
    spec = kernel_pb2.JobSpec(client_tag=tag)
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = json.dumps({"do": "time", "seconds": seconds, "n": n})
    spec.options.correct_trial_count = 1
    spec.options.perf_trial_count = 3
    spec.options.warmup_count = 1
    return spec


def rate(finish_times: Sequence[float], start: float) -> float:
    """Jobs per second: all of them over the time from `start` to the last finish."""
    if not finish_times:
        return 0.0
    span = max(finish_times) - start
    return len(finish_times) / span if span > 0 else 0.0


def steady_rate(finish_times: Sequence[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Jobs per second between the lo and hi quantiles of the finish times (the pipeline
    full: no filling at the start, no draining at the end); 0.0 for fewer than 3 jobs."""
    ordered = sorted(finish_times)
    if len(ordered) < 3:
        return 0.0
    i = int(lo * (len(ordered) - 1))
    j = int(round(hi * (len(ordered) - 1)))
    span = ordered[j] - ordered[i]
    return (j - i) / span if span > 0 and j > i else 0.0


def efficiency(rates: dict[int, float]) -> dict[int, float]:
    """Scaling efficiency per node count: rate(n) / (n * rate(1))."""
    base = rates.get(1, 0.0)
    return {n: (r / (n * base) if base else 0.0) for n, r in sorted(rates.items())}


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat's cpu line."""
    with open("/proc/stat") as f:
        return parse_cpu_line(f.readline())


def parse_cpu_line(line: str) -> tuple[float, float]:
    """/proc/stat's aggregate `cpu` line: busy = total - idle - iowait."""
    fields = line.split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"not /proc/stat's cpu line: {line!r}")
    values = [float(v) for v in fields[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest in user)
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)
    return total - idle, total


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The share of the machine's CPU time (all cores) that was busy between two readings."""
    busy = after[0] - before[0]
    total = after[1] - before[1]
    return busy / total if total > 0 else 0.0


def parse_stat(text: str) -> tuple[int, float, float]:
    """/proc/<pid>/stat: (parent pid, CPU ticks of the process, of its reaped children)."""
    fields = text.rsplit(")", 1)[1].split()
    own = int(fields[11]) + int(fields[12])
    return int(fields[1]), float(own), float(int(fields[13]) + int(fields[14]))


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one process, not its children."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())[1] / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def own_cpu_s(root: int, also: str = "") -> float:
    """CPU seconds of `root` and every process below it, plus processes whose command line
    holds `also` (PostgreSQL's, which pg_ctl detaches): this benchmark's load, apart from
    whatever else runs on the machine."""
    stats: dict[int, tuple[int, float, float]] = {}
    picked: set[int] = {root}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stats[int(d.name)] = parse_stat((d / "stat").read_text())
            if also and also in (d / "cmdline").read_bytes().decode(errors="replace"):
                picked.add(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    ticks = sum(stats[p][1] + stats[p][2] for p in descendants(stats, picked))
    return ticks / os.sysconf("SC_CLK_TCK")


def descendants(stats: dict[int, tuple[int, float, float]], roots: set[int]) -> set[int]:
    """The roots (those in `stats`) and every process below them (`stats`: pid -> (ppid, ...))."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = [p for p in roots if p in stats]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def pickup(events: Sequence[job_pb2.JobEvent], killed_at: float) -> dict[str, float]:
    """From a re-run job's events (a Watch replay): seconds from the kill to its re-queue (the
    fault saying its lease expired) and to its second `started` event; -1 where missing."""
    requeued = started = -1.0
    for e in events:
        if e.HasField("fault") and "lease expired" in e.fault.description and requeued < 0:
            requeued = C.ts(e.time) - killed_at
        if e.HasField("started") and e.started.attempt >= 2 and started < 0:
            started = C.ts(e.time) - killed_at
    return {"requeued_s": requeued, "started_s": started}


# ---- PostgreSQL and the service processes ------------------------------------------------


def start_postgres(which: str = "auto") -> C.Postgres:
    """PostgreSQL from Debian's binaries (`make` installs them), else the pgserver wheel's."""
    return C.Postgres(which).start()


STARTED: list[Proc] = []


def _stop_started(*_: object) -> None:
    for p in STARTED:
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()


atexit.register(_stop_started)


class Proc:
    """One `kerneleval_server serve` (the fake engine on PYTHONPATH), in its own folder (its
    state folder `state` there unless given: a node restarted on the same state folder)."""

    def __init__(
        self, root: Path, flags: Sequence[str], *, nvml: str = "none", state: Path | None = None
    ) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port_file = root / "port"
        self.log = root / "service.log"
        self.state = state or root / "state"
        # Never reset a lent GPU: the reset command only records that it was called.
        reset = root / "record_reset.sh"
        reset.write_text(f'#!/bin/sh\necho "reset $*" >> {root / "resets.log"}\n')
        reset.chmod(0o755)
        self.cmd = [
            sys.executable, "-m", "kerneleval_server", "serve",
            "--port", "0", "--port-file", str(self.port_file), "--state-dir", str(self.state),
            "--watchdog", str(C.WATCHDOG), "--nvml", nvml, "--admin-token", TOKEN,
            "--reset-command", f"{reset} {{index}}",
            "--log-file", str(self.log), "--result-cache-hours", "0", "--shutdown-grace-s", "1",
            *flags,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self) -> Proc:
        if not C.WATCHDOG.exists():
            raise SystemExit(f"the watchdog is not built ({C.WATCHDOG}): run `make watchdog`")
        env = C.child_env()
        env["PYTHONPATH"] = os.pathsep.join([str(FRONTEND), env["PYTHONPATH"]])
        err = open(self.root / "stderr", "wb")  # noqa: SIM115 - the child keeps it
        # No preexec_fn (C.Service's die-with-parent): a fork that runs Python in the child
        # while this process's gRPC threads poll once aborted the child (epoll_wait: bad file
        # descriptor). Started services are stopped in `finally` and at exit instead.
        self.proc = subprocess.Popen(
            self.cmd, cwd=C.REPO, env=env, stdout=subprocess.DEVNULL, stderr=err
        )
        err.close()
        STARTED.append(self)
        return self

    def wait_serving(self, timeout: float = 120.0) -> Proc:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            self._check(deadline)
            time.sleep(0.05)
        self.address = f"127.0.0.1:{self.port_file.read_text().strip()}"
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    ok = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if ok == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                self._check(deadline)
                time.sleep(0.1)

    def _check(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise SystemExit(f"{self.cmd[4:]} exited ({self.proc.returncode}):\n{self.tail()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"not serving in time:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        out = ""
        for p in (self.root / "stderr", self.log):
            if p.exists():
                out += "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return out

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def kill_tree(self) -> list[int]:
        """SIGKILL the process and every process below it (its watchdog, zygotes and job
        processes, which start sessions of their own: a machine lost, not a front end that
        crashed and left its watchdog to clean up). All are stopped first (SIGSTOP, looking
        again until no new one appears), so none of them reacts to another's death; the pids
        killed."""
        assert self.proc is not None
        stopped: set[int] = set()
        for _ in range(10):
            stats: dict[int, tuple[int, float, float]] = {}
            for d in Path("/proc").iterdir():
                if d.name.isdigit():
                    try:
                        stats[int(d.name)] = parse_stat((d / "stat").read_text())
                    except (OSError, IndexError, ValueError):
                        continue
            tree = descendants(stats, {self.pid} | stopped)
            if tree <= stopped:
                break
            for pid in tree - stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped |= tree
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        return sorted(stopped)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def gateway(root: Path, url: str) -> Proc:
    return Proc(root / "gateway", ["--role", "gateway", "--store", url])


def node(root: Path, url: str, i: int, workers: int, lease_s: float | None = None) -> Proc:
    flags = ["--role", "node", "--store", url, "--engine", "fe_fake_engine",
             "--workers-per-device", str(workers), "--warm-spare", "false"]  # fmt: skip
    if lease_s is not None:
        flags += ["--lease-seconds", str(lease_s)]
    return Proc(root / f"node{i}", flags)


def stop_all(procs: Sequence[Proc]) -> None:
    threads = [threading.Thread(target=p.stop) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- 1. jobs per second with 1, 2, 4 nodes -------------------------------------------------


def run_batch(address: str, specs: Sequence[kernel_pb2.JobSpec], timeout: float) -> dict[str, Any]:
    """All specs through one RunBatch; per job its finished time (client clock) and verdict."""
    finished: dict[str, float] = {}
    verdicts: dict[str, int] = {}
    attempts: dict[str, int] = {}
    lags: list[float] = []
    requests: queue.Queue[pb.RunBatchRequest | None] = queue.Queue()
    for i, spec in enumerate(specs):
        requests.put(pb.RunBatchRequest(spec=spec, request_tag=str(i)))
    requests.put(None)

    def stream() -> Iterator[pb.RunBatchRequest]:
        while (item := requests.get()) is not None:
            yield item

    start = time.time()
    with grpc.insecure_channel(address) as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        for resp in stub.RunBatch(stream(), timeout=timeout):
            if resp.HasField("error"):
                raise SystemExit(f"RunBatch error: {resp.error}")
            if resp.event.HasField("finished"):
                finished[resp.request_tag] = now = time.time()
                lags.append(now - C.ts(resp.event.time))
                verdicts[resp.request_tag] = resp.event.finished.result.verdict
                attempts[resp.request_tag] = resp.event.finished.attempt_count
    return {"start": start, "finished": finished, "verdicts": verdicts, "attempts": attempts,
            "lags": lags}  # fmt: skip


def scale_run(pg: Any, root: Path, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    url = pg.new_database()
    gw = gateway(root / f"scale{nodes}", url).start()
    ns = [node(root / f"scale{nodes}", url, i, args.workers).start() for i in range(nodes)]
    try:
        for p in [gw, *ns]:
            p.wait_serving()
        time.sleep(1.0)  # the nodes' job processes come up
        count = args.jobs_per_node * nodes
        specs = [time_job(args.sleep_s, i, tag=f"c{i % 4}") for i in range(count)]
        cpu0, own0 = cpu_times(), own_cpu_s(os.getpid(), str(pg.root))
        pcpu0 = {p.pid: proc_cpu_s(p.pid) for p in [gw, *ns]}
        out = run_batch(gw.address, specs, timeout=600)
        cpu1, own1 = cpu_times(), own_cpu_s(os.getpid(), str(pg.root))
        times = list(out["finished"].values())
        ok = sum(1 for v in out["verdicts"].values() if v == job_pb2.VERDICT_OK)
        per_node = {}
        for i, n in enumerate(ns):
            text = n.log.read_text(errors="replace") if n.log.exists() else ""
            per_node[i] = sum(1 for line in text.splitlines() if "job started" in line)
        return {
            "nodes": nodes,
            "jobs": count,
            "ok": ok,
            "wall_s": max(times) - out["start"],
            "rate_per_s": rate(times, out["start"]),
            "steady_rate_per_s": steady_rate(times),
            "cpu_busy": busy_share(cpu0, cpu1),
            "own_cpu_s": own1 - own0,
            "own_cpu_share": (own1 - own0) / ((max(times) - out["start"]) * (os.cpu_count() or 1)),
            "finished_delivery_s": C.summary(out["lags"]),
            "gateway_cpu_s": proc_cpu_s(gw.pid) - pcpu0[gw.pid],
            "nodes_cpu_s": sum(proc_cpu_s(n.pid) - pcpu0[n.pid] for n in ns),
            "jobs_started_per_node": per_node,
        }
    finally:
        stop_all([gw, *ns])


# ---- 2. Submit and Watch latency: PostgreSQL vs SQLite -----------------------------------


def latency_runs(root: Path, pg: Any, count: int) -> list[dict[str, Any]]:
    """`--role all` on SQLite and on PostgreSQL (and a `--role gateway` on PostgreSQL, no
    node: its jobs stay queued), up together; Submits and Watches alternate between them, so
    that whatever else loads the machine loads them alike."""
    flags = ["--engine", "fe_fake_engine", "--workers-per-device", "1", "--warm-spare", "false"]
    services = {
        "SQLite, --role all": Proc(root / "latency-sqlite", ["--role", "all", *flags]),
        "PostgreSQL, --role all": Proc(
            root / "latency-pg", ["--role", "all", "--store", pg.new_database(), *flags]
        ),
        "PostgreSQL, --role gateway": gateway(root / "latency-gw", pg.new_database()),
    }
    try:
        for svc in services.values():
            svc.start()
        for svc in services.values():
            svc.wait_serving()
        channels = {k: grpc.insecure_channel(v.address) for k, v in services.items()}
        stubs = {
            k: kernel_eval_service_pb2_grpc.KernelEvalServiceStub(c) for k, c in channels.items()
        }
        for stub in stubs.values():
            # One long job holds the one worker: every later job stays QUEUED.
            stub.Submit(pb.SubmitRequest(spec=time_job(3600, -1)), timeout=30)
            for i in range(20):  # warm the channel and the store
                stub.Submit(pb.SubmitRequest(spec=time_job(1, 10**6 + i)), timeout=30)
        cpu0 = cpu_times()
        submit: dict[str, list[float]] = {k: [] for k in services}
        watch: dict[str, list[float]] = {k: [] for k in services}
        ids: dict[str, list[str]] = {k: [] for k in services}
        for i in range(count):
            for k, stub in stubs.items():
                t = time.perf_counter()
                job = stub.Submit(pb.SubmitRequest(spec=time_job(1, i)), timeout=30).job
                submit[k].append(time.perf_counter() - t)
                ids[k].append(job.job_id)
        for i in range(count // 2):
            for k, stub in stubs.items():
                t = time.perf_counter()
                call = stub.Watch(pb.WatchRequest(job_id=ids[k][i]), timeout=30)
                next(iter(call))
                watch[k].append(time.perf_counter() - t)
                call.cancel()
        cpu1 = cpu_times()
        for c in channels.values():
            c.close()
        return [
            {
                "store": k,
                "submit_s": C.summary(submit[k]),
                "watch_first_event_s": C.summary(watch[k]),
                "cpu_busy": busy_share(cpu0, cpu1),
            }
            for k in services
        ]
    finally:
        stop_all(list(services.values()))


# ---- 3. a node's death: lease expiry and pickup --------------------------------------------


def running_on(url: str, address: str) -> set[str]:
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT job_id FROM jobs WHERE state = %s AND lease_node IN"
            " (SELECT node_id FROM nodes WHERE address = %s)",
            (job_pb2.JOB_STATE_RUNNING, address),
        ).fetchall()
    return {str(r[0]) for r in rows}


def lease_expiry(url: str, address: str) -> float:
    """The latest lease expiry of the jobs the node at `address` holds."""
    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT MAX(lease_expires) FROM jobs WHERE lease_node IN"
            " (SELECT node_id FROM nodes WHERE address = %s)",
            (address,),
        ).fetchone()
    return float(row[0]) if row and row[0] is not None else time.time() + 10.0


def next_renewal(url: str, address: str, lease_s: float, period: float) -> float:
    """Waits for the node's next lease renewal (its leases' expiry moves); its time."""
    first = lease_expiry(url, address)
    deadline = time.time() + 2 * period + 5
    while time.time() < deadline:
        now = lease_expiry(url, address)
        if now > first + 0.1:
            return now - lease_s
        time.sleep(0.01)
    raise SystemExit("the node did not renew its leases")


def death_trial(
    pg: Any, root: Path, trial: int, args: argparse.Namespace, again: bool = False
) -> dict[str, Any]:
    url = pg.new_database()
    root = root / (f"death{trial}" + ("-again" if again else ""))
    gw = gateway(root, url).start()
    victim = node(root, url, 0, args.workers)
    procs = [gw, victim]
    try:
        gw.wait_serving()
        # Front ends started together beat in step (the gateway would reap the victim's jobs
        # the instant they expire): start the victim out of step with the gateway's heartbeat.
        time.sleep(args.lease_s / 3 * ((0.3 + 0.45 * trial) % 1.0))
        victim.start().wait_serving()
        with grpc.insecure_channel(gw.address) as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            for i in range(args.workers):  # long jobs: they run on the victim when it dies
                stub.Submit(pb.SubmitRequest(spec=time_job(120, trial * 100 + i)), timeout=30)
            deadline = time.monotonic() + 60
            while len(running_on(url, victim.address)) < args.workers:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the victim never ran its jobs:\n{victim.tail()}")
                time.sleep(0.1)
            # The other node, out of step with the victim's heartbeat by a different amount per
            # trial (its beat and the gateway's decide how soon after the expiry a re-queue is).
            time.sleep(args.lease_s / 3 * ((0.15 + 0.55 * trial) % 1.0))
            survivor = node(root, url, 1, args.workers).start()
            procs.append(survivor)
            survivor.wait_serving()
            # Kill at a chosen point of the victim's heartbeat: `phase` seconds after one of
            # its lease renewals (just after one, the lease has all of --lease-seconds left).
            period = args.lease_s / 3
            phase = (trial + 0.1) / args.death_trials * period
            renewed = next_renewal(url, victim.address, args.lease_s, period)
            time.sleep(max(0.0, renewed + phase - time.time()))
            killed = running_on(url, victim.address)
            killed_at = time.time()
            victim.kill()
            # Wait for each job's second start, from the gateway's Watch.
            out: dict[str, dict[str, float]] = {}
            for job_id in sorted(killed):
                events: list[job_pb2.JobEvent] = []
                call = stub.Watch(pb.WatchRequest(job_id=job_id), timeout=args.lease_s * 3 + 30)
                for resp in call:
                    events.append(resp.event)
                    if resp.event.HasField("started") and resp.event.started.attempt >= 2:
                        break
                call.cancel()
                out[job_id] = pickup(events, killed_at)
        return {
            "trial": trial,
            "phase_s": killed_at - renewed,
            "jobs": out,
        }
    finally:
        stop_all(procs)


# ---- main -----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap, smoke=False)
    ap.set_defaults(out=str(C.DEFAULT_OUT / "cpu"))
    ap.add_argument("--nodes", default="1,2,4", help="node counts of the scale-out runs")
    ap.add_argument("--sleep-s", type=float, default=1.0, help="each job's compile and window")
    ap.add_argument("--jobs-per-node", type=int, default=30)
    ap.add_argument("--workers", type=int, default=2, help="job processes per node")
    ap.add_argument("--latency-count", type=int, default=200, help="Submits per store")
    ap.add_argument("--death-trials", type=int, default=6)
    ap.add_argument("--lease-s", type=float, default=10.0, help="the default --lease-seconds")
    ap.add_argument("--skip", default="", help="comma list of: scale, latency, death")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` and atexit stop all
    info = C.machine_info()
    info["loadavg_before"] = os.getloadavg()
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"kerneleval-scale-out-{os.getpid()}"
    pg = start_postgres()
    data: dict[str, Any] = {"args": vars(args)}
    try:
        if "scale" not in skip:
            data["scale"] = []
            for n in [int(x) for x in args.nodes.split(",")]:
                r = scale_run(pg, root, n, args)
                print(f"{n} node(s): {r['jobs']} jobs, {r['rate_per_s']:.2f}/s "
                      f"(steady {r['steady_rate_per_s']:.2f}/s), CPU {r['cpu_busy']:.0%}",
                      flush=True)  # fmt: skip
                data["scale"].append(r)
            rates = {r["nodes"]: r["rate_per_s"] for r in data["scale"]}
            steady = {r["nodes"]: r["steady_rate_per_s"] for r in data["scale"]}
            data["efficiency"] = efficiency(rates)
            data["steady_efficiency"] = efficiency(steady)
        if "latency" not in skip:
            data["latency"] = latency_runs(root, pg, args.latency_count)
            for r in data["latency"]:
                submit_ms = r["submit_s"]["median"] * 1e3
                watch_ms = r["watch_first_event_s"]["median"] * 1e3
                print(f"{r['store']}: Submit p50 {submit_ms:.2f} ms, Watch p50 {watch_ms:.2f} ms")
        if "death" not in skip:
            data["death"] = []
            data["start_failures"] = []
            for trial in range(args.death_trials):
                try:
                    r = death_trial(pg, root, trial, args)
                except SystemExit as failed:  # a process that did not start: once more
                    print(f"death trial {trial}: {failed}; again", flush=True)
                    data["start_failures"].append(str(failed)[-2000:])
                    r = death_trial(pg, root, trial, args, again=True)
                print(f"death trial {trial}: {r['jobs']}", flush=True)
                data["death"].append(r)
    finally:
        pg.stop()
    report(args, info, data)
    return 0


def report(args: argparse.Namespace, info: dict[str, Any], data: dict[str, Any]) -> None:
    ms = 1e3
    tables: list[tuple[str, Sequence[str], Sequence[Sequence[Any]]]] = []
    notes: list[str] = []
    if "scale" in data:
        eff, steady = data["efficiency"], data["steady_efficiency"]
        tables.append((
            f"Jobs per second through one gateway ({args.jobs_per_node} jobs per node, each "
            f"{args.sleep_s:g} s compiling + {args.sleep_s:g} s timing window, {args.workers} "
            f"job processes per node)",
            ["nodes", "jobs", "OK", "wall (s)", "jobs/s", "efficiency", "steady jobs/s",
             "steady efficiency", "finished event to client p50 / p99 (ms)",
             f"bench's CPU (s; share of {info['cpu_count']} cores)", "gateway CPU (s)",
             "nodes CPU (s)", "machine CPU busy"],
            [[r["nodes"], r["jobs"], r["ok"], r["wall_s"], r["rate_per_s"], eff[r["nodes"]],
              r["steady_rate_per_s"], steady[r["nodes"]],
              f"{r['finished_delivery_s']['median'] * ms:.1f} / "
              f"{r['finished_delivery_s']['p99'] * ms:.1f}",
              f"{r['own_cpu_s']:.1f} ({r['own_cpu_share']:.0%})", r["gateway_cpu_s"],
              r["nodes_cpu_s"], f"{r['cpu_busy']:.0%}"] for r in data["scale"]],
        ))  # fmt: skip
        top = max(eff)
        bound = args.workers / ((args.workers + 1) * args.sleep_s)
        notes.append(
            f"Scaling efficiency at {top} nodes: {eff[top]:.2f} (whole run), "
            f"{steady[top]:.2f} (steady part: the 10th to the 90th percentile of finishes); "
            f"target >= 0.8. A node's bound: its {args.workers} job processes compile together "
            f"({args.sleep_s:g} s), then take the device's timing window one at a time "
            f"({args.sleep_s:g} s each); a job process that replaces a finished one is frozen "
            f"with the others while a window is open, so {args.workers} jobs take "
            f"{(args.workers + 1) * args.sleep_s:g} s: {bound:.3f} jobs/s per node "
            f"(measured with 1 node: {data['scale'][0]['rate_per_s']:.3f})."
        )
    if "latency" in data:
        tables.append((
            "Submit and Watch first-event latency, SQLite vs PostgreSQL (same run, the services "
            f"up together, calls alternating; {args.latency_count} sequential Submits of queued "
            "jobs each, then a new Watch on each of half of them: call to first event)",
            ["service", "Submit p50 (ms)", "Submit p99 (ms)", "Watch first event p50 (ms)",
             "Watch first event p99 (ms)", "machine CPU busy"],
            [[r["store"], r["submit_s"]["median"] * ms, r["submit_s"]["p99"] * ms,
              r["watch_first_event_s"]["median"] * ms, r["watch_first_event_s"]["p99"] * ms,
              f"{r['cpu_busy']:.0%}"] for r in data["latency"]],
        ))  # fmt: skip
    if "latency" in data:
        by = {r["store"]: r for r in data["latency"]}
        lite, pgall = by.get("SQLite, --role all"), by.get("PostgreSQL, --role all")
        if lite and pgall:
            d_submit = pgall["submit_s"]["median"] - lite["submit_s"]["median"]
            d_watch = pgall["watch_first_event_s"]["median"] - lite["watch_first_event_s"]["median"]
            notes.append(
                f"PostgreSQL (local, unix socket, fsync off) adds {d_submit * ms:.2f} ms to "
                f"Submit's p50 and {d_watch * ms:.2f} ms to Watch's first event over SQLite "
                "(same machine, same run)."
            )
    if "death" in data:
        rows = []
        worst = 0.0
        for r in data["death"]:
            for job_id, p in r["jobs"].items():
                late = p["requeued_s"] - (args.lease_s - r["phase_s"])
                rows.append([r["trial"], r["phase_s"], job_id[:12], p["requeued_s"], late,
                             p["started_s"]])  # fmt: skip
                worst = max(worst, p["started_s"])
        tables.append((
            f"A node killed (SIGKILL) with {args.workers} running jobs, `--lease-seconds` "
            f"{args.lease_s:g} (default), an idle node beside it: seconds from the kill",
            ["trial", "killed (s after a lease renewal)", "job", "re-queued (lease expired)",
             "of which after the expiry", "started on the other node"],
            rows,
        ))  # fmt: skip
        notes.append(
            f"Node death to its jobs running elsewhere: at most {worst:.1f} s over "
            f"{len(rows)} jobs (target <= 15 s; bound: the lease, {args.lease_s:g} s, plus a "
            f"heartbeat, {args.lease_s / 3:.1f} s: a lease expires {args.lease_s:g} s after its "
            "last renewal, less the time from that renewal to the kill; every gateway's and "
            "node's heartbeat re-queues expired leases, so the re-queue comes at the next beat "
            "of any of them after the expiry; the idle node, NOTIFYed, starts the jobs within "
            "milliseconds)."
        )
    for failed in data.get("start_failures", []):
        notes.append(f"A service process did not start (its trial was run again): {failed}")
    notes.append(
        f"Machine: {info['cpu_count']} CPUs; every front end, node, watchdog, job process and "
        "PostgreSQL on it. 'bench's CPU' is the CPU time of this benchmark's processes (the "
        "client, gateway, nodes, watchdogs, job processes, PostgreSQL) during the measurement "
        "and its share of all cores; 'machine CPU busy' is the whole machine's (/proc/stat), "
        "whatever else ran on it (where it is well above the bench's share, something else "
        "ran on the machine)."
    )
    C.write_results(args.out, NAME, "Scale-out on one PostgreSQL store (issue 18)", info,
                    data, tables, notes)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
