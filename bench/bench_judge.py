"""What judging compared jobs outside the kernel's process costs (issue 13), and that it holds.

Two services in one run, the same in all but the judge: `--record-max-mib 1024` (the
default: a compared job's kernel records its outputs, a second job process imports only the
reference and gives the verdict) and `--record-max-mib 0` (the kernel's process judges
itself, as before). Per service:
  - Compare latency, paced so that a warm process waits (p50, p99), of a small torch
    `ModelNew` (timed, perf_trial_count 20, and untimed) and of a Triton `ModelNew`, each
    `a + b` against eager `a + b`; how much of it the judge took, and how many calls a
    standing judge took;
  - RunBatch of distinct small torch `ModelNew`s (a constant in each source), all at once:
    compared jobs a second;
  - a forger: its module body makes its own process's comparison pass while its forward
    returns zeros. It must come back INCORRECT with the judge (OK without: what the judge
    fixes).

    PYTHONPATH=server:clients/python/src python3 bench/bench_judge.py --out DIR
    ... --cpu-smoke       # here: CPU, few samples

Results: <out>/bench_judge.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

N = 4096
TORCH_NEW = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a + b * VARIANT
"""
FORGER = """
import torch
import kerneleval_server.engine.compare as cmp
import kerneleval_server.engine.runner as runner
_orig = cmp.compare_outputs
def _forged(*a, **k):
    c = _orig(*a, **k)
    c.ok, c.message = True, ""
    return c
cmp.compare_outputs = runner.compare.compare_outputs = _forged
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return torch.zeros_like(a)
"""


def torch_spec(source: str, perf: int) -> kernel_pb2.JobSpec:
    spec = kernel_pb2.JobSpec(client_tag="bench-judge")
    spec.kernel.type = spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = source
    spec.reference.source_code = K.torch_ref(N)
    spec.options.CopyFrom(K.options(correct=2, perf=perf, warmup=3 if perf else 0))
    return spec


def judge_share(c: Any, job_id: str) -> tuple[float, bool] | None:
    """From the job's events: seconds from its judge's start ("judged by" log) to its end,
    and whether a standing judge (one that judged this reference before) took it."""
    start = end = 0.0
    standing = False
    for ev in c.watch(job_id):
        if ev.HasField("log") and "judged by" in ev.log.text:
            start, standing = C.ts(ev.time), "earlier job(s)" in ev.log.text
        elif ev.HasField("finished"):
            end = C.ts(ev.time)
    return (end - start, standing) if start and end else None


def latencies(svc: C.Service, spec: kernel_pb2.JobSpec, count: int, pace: float) -> dict[str, Any]:
    walls: list[float] = []
    judged: list[float] = []
    ok = standing = 0
    with svc.client() as c:
        for i in range(count + 2):
            time.sleep(pace)  # a warm job process waits for the call (two with the judge)
            t = time.perf_counter()
            job = c.compare(spec)
            if i >= 2:
                walls.append(time.perf_counter() - t)
                ok += job.result.verdict == job_pb2.VERDICT_OK
                share = judge_share(c, job.job_id)
                if share is not None:
                    judged.append(share[0])
                    standing += share[1]
    judge = C.summary(judged)["median"] if judged else 0.0
    return {"ok": ok, **C.summary(walls), "judge_median": judge, "standing": standing}


def batch_rate(svc: C.Service, count: int) -> dict[str, Any]:
    specs = [torch_spec(TORCH_NEW.replace("VARIANT", f"{1 + i * 1e-9!r}"), 0) for i in range(count)]
    verdicts: dict[str, int] = {}
    with svc.client(timeout=600) as c:
        t = time.perf_counter()
        for ev in c.run_batch(specs):
            if ev.done and ev.event is not None and ev.event.HasField("finished"):
                v = job_pb2.Verdict.Name(ev.event.finished.result.verdict)
                verdicts[v] = verdicts.get(v, 0) + 1
        wall = time.perf_counter() - t
    return {"count": count, "seconds": wall, "per_s": count / wall, "verdicts": verdicts}


