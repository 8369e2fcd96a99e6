"""Probe: where a paced, untimed Evaluate's time goes beyond the job's own segments. The
floor of the transport first (a gRPC Health call paced as the Evaluates are, and back to
back), then N Evaluates of the tiny Triton a+b (`io`: from its IOContract; `modelnew`), 0.3 s
apart: the wall time, the client's send -> the job's create_time (gRPC, validation,
queueing), the job's segments (_segments.py) and the front end's CPU time per evaluation
(/proc, its event loop and gRPC's threads; the Watch that reads each job's events counts).
The runs are in bench/results/gpu/h100-fe-trim/probes/.

    PYTHONPATH=server:clients/python/src python3 bench/probe/evaluate_hops_probe.py \\
        io|modelnew [N] [SERVICE FLAGS...]        # NVML=real on a GPU machine
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
import _segments as S  # noqa: E402


def cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.2f}"


def main() -> int:
    kind = sys.argv[1] if len(sys.argv) > 1 else "io"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    svc = C.Service(sys.argv[3:], nvml=os.environ.get("NVML", "none")).start()
    spec = (K.triton_add_io_spec if kind == "io" else K.triton_add_spec)(4096)
    spec.options.CopyFrom(K.options(correct=1, perf=0, warmup=0))
    walls: list[float] = []
    to_created: list[float] = []
    segments: dict[str, list[float]] = {}
    try:
        svc.wait_workers(1)
        with svc.client() as c:
            for pace in (0.3, 0.0):
                health = []
                for _ in range(30):
                    time.sleep(pace)
                    t = time.perf_counter()
                    c.health()
                    health.append(time.perf_counter() - t)
                print(f"gRPC Health, {pace} s apart: {ms(health[5:])} ms")
            cpu0 = 0.0
            for i in range(n + 3):  # 3 to warm up
                time.sleep(0.3)  # a warm job process waits for the call
                if i == 3:
                    cpu0 = cpu_ms(svc.pid)
                sent, t = time.time(), time.perf_counter()
                job = c.evaluate(spec)
                wall, done = time.perf_counter() - t, time.time()
                if i < 3:
                    continue
                walls.append(wall)
                to_created.append(C.ts(job.create_time) - sent)
                parts = S.breakdown(c.watch(job.job_id), C.ts(job.create_time), done)
                for name, s in parts.items():
                    segments.setdefault(name, []).append(s)
            cpu = (cpu_ms(svc.pid) - cpu0) / n
    finally:
        svc.stop()
    print(f"Evaluate ({kind}): {ms(walls)} ms; client send -> created {ms(to_created)} ms; "
          f"front end CPU {cpu:.2f} ms an evaluation")  # fmt: skip
    print(
        "  slowest (call, ms):", [(walls.index(w), round(w * 1e3, 1)) for w in sorted(walls)[-4:]]
    )
    for name, values in segments.items():
        print(f"  {name:55s} {ms(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
