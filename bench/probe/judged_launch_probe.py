"""Probe: jobs launched alone and judged (--judge-launches, prebuild.reference_judged) on a
GPU, in the shapes the benchmarks use, each call with a deadline; a call that does not end
in time prints what every unfinished job last logged (kernelbench_repeat_probe.report), the
service's warnings, and the probe goes on. Made for a stall seen once on an H100: untimed
Evaluate calls of the same tiny Triton kernel against an eager reference (bench_overhead's
first mode) with --judge-launches never answered, where distinct timed ones (the GPU test,
bench_throughput) did.

    PYTHONPATH=server:clients/python/src python3 bench/probe/judged_launch_probe.py [N]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
from kernelbench_repeat_probe import print_log, report  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402

DEADLINE_S = 30.0
# (elements, correctness trials, timed trials, the same code every call)
SHAPES = [(4096, 1, 0, True), (4096, 1, 20, True), (4096, 1, 0, False), (1 << 20, 2, 20, False)]


def workers(svc: C.Service) -> None:
    """Every job process: device, spare, its job, jobs done, standing judge."""
    with svc.client() as c:
        for d in c.list_devices():
            for w in d.workers:
                print(f"  device {d.index} {w.worker_id} pid {w.pid} spare={w.spare} "
                      f"job={w.job_id[:8]} done={w.completed_job_count} "
                      f"judge={w.standing_judge}")  # fmt: skip


def main() -> int:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    svc = C.Service(["--judge-launches", "true", "--devices", "0"], nvml="real").start()
    try:
        svc.wait_workers(1)
        for n, correct, perf, same in SHAPES:
            walls, verdicts, stalled = [], [], False
            for i in range(calls):
                spec = K.triton_add_io_spec(n, variant=-1 if same else 1000 * perf + i)
                spec.options.CopyFrom(
                    K.options(correct=correct, perf=perf, warmup=3 if perf else 0)
                )
                time.sleep(0.8)
                t0 = time.perf_counter()
                with svc.client() as c:
                    job_id = c.submit(spec).job_id
                    job = c.get_job(job_id)
                    while job.state not in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_FAILED,
                                            job_pb2.JOB_STATE_CANCELLED):  # fmt: skip
                        if time.perf_counter() - t0 > DEADLINE_S:
                            stalled = True
                            break
                        time.sleep(0.05)
                        job = c.get_job(job_id)
                walls.append(round((time.perf_counter() - t0) * 1e3, 1))
                verdicts.append(job_pb2.Verdict.Name(job.result.verdict).removeprefix("VERDICT_"))
                if stalled:
                    print(f"STALL n={n} correct={correct} perf={perf} same={same} call {i}")
                    report(svc)
                    workers(svc)
                    break
            print(f"n={n} correct={correct} perf={perf} same={same}: ms {walls} {verdicts}",
                  flush=True)  # fmt: skip
    finally:
        svc.stop()
        print_log(svc, 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