def forger(svc: C.Service) -> str:
    with svc.client() as c:
        job = c.compare(torch_spec(FORGER, 5))
    return job_pb2.Verdict.Name(job.result.verdict).removeprefix("VERDICT_")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--requests", type=int, default=None, help="Compare calls per kind (30)")
    ap.add_argument("--batch", type=int, default=None, help="jobs in the RunBatch (64)")
    ap.add_argument("--pace-s", type=float, default=None, help="pause before a call (0.8)")
    ap.add_argument("--workers-per-device", type=int, default=None, help="(8)")
    ap.add_argument("--device", default="0")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    requests = args.requests or (4 if smoke else 30)
    batch = args.batch or (6 if smoke else 64)
    pace = args.pace_s if args.pace_s is not None else (0.5 if smoke else 0.8)
    wpd = args.workers_per_device or (2 if smoke else 8)
    info = C.machine_info()
    kinds = {
        "torch ModelNew": torch_spec(TORCH_NEW.replace("VARIANT", "1.0"), 20),
        "torch ModelNew, untimed": torch_spec(TORCH_NEW.replace("VARIANT", "1.0"), 0),
        "Triton ModelNew": K.triton_add_spec(N),
    }
    kinds["Triton ModelNew"].options.CopyFrom(K.options(correct=2, perf=20, warmup=3))
    data: dict[str, Any] = {"modes": {}}
    for mode, mib in (("judge", 1024), ("no judge", 0)):
        tmp = Path(tempfile.mkdtemp(prefix="kerneleval-judge-"))
        flags = ["--record-max-mib", str(mib), "--workers-per-device", str(wpd)]
        if not smoke:
            flags += ["--devices", args.device]
        svc = C.Service(flags, root=tmp / "svc", nvml="none" if smoke else "real").start()
        got: dict[str, Any] = {}
        try:
            svc.wait_workers(wpd)
            for name, spec in kinds.items():
                got[name] = latencies(svc, spec, requests, pace)
                print(f"{mode} {name}: {got[name]}", flush=True)
            got["batch"] = batch_rate(svc, batch)
            print(f"{mode} batch: {got['batch']}", flush=True)
            got["forger"] = forger(svc)
            print(f"{mode} forger: {got['forger']}", flush=True)
        finally:
            svc.stop()
        data["modes"][mode] = got
    on, off = data["modes"]["judge"], data["modes"]["no judge"]
    rows = []
    for name in kinds:
        a, b = on[name], off[name]
        rows.append(
            [name, f"{a['ok']}/{a['n']}", a["median"] * 1e3, a["p99"] * 1e3,
             a["judge_median"] * 1e3, f"{a['standing']}/{a['n']}",
             f"{b['ok']}/{b['n']}", b["median"] * 1e3, b["p99"] * 1e3,
             (a["median"] - b["median"]) * 1e3]
        )  # fmt: skip
    batch_rows = [
        [mode, m["batch"]["count"], m["batch"]["seconds"], m["batch"]["per_s"],
         m["batch"]["verdicts"], m["forger"]]
        for mode, m in data["modes"].items()
    ]  # fmt: skip
    notes = [
        f"Compare of a + b over {N} float32 elements against eager a + b, 2 correctness "
        f"trials, 20 timed (none: untimed); {requests} paced calls ({pace} s apart), one at a "
        f"time, --workers-per-device {wpd}.",
        "Of which judging: from the judge's start (its log event) to the result, from the "
        "job's events; standing judge: calls judged by a process that judged this reference "
        "before (jobs/judging.py).",
        "judge: the default (a second job process imports only the reference and judges the "
        "recorded outputs); no judge: --record-max-mib 0 (the kernel's process judges itself).",
        "The forger's own process compares as it likes; the verdict column is the service's.",
    ]
    if smoke:
        notes.append("CPU smoke run: no GPU; not a benchmark.")
    C.write_results(
        args.out, "bench_judge", "Compared jobs judged outside the kernel's process", info, data,
        [("Compare latency (ms)",
          ["kernel", "judge OK", "judge p50", "judge p99", "of which judging, p50",
           "standing judge", "no judge OK", "no judge p50", "no judge p99", "p50 cost"], rows),
         ("RunBatch of distinct torch ModelNews, and the forger",
          ["service", "jobs", "seconds", "jobs/s", "verdicts", "forger's verdict"],
          batch_rows)],
        notes,
    )  # fmt: skip
    good = on["forger"] == "INCORRECT" and all(on[k]["ok"] == on[k]["n"] for k in kinds)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
