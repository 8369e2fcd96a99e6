"""The GPU proof of issue 18: a gateway and one node per GPU on one PostgreSQL store, KernelBench
level 1 through the gateway, one node killed mid-run and replaced.

One PostgreSQL server (Debian's binaries, else the pgserver wheel's: _common.Postgres; as root
it runs as an unprivileged user), one `--role gateway` and one `--role node` per GPU
(`--devices N`: each node owns exactly one GPU), all real `kerneleval_server serve` processes
on one database. Every level-1 problem of --kernelbench (default $KERNELBENCH, else
build/kernelbench or ../shared/kernelbench) becomes jobs, --count in all (the problems in turn,
each job distinct by a comment): the problem's own Model as its ModelNew (must come out OK),
or for the --wrong problems a ModelNew that adds 1 to the Model's output (must come out
INCORRECT), KernelBench's options (seed 42, 1 correctness trial, 10 timed after 3 warm-ups),
all sent through one RunBatch stream of the gateway.
Once --kill-after of them finished, the node of --kill-device is killed with SIGKILL, its whole
process tree (front end, watchdog, zygotes, job processes: a machine lost), and a replacement
node starts on the same GPU and the same state folder, as an operator would; the nodes' short
--lease-seconds lets the dead node's jobs run again soon. Checked, each a row of the result
(exit 1 if any fails):
  - every job finished exactly once (one `finished` event each on the stream; the store holds
    each in a terminal state: none lost, none stuck);
  - each correct job OK, each planted wrong one INCORRECT;
  - the jobs that ran on the killed node were re-queued when its lease expired and finished
    elsewhere, in their second attempt (attempt_count 2), and no other job ran twice;
  - jobs ran on every node (the node that finished each job: the store's lease holder);
  - Watch through the gateway replays every phase (queued, started, compiling, validating,
    profiling, finished) of a job of each node, and of the retried jobs both attempts;
  - the replacement node came up and registered.
Measured: the time from the kill to the re-queue and to the killed jobs' second start, the
batch's wall time, jobs and verdicts per node.

    PYTHONPATH=server:clients/python/src python3 bench/gpu_scale_out.py --out DIR
    ... --devices 0,1     # the GPUs, one node each (default: every GPU nvidia-smi lists)
    ... --cpu-smoke       # no GPU: nodes on fake devices 0 and 1 (no NVML, CPU torch), a dozen
                          # problems with their sizes capped at 64

Results: <out>/gpu_scale_out.json and .md (gpu_scale_out_smoke.* with --cpu-smoke).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import bench_scale_out as S  # noqa: E402
import grpc  # noqa: E402
from bench_kernelbench import problem_key, scaled  # noqa: E402
from bench_kernelbench_run import model_new, problem_id  # noqa: E402
from kerneleval.kernelbench import job_from_sources, kernelbench_options  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2  # noqa: E402
from kerneleval.v1 import kernel_eval_service_pb2 as pb  # noqa: E402

KERNELBENCH = os.environ.get("KERNELBENCH", "")
NAME = "gpu_scale_out"
DEFAULT_WRONG = "1,19,23,40,95"
# --cpu-smoke: problems that run in a second or two on a CPU with their sizes capped at 64.
SMOKE_PROBLEMS = (1, 2, 12, 19, 20, 21, 23, 24, 40, 95, 96, 100)
PHASE_NAMES = {
    job_pb2.PHASE_COMPILING: "compiling",
    job_pb2.PHASE_VALIDATING: "validating",
    job_pb2.PHASE_PROFILING: "profiling",
}
FULL_LIFE = ("queued", "started", "compiling", "validating", "profiling", "finished")
TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)


# ---- the jobs -------------------------------------------------------------------------------


def select_problems(folder: Path, limit: int, smoke: bool) -> list[Path]:
    """The level-1 problem files in problem order; the smoke set with --cpu-smoke; the first
    `limit` (0: all)."""
    problems = sorted((p for p in folder.glob("*.py") if problem_id(p) is not None),
                      key=problem_key)  # fmt: skip
    if smoke:
        problems = [p for p in problems if problem_id(p) in SMOKE_PROBLEMS]
    return problems[:limit] if limit else problems


def plan(problems: Sequence[Path], count: int, wrong: set[int]) -> list[dict[str, Any]]:
    """`count` jobs, the problems in turn; planted wrong where the problem is in `wrong`."""
    out = []
    for i in range(count):
        path = problems[i % len(problems)]
        pid = problem_id(path)
        out.append({"index": i, "problem": path.stem, "pid": pid, "wrong": pid in wrong,
                    "round": i // len(problems)})  # fmt: skip
    return out


def expected_verdict(job: dict[str, Any]) -> int:
    return job_pb2.VERDICT_INCORRECT if job["wrong"] else job_pb2.VERDICT_OK


def job_spec(
    job: dict[str, Any], reference: str, tag: str, timeout_s: int
) -> kernel_pb2.JobSpec:
    """A KernelBench-style job: the ModelNew (correct or planted wrong, distinct by a comment at
    its end) against the problem file, KernelBench's options, `timeout_s` per job."""
    kernel = model_new(reference, job["wrong"]) + f"\n# gpu_scale_out {tag} job {job['index']}\n"
    spec = job_from_sources(
        kernel, reference,
        kernel_filename=f"level_1_problem_{job['pid']}_sample_0_kernel.py",
        reference_filename=f"{job['problem']}.py",
        options=kernelbench_options(), client_tag="gpu-scale-out",
    )  # fmt: skip
    spec.options.timeout.seconds = timeout_s
    return spec


