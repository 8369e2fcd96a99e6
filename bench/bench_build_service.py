"""KernelBench load_inline candidates through the service: builds by build processes and the
build cache (jobs/builds/extension_builds.py) against each job building its own (torch's
load_inline in its job process, --build-processes 0), in the same run.

Candidates are the example pairs' ModelNews (../shared/kernelbench/examples, read in place)
against their Models, each made distinct by a comment in its CUDA source (nothing can come from
a cache). Rows:
  - builds by the service: --count distinct candidates through RunBatch at once; a minute's
    worth, and how many were correct;
  - builds in the job: --plain-count distinct candidates the same way, build processes off;
  - cache hit: a candidate sent again (the result cache off): from its start to its
    correctness run (PHASE_VALIDATING), and to the build cache's answer.
The service makes its precompiled headers at start; the run waits for them (their time is a
row of its own).

    PYTHONPATH=server:clients/python/src python3 bench/bench_build_service.py --out DIR

Results: <out>/bench_build_service.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from bench_throughput import run_batch  # noqa: E402
from kerneleval.kernelbench import job_from_sources  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

KERNELBENCH = os.environ.get("KERNELBENCH", C.REPO.parent / "shared" / "kernelbench")
EXAMPLES = Path(KERNELBENCH) / "examples"
PAIRS = ("add", "fuse_gelu", "tiled_matmul")


def candidate(index: int, tag: str) -> kernel_pb2.JobSpec:
    pair = PAIRS[index % len(PAIRS)]
    kernel = (EXAMPLES / f"model_new_ex_{pair}.py").read_text()
    include = "#include <torch/extension.h>"
    assert include in kernel, pair
    kernel = kernel.replace(include, f"{include}\n// candidate {tag}-{index}-{time.time_ns()}", 1)
    reference = (EXAMPLES / f"model_ex_{pair}.py").read_text()
    spec = job_from_sources(kernel, reference, client_tag="bench-build-service")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH_CUDA
    spec.options.timeout.seconds = 300
    spec.options.perf_trial_count = 5
    return spec


# Planted in the add example's kernel (its CUDA source), to judge that a build by the service
# means what torch's own build means: the same verdicts, and the compiler's error in both.
PLANTED = {
    "compile_error": ("out[idx] = a[idx] + b[idx];", "out[idx] = a[idx] + undefined_thing;"),
    "illegal_address": ("out[idx] = a[idx] + b[idx];", "out[idx + (1 << 28)] = a[idx] + b[idx];"),
    "hang": ("out[idx] = a[idx] + b[idx];",
             "while (a[idx] == a[idx]) { out[idx] += 1.0f; } out[idx] = a[idx] + b[idx];"),
}  # fmt: skip


def planted(kind: str, tag: str) -> kernel_pb2.JobSpec:
    spec = candidate(0, f"{tag}-{kind}")
    old, new = PLANTED[kind]
    assert old in spec.kernel.source_code
    spec.kernel.source_code = spec.kernel.source_code.replace(old, new)
    spec.options.timeout.seconds = 60 if kind == "hang" else 300
    return spec


def behaviour(jobs: dict[str, Any]) -> dict[str, Any]:
    """Each planted candidate's verdict and the first line of its error."""
    out = {}
    for kind in PLANTED:
        job = jobs.get(f"planted-{kind}")
        if job is None:
            continue
        r = job.result
        text = r.compilation_error or r.error.message
        first = next((ln for ln in text.splitlines() if "error" in ln.lower()), text[:200])
        out[kind] = {"verdict": job_pb2.Verdict.Name(r.verdict), "error": first[:300]}
    return out


READY_LINE = "ready for load_inline jobs: True"


def wait_for_pch(svc: C.Service, timeout: float) -> float:
    """Seconds until the service says it is ready for load_inline jobs (its log: the
    precompiled headers made, or given up on; builds then go without them)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if svc.log.exists() and READY_LINE in svc.log.read_text(errors="replace"):
            return time.monotonic() - t0
        time.sleep(0.5)
    print("precompiled headers not made in time:", svc.tail(), flush=True)
    return -1.0


def cache_hits(svc: C.Service, spec: kernel_pb2.JobSpec, n: int) -> dict[str, Any]:
    """The same candidate n times, one at a time: start -> PHASE_VALIDATING and start -> the
    build cache's answer, from the jobs' own event times."""
    to_check, to_answer, verdicts = [], [], []
    with svc.client() as c:
        for _ in range(n):
            events = list(c.run(spec))
            start = next(C.ts(e.time) for e in events if e.HasField("started"))
            check = next(
                C.ts(e.time) for e in events
                if e.HasField("phase") and e.phase.phase == job_pb2.PHASE_VALIDATING
            )  # fmt: skip
            hit = [C.ts(e.time) for e in events if "from the build cache" in e.log.text]
            to_check.append(check - start)
            to_answer.extend(h - start for h in hit[:1])
            verdicts.append(job_pb2.Verdict.Name(events[-1].finished.result.verdict))
    return {
        "start_to_check_ms": [1e3 * x for x in to_check],
        "start_to_cache_answer_ms": [1e3 * x for x in to_answer],
        "p50_start_to_check_ms": 1e3 * statistics.median(to_check),
        "p50_start_to_cache_answer_ms": 1e3 * statistics.median(to_answer) if to_answer else -1,
        "verdicts": verdicts,
    }


def one_at_a_time(svc: C.Service, n: int, tag: str) -> dict[str, Any]:
    """n distinct candidates, one after the other: each build's own time (the job's log:
    "load_inline('name'): built in X s") and each job's wall time."""
    builds, walls = [], []
    with svc.client() as c:
        for i in range(n):
            t0 = time.perf_counter()
            events = list(c.run(candidate(i, tag)))
            walls.append(time.perf_counter() - t0)
            for e in events:
                m = re.search(r"load_inline\('\w+'\): built in ([0-9.]+) s", e.log.text)
                if m:
                    builds.append(float(m.group(1)))
    return {
        "build_s": builds,
        "job_wall_s": walls,
        "p50_build_s": statistics.median(builds) if builds else -1.0,
        "p50_job_wall_s": statistics.median(walls),
    }


