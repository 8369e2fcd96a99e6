"""Probe: KernelBench level 1 through the CLI (as bench_kernelbench_run.py runs it) with a
deadline; then every job's state, for each one not finished the last events it logged (what
it waits for), GetStats, and the service log's warnings. Made to find the GPU memory admission
deadlocks of judged jobs whose outputs go to the judge by descriptor (issue 13); the runs are
in bench/results/gpu/h100-judge-shares/repeat-runs/.

    KERNELBENCH=... PYTHONPATH=server:clients/python/src \\
        python3 bench/probe/kernelbench_repeat_probe.py [DEADLINE_S]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C  # noqa: E402
import grpc  # noqa: E402
from bench_kernelbench_run import make_run  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402

WRONG = {1, 19, 23, 40, 95}
UNFINISHED = (job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_QUEUED)
EXPECTED = (job_pb2.VERDICT_OK, job_pb2.VERDICT_INCORRECT)
LOGGED = ("WARNING", "ERROR", "judge", "share", "killed")


def describe(e: job_pb2.JobEvent) -> str:
    kind = e.WhichOneof("kind") or ""
    if kind == "log":
        return f"log:{e.log.text[:150]}"
    if kind == "phase":
        return f"phase:{job_pb2.Phase.Name(e.phase.phase)}"
    return kind


def report(svc: C.Service) -> None:
    with svc.client() as c:
        c.timeout = 10
        jobs = list(c.list_jobs(include_spec=True))
        states: dict[str, int] = {}
        for j in jobs:
            name = job_pb2.JobState.Name(j.state)
            states[name] = states.get(name, 0) + 1
        print("states", states)
        for j in jobs:  # what ended neither OK nor INCORRECT (only planted ones are wrong)
            if j.state == job_pb2.JOB_STATE_DONE and j.result.verdict not in EXPECTED:
                r = j.result
                print("NOT OK", j.job_id[:8], dict(j.spec.labels), j.spec.client_tag,
                      job_pb2.Verdict.Name(r.verdict), job_pb2.Side.Name(r.failed_side),
                      r.error.exception_type, r.error.message[:400],
                      list(r.notes)[-3:])  # fmt: skip
        for j in (j for j in jobs if j.state in UNFINISHED):
            events: list[job_pb2.JobEvent] = []
            try:
                events.extend(c.watch(j.job_id, reconnect=False))
            except grpc.RpcError:
                pass  # the deadline: what came is enough
            print(j.job_id[:8], job_pb2.JobState.Name(j.state), j.worker_id,
                  [describe(e) for e in events[-6:]])  # fmt: skip
        print(c.get_stats())


def print_log(svc: C.Service, lines: int) -> None:
    """The service log's last warnings, errors and judge or share lines (not NVML's)."""
    text = svc.log.read_text(errors="replace").splitlines()
    kept = [x for x in text if "NVML" not in x and any(w in x for w in LOGGED)]
    print("\n".join(kept[-lines:]))


def main() -> int:
    deadline = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
    problems = Path(os.environ.get("KERNELBENCH", "../shared/kernelbench")) / "level1"
    run_dir = Path(tempfile.mkdtemp(prefix="kerneleval-kb-probe-")) / "run"
    run_dir.mkdir()
    make_run(run_dir, problems, WRONG)
    svc = C.Service(["--workers-per-device", "8"], nvml="real").start()
    try:
        svc.wait_workers(8)
        cmd = [sys.executable, "-m", "kerneleval.cli", "--server", svc.address, "--no-progress",
               "kernelbench", str(run_dir), "--level", "1", "--problems", str(problems),
               "--preset", "kernelbench"]  # fmt: skip
        t0 = time.time()
        cli = subprocess.Popen(cmd, env=C.child_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            out, _ = cli.communicate(timeout=deadline)
            print("CLI done", time.time() - t0, out[-1500:])
        except subprocess.TimeoutExpired:
            cli.kill()
            print("CLI TIMEOUT", time.time() - t0)
        report(svc)
    finally:
        svc.stop()
        print_log(svc, 80)
    return 0


if __name__ == "__main__":
    sys.exit(main())