# ---- pure checks on events (tests/bench/test_gpu_scale_out.py) -------------------------------


def event_kind(e: job_pb2.JobEvent) -> str:
    """`queued`, `started`, `compiling`/`validating`/`profiling` (phase events), `progress`,
    `log`, `fault`, `finished`."""
    kind = e.WhichOneof("kind") or ""
    if kind == "phase":
        return PHASE_NAMES.get(e.phase.phase, "phase")
    return kind


def life(events: Sequence[job_pb2.JobEvent]) -> list[list[str]]:
    """A job's events split at each `started` into attempts: the kinds (log and progress
    left out) before the first start, then of each attempt."""
    out: list[list[str]] = [[]]
    for e in events:
        kind = event_kind(e)
        if kind in ("log", "progress"):
            continue
        if kind == "started":
            out.append([])
        out[-1].append(kind)
    return out


def missing_phases(events: Sequence[job_pb2.JobEvent], ok: bool, retried: bool) -> list[str]:
    """What a finished job's event log lacks: queued before the first start; in its last
    attempt started, compiling, validating, profiling (an OK job only: a wrong one ends in
    validation), finished; a retried job also its first attempt's start, the fault saying its
    node's lease expired, its re-queue and a second start with attempt 2. [] when complete."""
    parts = life(events)
    missing: list[str] = []
    if "queued" not in parts[0]:
        missing.append("queued")
    last = parts[-1] if len(parts) > 1 else []
    wanted = ["started", "compiling", "validating", "finished"]
    if ok:
        wanted.insert(3, "profiling")
    missing += [k for k in wanted if k not in last]
    if retried:
        starts = [e.started.attempt for e in events if e.HasField("started")]
        if len(starts) < 2 or starts[-1] < 2:
            missing.append("a second start (attempt 2)")
        lost = [e for e in events if e.HasField("fault") and "lease expired" in e.fault.description]
        if not lost:
            missing.append("the fault: lease expired")
        requeued = any("queued" in p for p in parts[1:-1])
        if not requeued:
            missing.append("queued again")
    return missing


def lease_lost(events: Sequence[job_pb2.JobEvent]) -> bool:
    """The job's node lost its lease while the job ran (the fault the store's requeue writes);
    a re-run alone after running out of GPU memory is another attempt on the same node."""
    return any(e.HasField("fault") and "lease expired" in e.fault.description for e in events)


def finished_events(events: Sequence[job_pb2.JobEvent]) -> int:
    return sum(1 for e in events if e.HasField("finished"))


# ---- the batch ----------------------------------------------------------------------------


class Batch(threading.Thread):
    """One RunBatch stream of all the specs through the gateway, read in this thread: every
    event per request tag, and when (this machine's clock) each job's finished event came."""

    def __init__(self, address: str, specs: Sequence[kernel_pb2.JobSpec], timeout: float):
        super().__init__(daemon=True)
        self.address = address
        self.specs = specs
        self.timeout = timeout
        self.lock = threading.Lock()
        self.events: dict[int, list[job_pb2.JobEvent]] = {}
        self.finished_at: dict[int, float] = {}
        self.refused: list[str] = []
        self.error = ""
        self.call: Any = None
        self.started_at = 0.0
        self.ended_at = 0.0

    def run(self) -> None:
        requests = [
            pb.RunBatchRequest(spec=s, request_tag=str(i)) for i, s in enumerate(self.specs)
        ]
        self.started_at = time.time()
        try:
            with grpc.insecure_channel(
                self.address, options=[("grpc.max_receive_message_length", 64 * 2**20)]
            ) as ch:
                stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
                self.call = stub.RunBatch(iter(requests), timeout=self.timeout)
                for resp in self.call:
                    i = int(resp.request_tag)
                    with self.lock:
                        if resp.HasField("error"):
                            self.refused.append(f"{i}: {resp.error.message}")
                            continue
                        self.events.setdefault(i, []).append(resp.event)
                        if resp.event.HasField("finished") and i not in self.finished_at:
                            self.finished_at[i] = time.time()
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - reported with the results
            self.error = repr(e)
        finally:
            self.ended_at = time.time()

    def done(self) -> int:
        with self.lock:
            return len(self.finished_at) + len(self.refused)

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()