def batch(
    flags: list[str], count: int, tag: str, workers: int, hits: int, pch: bool
) -> dict[str, Any]:
    svc = C.Service(["--workers-per-device", str(workers), *flags], nvml="real").start()
    try:
        out: dict[str, Any] = {"flags": flags}
        out["pch_s"] = wait_for_pch(svc, 400) if pch else 0.0
        svc.wait_workers(workers)
        warm = candidate(0, f"{tag}-warm")
        with svc.client() as c:  # a first build (and the GPU's first kernels) untimed
            out["warm_verdict"] = job_pb2.Verdict.Name(
                list(c.run(warm))[-1].finished.result.verdict
            )
        specs = [candidate(i, tag) for i in range(count)]
        out["batch"] = run_batch(svc, specs, in_flight=count)
        with svc.client() as c:  # the planted ones, at once
            kinds = list(PLANTED)
            finished = {}
            for be in c.run_batch([planted(k, tag) for k in kinds], max_in_flight=len(kinds)):
                if be.event is not None and be.event.HasField("finished"):
                    finished[f"planted-{kinds[int(be.request_tag)]}"] = be.event.finished
                if len(finished) == len(kinds) or be.error is not None:
                    if be.error is not None:
                        print("refused:", be.error.message, flush=True)
                    if len(finished) == len(kinds):
                        break
        out["behaviour"] = behaviour(finished)
        b = out["batch"]
        b["per_minute"] = 60 * b["finished"] / b["wall_s"]
        if hits:
            out["cache_hits"] = cache_hits(svc, warm, hits)
            out["one_at_a_time"] = one_at_a_time(svc, 6, f"{tag}-seq")
        print(json.dumps({k: v for k, v in out.items() if k != "cache_hits"})[:1500], flush=True)
        return out
    finally:
        svc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap, smoke=False)
    ap.add_argument("--count", type=int, default=64, help="distinct candidates, service builds")
    ap.add_argument("--plain-count", type=int, default=16, help="distinct candidates, in-job")
    ap.add_argument("--workers-per-device", type=int, default=8)
    ap.add_argument("--build-processes", type=int, default=-1)
    ap.add_argument("--hits", type=int, default=5)
    args = ap.parse_args()
    info = C.machine_info()
    w = args.workers_per_device
    data: dict[str, Any] = {}
    fast_flags = []
    if args.build_processes >= 0:
        fast_flags = ["--build-processes", str(args.build_processes)]
    data["service"] = batch(fast_flags, args.count, "svc", w, args.hits, pch=True)
    if args.plain_count:
        data["in_job"] = batch(["--build-processes", "0"], args.plain_count, "job", w, 0, False)
    rows = []
    for name, key in (("builds by the service", "service"), ("each job builds its own", "in_job")):
        if key in data:
            b = data[key]["batch"]
            rows.append([name, b["jobs"], b["ok"], b["wall_s"], b["per_minute"], b["verdicts"]])
    head = ["how", "candidates", "correct", "wall s", "per minute", "verdicts"]
    tables = [(f"distinct KernelBench load_inline candidates, RunBatch, {w} per GPU", head, rows)]
    notes = []
    if "in_job" in data:
        s, p = data["service"]["batch"]["per_minute"], data["in_job"]["batch"]["per_minute"]
        notes.append(f"distinct candidates a minute: {s:.1f} vs {p:.1f} ({C.ratio(s, p):.1f}x)")
    hits = data["service"].get("cache_hits")
    if hits:
        notes.append(
            f"a candidate sent again: start -> correctness run p50 "
            f"{hits['p50_start_to_check_ms']:.0f} ms, start -> build cache answer p50 "
            f"{hits['p50_start_to_cache_answer_ms']:.0f} ms ({hits['verdicts']})"
        )
    if "in_job" in data:
        brows = []
        for kind in PLANTED:
            svc_b = data["service"]["behaviour"].get(kind, {})
            job_b = data["in_job"]["behaviour"].get(kind, {})
            brows.append([kind, svc_b.get("verdict", "-"), job_b.get("verdict", "-"),
                          svc_b.get("error", "")[:90], job_b.get("error", "")[:90]])  # fmt: skip
        bhead = ["planted", "service verdict", "in-job verdict", "service error", "in-job error"]
        tables.append(("the same meaning: planted faults", bhead, brows))
    seq = data["service"].get("one_at_a_time")
    if seq:
        notes.append(
            f"one distinct candidate at a time: build p50 {seq['p50_build_s']:.2f} s (main.cpp "
            f"as an earlier candidate's: its object reused), job p50 {seq['p50_job_wall_s']:.2f} s"
        )
    notes.append(f"precompiled headers made at start in {data['service']['pch_s']:.1f} s")
    title = "load_inline candidates through the service: build processes vs in-job builds"
    C.write_results(args.out, "bench_build_service", title, info, data, tables, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