# ---- the store --------------------------------------------------------------------------------


def query(url: str, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url) as conn:
        return list(conn.execute(sql, args).fetchall())


def registered(url: str, address: str, known: set[str], timeout: float = 60.0) -> str:
    """The node id the node at `address` registered (not one of `known`); '' if none came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for node_id, addr in query(url, "SELECT node_id, address FROM nodes"):
            if addr == address and node_id not in known:
                return str(node_id)
        time.sleep(0.2)
    return ""


def held(url: str, node_id: str, state: int) -> set[str]:
    rows = query(url, "SELECT job_id FROM jobs WHERE lease_node = %s AND state = %s",
                 (node_id, state))  # fmt: skip
    return {str(r[0]) for r in rows}


def stored_jobs(url: str) -> dict[str, dict[str, Any]]:
    """Every job of the store: its record, and the node that held it last (that ran it)."""
    out = {}
    for job_id, state, lease_node, blob in query(
        url, "SELECT job_id, state, lease_node, job FROM jobs"
    ):
        job = job_pb2.Job.FromString(bytes(blob))
        out[str(job_id)] = {"state": int(state), "node_id": lease_node or "", "job": job}
    return out


def workers_up(address: str) -> dict[int, int]:
    """Job-taking workers with a process, per device, as the gateway's ListDevices shows them."""
    try:
        with C.Client(address, admin_token=S.TOKEN, timeout=10) as c:
            devices = c.list_devices()
    except grpc.RpcError:
        return {}
    return {d.index: sum(1 for w in d.workers if not w.spare and w.pid) for d in devices}


def kernelbench_folder(given: str) -> Path:
    """The KernelBench folder: --kernelbench, $KERNELBENCH, build/kernelbench (where the GPU
    runs copy it) or ../shared/kernelbench, the first with a level1/."""
    candidates = [given, KERNELBENCH, str(C.REPO / "build" / "kernelbench"),
                  str(C.REPO.parent / "shared" / "kernelbench")]  # fmt: skip
    for c in candidates:
        if c and (Path(c) / "level1").is_dir():
            return Path(c)
    raise SystemExit(f"no level1/ under any of {[c for c in candidates if c]}: --kernelbench")


def watch(address: str, job_id: str, timeout: float = 60.0) -> list[job_pb2.JobEvent]:
    """A finished job's whole event log, replayed by the gateway's Watch."""
    out: list[job_pb2.JobEvent] = []
    with grpc.insecure_channel(address) as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        for resp in stub.Watch(pb.WatchRequest(job_id=job_id, after_sequence=0), timeout=timeout):
            out.append(resp.event)
            if resp.event.HasField("finished"):
                break
    return out


# ---- main -------------------------------------------------------------------------------------


class Run:
    """The processes of one run: PostgreSQL, the gateway, the nodes (by label)."""

    def __init__(self, args: argparse.Namespace, devices: list[int]) -> None:
        self.args = args
        self.devices = devices
        self.root = Path(tempfile.mkdtemp(prefix="kerneleval-gpu-scale-out-"))
        self.pg: C.Postgres | None = None
        self.url = ""
        self.gateway: S.Proc | None = None
        self.nodes: dict[str, S.Proc] = {}
        self.node_ids: dict[str, str] = {}  # label -> node id
        self.device_of: dict[str, int] = {}  # label -> GPU

    def node_flags(self, device: int) -> list[str]:
        a = self.args
        flags = ["--role", "node", "--store", self.url, "--devices", str(device),
                 "--workers-per-device", str(a.workers_per_device),
                 "--lease-seconds", f"{a.lease_seconds:g}", "--build-processes", "0"]  # fmt: skip
        if a.cpu_smoke:
            flags += ["--spare-count", "1"]
        return flags

    def node(self, label: str, device: int, state: Path | None = None) -> S.Proc:
        nvml = "none" if self.args.cpu_smoke else "real"
        proc = S.Proc(self.root / label, self.node_flags(device), nvml=nvml, state=state)
        self.nodes[label] = proc
        self.device_of[label] = device
        return proc

    def stop(self) -> None:
        procs = [p for p in [self.gateway, *self.nodes.values()] if p is not None]
        S.stop_all(procs)
        if self.pg is not None:
            self.pg.stop()

    def tails(self) -> dict[str, str]:
        out = {}
        for label, p in [("gateway", self.gateway), *self.nodes.items()]:
            if p is not None:
                out[label] = p.tail(15)[-3000:]
        return out


def label_for(device: int, n: int = 0) -> str:
    return f"gpu{device}" + ("" if n == 0 else f"-replacement{n if n > 1 else ''}")


def default_devices(smoke: bool) -> str:
    if smoke:
        return "0,1"
    found = [g["index"] for g in C.gpus()]
    if not found:
        raise SystemExit("no GPU found by nvidia-smi: pass --devices, or --cpu-smoke")
    return ",".join(found)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--devices", default="", help="GPUs, one node each (default: all; smoke 0,1)")
    ap.add_argument("--problems", type=int, default=0, help="the first N level-1 problems (0 all)")
    ap.add_argument("--count", type=int, default=0, help="jobs (default 2 a problem; smoke 8)")
    ap.add_argument("--kernelbench", default="", help="KernelBench folder (default $KERNELBENCH)")
    ap.add_argument("--wrong", default=DEFAULT_WRONG, help="problems given a wrong ModelNew")
    ap.add_argument("--workers-per-device", type=int, default=0, help="default 8 (smoke 2)")
    ap.add_argument("--lease-seconds", type=float, default=10.0, help="the nodes' lease")
    ap.add_argument("--kill-after", type=float, default=1 / 3, help="share of jobs finished")
    ap.add_argument("--kill-device", type=int, default=None, help="default: the first device")
    ap.add_argument("--timeout-s", type=int, default=0, help="each job's (default 60; smoke 120)")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="the whole run's wall time at most: the batch stops waiting in time to "
                    "report (default 500; smoke 1200)")  # fmt: skip
    ap.add_argument("--postgres", default="auto",
                    help="auto, system (Debian's), pgserver (the wheel's) or a bin folder")
    args = ap.parse_args()
    t_start = time.monotonic()
    smoke = args.cpu_smoke
    if args.out == str(C.DEFAULT_OUT):
        args.out = str(C.DEFAULT_OUT / ("cpu" if smoke else "gpu"))
    args.workers_per_device = args.workers_per_device or (2 if smoke else 8)
    args.timeout_s = args.timeout_s or (120 if smoke else 60)
    args.budget_s = args.budget_s or (1200.0 if smoke else 500.0)
    devices = [int(d) for d in (args.devices or default_devices(smoke)).split(",") if d.strip()]
    if len(devices) < 2:
        raise SystemExit(f"--devices {devices}: two or more, one node each")
    victim_device = devices[0] if args.kill_device is None else args.kill_device
    if victim_device not in devices:
        raise SystemExit(f"--kill-device {victim_device} is not one of --devices {devices}")
    kb = kernelbench_folder(args.kernelbench)
    problems = select_problems(kb / "level1", args.problems, smoke)
    if not problems:
        raise SystemExit("no problems selected")
    count = args.count or (8 if smoke else 2) * len(problems)
    wrong = {int(x) for x in args.wrong.split(",") if x.strip()}
    planned = plan(problems, count, wrong)
    sources = {p.stem: scaled(p.read_text(), 64) if smoke else p.read_text() for p in problems}
    tag = f"{time.time_ns()}"
    specs = [job_spec(j, sources[j["problem"]], tag, args.timeout_s) for j in planned]
    # SIGTERM/SIGINT (run_gpu.sh's time limit): `finally` stops every process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    info = C.machine_info()
    run = Run(args, devices)
    data: dict[str, Any] = {
        "args": vars(args), "devices": devices, "victim_device": victim_device,
        "kernelbench": str(kb), "problems": [p.stem for p in problems], "jobs": count,
        "wrong_planted": sorted(wrong & {problem_id(p) for p in problems}),
    }  # fmt: skip
    try:
        scenario(data, run, args, specs, planned, victim_device, t_start)
    except (SystemExit, Exception, KeyboardInterrupt) as failed:  # noqa: BLE001 - reported
        print(f"the run failed: {failed!r}", flush=True)
        data["error"] = repr(failed)[-4000:]
        data["service_tails"] = run.tails()
        data["checks"] = data.get("checks") or []
        data["checks"].append({"check": "the run went through", "ok": False,
                               "detail": repr(failed)[-300:]})  # fmt: skip
    finally:
        run.stop()
        shutil.rmtree(run.root, ignore_errors=True)
    checks = data["checks"]
    report(args, info, data)
    return 0 if checks and all(c["ok"] for c in checks) else 1


def scenario(
    out: dict[str, Any],
    run: Run,
    args: argparse.Namespace,
    specs: list[kernel_pb2.JobSpec],
    planned: list[dict[str, Any]],
    victim_device: int,
    t_start: float,
) -> None:
    """Runs it all, filling `out` as it goes (what it got so far is reported if it fails)."""
    count = len(specs)
    run.pg = S.start_postgres(args.postgres)
    out["postgres"] = {"source": run.pg.source, "bin": str(run.pg.bindir),
                       "version": run.pg.version(), "user": run.pg.user or "(this user)"}
    print(f"PostgreSQL: {out['postgres']}", flush=True)
    run.url = run.pg.new_database()
    run.gateway = S.gateway(run.root, run.url).start()
    for d in run.devices:
        run.node(label_for(d), d).start()
    t0 = time.monotonic()
    for label, p in [("gateway", run.gateway), *run.nodes.items()]:
        p.wait_serving(timeout=240)
        print(f"{label} serving at {p.address} ({time.monotonic() - t0:.1f} s)", flush=True)
    for label, p in run.nodes.items():
        run.node_ids[label] = registered(run.url, p.address, set(run.node_ids.values()))
        if not run.node_ids[label]:
            raise SystemExit(f"{label} did not register in the store:\n{p.tail()}")
    # Every node's job processes up (the gateway's ListDevices, a heartbeat late), or go on.
    want = args.workers_per_device
    deadline = time.monotonic() + 240
    up: dict[int, int] = {}
    while time.monotonic() < deadline:
        up = workers_up(run.gateway.address)
        if all(up.get(d, 0) >= want for d in run.devices):
            break
        time.sleep(1.0)
    out["startup_s"] = time.monotonic() - t0
    out["workers_up_at_start"] = {str(k): v for k, v in up.items()}
    print(f"nodes ready in {out['startup_s']:.1f} s; job processes {up}", flush=True)

    # The batch, and the kill once --kill-after of it finished.
    batch_deadline = t_start + args.budget_s - 45
    batch = Batch(run.gateway.address, specs, timeout=max(60.0, batch_deadline - time.monotonic()))
    batch.start()
    threshold = max(1, math.ceil(args.kill_after * count))
    victim_label = label_for(victim_device)
    victim = run.nodes[victim_label]
    victim_id = run.node_ids[victim_label]
    kill: dict[str, Any] = {"node": victim_label, "node_id": victim_id}
    while batch.is_alive() and batch.done() < threshold and time.monotonic() < batch_deadline:
        time.sleep(0.05)
    # Kill while it runs jobs (it nearly always does: it is one of two busy nodes).
    wait_running = time.monotonic() + 30
    while not held(run.url, victim_id, job_pb2.JOB_STATE_RUNNING):
        if time.monotonic() > wait_running or not batch.is_alive():
            break
        time.sleep(0.02)
    killed_at = time.time()
    kill["pids"] = len(victim.kill_tree())
    kill["finished_before"] = batch.done()
    kill["at_s"] = killed_at - batch.started_at
    # What the dead node held as it died: its running jobs (they must run again elsewhere) and
    # the queued ones it had taken and not started (they go back as they were).
    killed_jobs = held(run.url, victim_id, job_pb2.JOB_STATE_RUNNING)
    kill["running"] = sorted(killed_jobs)
    kill["taken_not_started"] = sorted(held(run.url, victim_id, job_pb2.JOB_STATE_QUEUED))
    print(f"killed {victim_label} ({kill['pids']} processes) after {kill['finished_before']} "
          f"jobs, at {kill['at_s']:.1f} s: {len(killed_jobs)} running, "
          f"{len(kill['taken_not_started'])} taken and not started", flush=True)  # fmt: skip
    # The operator starts a node on that GPU again, on the same state folder.
    replacement_label = label_for(victim_device, 1)
    replacement = run.node(replacement_label, victim_device, state=victim.state)
    replacement_ok = ""
    try:
        replacement.start().wait_serving(timeout=240)
        kill["replacement_serving_s"] = time.time() - killed_at
        run.node_ids[replacement_label] = registered(
            run.url, replacement.address, set(run.node_ids.values())
        )
        if not run.node_ids[replacement_label]:
            replacement_ok = "it did not register in the store"
        kill["replacement_registered_s"] = time.time() - killed_at
        print(f"{replacement_label} serving {kill['replacement_serving_s']:.1f} s after the "
              "kill", flush=True)  # fmt: skip
    except SystemExit as failed:
        replacement_ok = str(failed)[-1500:]
        print(f"the replacement node failed: {replacement_ok}", flush=True)

    interrupted = ""
    try:
        while batch.is_alive() and time.monotonic() < batch_deadline:
            batch.join(0.5)
    except KeyboardInterrupt:
        interrupted = "interrupted (SIGINT)"
    if batch.is_alive():
        interrupted = interrupted or f"the batch's deadline ({args.budget_s:g} s budget)"
        batch.cancel()
        batch.join(10)
    wall = (batch.ended_at or time.time()) - batch.started_at
    print(f"batch: {batch.done()} of {count} in {wall:.1f} s {interrupted}", flush=True)
    out["batch"] = {"wall_s": wall, "finished": len(batch.finished_at),
                    "refused": batch.refused, "error": batch.error,
                    "stopped_early": interrupted}  # fmt: skip

    # What the store says, and each job's replay through the gateway's Watch.
    stored = stored_jobs(run.url)
    label_of = {node_id: label for label, node_id in run.node_ids.items() if node_id}
    by_tag: dict[int, str] = {}
    for i, events in batch.events.items():
        if events:
            by_tag[i] = events[0].job_id
    jobs: list[dict[str, Any]] = []
    for want in planned:
        i = want["index"]
        job_id = by_tag.get(i, "")
        rec = stored.get(job_id)
        events = batch.events.get(i, [])
        row = {**want, "job_id": job_id, "finished_events": finished_events(events),
               "state": job_pb2.JobState.Name(rec["state"]) if rec else "absent",
               "verdict": job_pb2.Verdict.Name(rec["job"].result.verdict) if rec else "none",
               "expected": job_pb2.Verdict.Name(expected_verdict(want)),
               "attempts": rec["job"].attempt_count if rec else 0,
               "device": rec["job"].device_index if rec else -9,
               "node": label_of.get(rec["node_id"], rec["node_id"] or "none") if rec else "none",
               "killed": job_id in killed_jobs,
               "lease_lost": lease_lost(events),
               "ran_alone": any("to itself" in e.log.text for e in events)}  # fmt: skip
        if rec is not None and row["verdict"] != row["expected"]:
            r = rec["job"].result
            row["why"] = (r.error.message or r.compilation_error or r.validation_error
                          or r.fault.description or rec["job"].state_reason)[:300]  # fmt: skip
        if row["killed"]:
            row["pickup"] = S.pickup(events, killed_at)
        jobs.append(row)
    out["jobs_detail"] = jobs
    out["store_jobs"] = len(stored)
    out["store_unfinished"] = sum(1 for r in stored.values() if r["state"] not in TERMINAL)

    watched: dict[str, list[str]] = {}
    samples: list[tuple[str, dict[str, Any]]] = []
    for label in run.nodes:
        mine = [j for j in jobs if j["node"] == label and not j["killed"]
                and j["verdict"] == "VERDICT_OK"]  # fmt: skip
        if mine:
            samples.append((label, mine[0]))
    samples += [("retried", j) for j in jobs if j["killed"]][:8]
    for what, j in samples:
        if j["state"] not in ("JOB_STATE_DONE", "JOB_STATE_FAILED"):
            watched[f"{what} {j['job_id'][:12]} ({j['problem']})"] = [f"unfinished: {j['state']}"]
            continue
        try:
            events = watch(run.gateway.address, j["job_id"], timeout=15)
            gaps = missing_phases(events, j["verdict"] == "VERDICT_OK", j["killed"])
            watched[f"{what} {j['job_id'][:12]} ({j['problem']})"] = gaps
        except grpc.RpcError as e:
            watched[f"{what} {j['job_id'][:12]}"] = [f"Watch failed: {e.code().name}"]
    out["watch"] = watched
    out["kill"] = kill
    out["node_ids"] = run.node_ids
    out["checks"] = checks(out, jobs, kill, run, replacement_ok, count)
    if not all(c["ok"] for c in out["checks"]):
        out["service_tails"] = run.tails()


def checks(
    out: dict[str, Any],
    jobs: list[dict[str, Any]],
    kill: dict[str, Any],
    run: Run,
    replacement_error: str,
    count: int,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        rows.append({"check": name, "ok": bool(ok), "detail": detail})

    once = [j for j in jobs if j["finished_events"] == 1]
    dup = [j["index"] for j in jobs if j["finished_events"] > 1]
    lost = [j["index"] for j in jobs if j["finished_events"] == 0]
    check("every job finished exactly once (one finished event each)",
          len(once) == count,
          f"{len(once)} of {count}; none: {lost[:10]}; more than once: {dup[:10]}"
          + (f"; refused: {out['batch']['refused'][:3]}" if out["batch"]["refused"] else "")
          + (f"; stream: {out['batch']['error']}" if out["batch"]["error"] else ""))  # fmt: skip
    terminal = [j for j in jobs if j["state"] in ("JOB_STATE_DONE",)]
    check("the store holds every job, each DONE; none queued or running",
          out["store_jobs"] == count and len(terminal) == count and not out["store_unfinished"],
          f"{out['store_jobs']} jobs stored, {len(terminal)} DONE, "
          f"{out['store_unfinished']} unfinished; "
          f"{dict(Counter(j['state'] for j in jobs))}")  # fmt: skip
    bad = [f"{j['problem']}#{j['index']}: {j['verdict']} ({j.get('why', '')[:120]})"
           for j in jobs if j["verdict"] != j["expected"]]  # fmt: skip
    ok_n = sum(1 for j in jobs if not j["wrong"])
    check("each correct job OK, each planted wrong one INCORRECT", not bad,
          f"{ok_n} correct, {count - ok_n} wrong planted; not as planted: {len(bad)} "
          f"{bad[:6]}")  # fmt: skip
    killed = [j for j in jobs if j["killed"]]
    victim = kill["node"]
    retried_ok = [j for j in killed if j["attempts"] >= 2 and j["node"] != victim
                  and j["lease_lost"] and j["verdict"] == j["expected"]]  # fmt: skip
    check("the killed node's running jobs ran again elsewhere (attempt 2 or later) and "
          "finished as planted", bool(killed) and len(retried_ok) == len(killed),
          f"{len(killed)} running on {victim} when it died; {len(retried_ok)} finished in "
          f"a later attempt on {sorted({j['node'] for j in killed})}")  # fmt: skip
    moved = [j["index"] for j in jobs if j["lease_lost"] and not j["killed"]]
    alone = sum(1 for j in jobs if j["ran_alone"])
    check("no other job was taken from its node (lease expired)", not moved,
          f"others: {moved[:10]}; re-run alone on their node after running out of GPU memory "
          f"(the same attempt, not a move): {alone}")  # fmt: skip
    per_node = Counter(j["node"] for j in jobs)
    first = [label_for(d) for d in run.devices]
    check("jobs ran on every node", all(per_node.get(n, 0) > 0 for n in first),
          ", ".join(f"{n}: {c}" for n, c in sorted(per_node.items())))  # fmt: skip
    gpu = run.device_of
    elsewhere = [f"{j['index']}: {j['node']} ran it on device {j['device']}" for j in jobs
                 if j["node"] in gpu and j["device"] != gpu[j["node"]]]  # fmt: skip
    check("each node ran its jobs on its own GPU only (the jobs' device_index)", not elsewhere,
          f"nodes' GPUs: {gpu}; otherwise: {elsewhere[:5] or 'none'}")  # fmt: skip
    gaps = {k: v for k, v in out["watch"].items() if v}
    nodes_seen = {k.split()[0] for k in out["watch"]}
    check("Watch through the gateway replays every phase, a job of each node and the retried "
          "jobs", not gaps and set(first) <= nodes_seen and (not killed or "retried" in nodes_seen),
          f"{len(out['watch'])} jobs watched ({', '.join(sorted(nodes_seen))}); "
          f"missing: {gaps if gaps else 'none'}")  # fmt: skip
    starts = [j["pickup"]["started_s"] for j in killed if "pickup" in j]
    check("kill -> the killed jobs started again: measured for each",
          bool(starts) and min(starts) >= 0,
          f"{len([s for s in starts if s >= 0])} of {len(killed)}; max "
          f"{max(starts) if starts else -1:.1f} s (lease {run.args.lease_seconds:g} s)",
          )  # fmt: skip
    check("the replacement node came up on the same GPU and registered", not replacement_error,
          replacement_error[-300:] or f"serving {kill.get('replacement_serving_s', -1):.1f} s "
          "after the kill")  # fmt: skip
    return rows


def report(args: argparse.Namespace, info: dict[str, Any], data: dict[str, Any]) -> None:
    jobs = data.get("jobs_detail", [])
    kill = data.get("kill", {})
    gpus = {int(g["index"]): g["name"] for g in info.get("gpus", []) if g["index"].isdigit()}
    node_rows = []
    for label, node_id in data.get("node_ids", {}).items():
        mine = [j for j in jobs if j["node"] == label]
        verdicts = Counter(j["verdict"].removeprefix("VERDICT_") for j in mine)
        device = int(label.split("-")[0].removeprefix("gpu"))
        node_rows.append([
            label, f"{device} ({gpus.get(device, 'fake' if args.cpu_smoke else '?')})",
            node_id[-8:] if node_id else "-", len(mine), verdicts.get("OK", 0),
            verdicts.get("INCORRECT", 0),
            sum(v for k, v in verdicts.items() if k not in ("OK", "INCORRECT")),
            sum(1 for j in mine if j["attempts"] >= 2),
            "killed" if label == kill.get("node") else "",
        ])  # fmt: skip
    starts = [j["pickup"]["started_s"] for j in jobs if j.get("pickup")]
    requeues = [j["pickup"]["requeued_s"] for j in jobs if j.get("pickup")]
    batch = data.get("batch", {})
    summary = [
        ["jobs (problems x rounds)", f"{data['jobs']} ({len(data['problems'])} problems)"],
        ["batch wall time (s)", batch.get("wall_s", 0.0)],
        ["node start-up (s)", data.get("startup_s", 0.0)],
        ["killed", f"{kill.get('node', '-')} at {kill.get('at_s', 0.0):.1f} s, after "
                   f"{kill.get('finished_before', 0)} jobs finished ({kill.get('pids', 0)} "
                   "processes)"],
        ["running on it / taken, not started", f"{len(kill.get('running', []))} / "
                                               f"{len(kill.get('taken_not_started', []))}"],
        ["kill -> re-queued (s): median / max",
         f"{statistics.median(requeues):.2f} / {max(requeues):.2f}" if requeues else "-"],
        ["kill -> running again (s): median / max",
         f"{statistics.median(starts):.2f} / {max(starts):.2f}" if starts else "-"],
        ["kill -> replacement serving (s)", kill.get("replacement_serving_s", "-")],
        ["PostgreSQL", f"{data.get('postgres', {}).get('version', '?')} "
                       f"({data.get('postgres', {}).get('source', '?')})"],
    ]  # fmt: skip
    check_rows = [["pass" if c["ok"] else "FAIL", c["check"], c["detail"]]
                  for c in data.get("checks", [])]  # fmt: skip
    where = "fake devices, CPU (smoke)" if args.cpu_smoke else f"GPUs {data['devices']}"
    tables = [
        (f"Per node ({where}; {args.workers_per_device} job processes each, "
         f"--lease-seconds {args.lease_seconds:g})",
         ["node", "GPU", "node id", "jobs finished", "OK", "INCORRECT", "other", "retried here",
          ""], node_rows),
        ("The run", ["", ""], summary),
        ("Checks", ["", "check", "detail"], check_rows),
    ]  # fmt: skip
    notes = [
        "One gateway and one node per GPU (`--role gateway`/`node`, `--devices N` each) on one "
        "PostgreSQL database; every job sent through one RunBatch stream of the gateway.",
        "Killed: SIGKILL to the node's whole process tree (front end, watchdog, zygotes, job "
        "processes), all stopped first; the replacement is a new node on the same GPU and state "
        "folder. 'kill -> running again' is to each killed job's second `started` event.",
        f"Jobs: the problem's Model as its ModelNew (OK expected), planted wrong for problems "
        f"{data.get('wrong_planted')} (adds 1: INCORRECT expected); KernelBench's options, "
        f"timeout {args.timeout_s} s each.",
    ]
    if args.cpu_smoke:
        notes.append("CPU smoke run: problem sizes capped at 64, CPU torch, no NVML.")
    if batch.get("stopped_early"):
        notes.append(f"The batch stopped early: {batch['stopped_early']}.")
    name = NAME + ("_smoke" if args.cpu_smoke else "")
    title = "Scale-out on GPUs (issue 18): a gateway and a node per GPU, one node killed"
    C.write_results(args.out, name, title, info, data, tables, notes)


if __name__ == "__main__":
    sys.exit(main())
