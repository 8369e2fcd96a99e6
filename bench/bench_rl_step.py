"""One RL step: 64 distinct KernelBench candidates for level-1 problems, sent through RunBatch
at once, timed from the first send to the last verdict (issue 19).

Candidates are written here for the elementwise level-1 problems of ../shared/kernelbench (read
in place): half `load_inline` CUDA ModelNews, half Triton ModelNews, each made distinct by a
comment and its block size (no build or result can come from a cache). As real rollouts, a
share is wrong or does not build or faults; the mix is --mix (default: 44 correct, 10 wrong
by a constant, 5 that do not compile, 5 that store out of bounds), spread over problems and
kernel types by a seeded shuffle. Every verdict is checked against what its candidate was
planted to be: OK, INCORRECT, COMPILE_ERROR, DEVICE_FAULT.

Reported: the step's wall time, and per phase where the jobs' time went, from their own
events: waiting for a job process (queued -> started), building (started -> correctness
run: the module's import, its load_inline build or Triton JIT), correctness (-> timed
trials), waiting for the GPU's timing window (EvalResult.timing_window.waited) and the timed
trials with the GPU alone (the rest, to the verdict). Options are KernelBench's
(`--preset kernelbench`): seed 42, one correctness trial, 10 timed runs after 3 warm-ups.

    PYTHONPATH=server:clients/python/src python3 bench/bench_rl_step.py --out DIR
    ... --devices 0,1            # two GPUs
    ... --cpu-smoke              # here: Triton under the interpreter, the problems shrunk

Results: <out>/bench_rl_step_<N>gpu.json and .md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _segments as S  # noqa: E402
from bench_build_service import wait_for_pch  # noqa: E402
from bench_throughput import (  # noqa: E402
    StartCounter,
    pool_now,
    timing_windows,
    window_costs,
    window_fraction,
)
from kerneleval.kernelbench import job_from_sources, kernelbench_options  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

KERNELBENCH = Path(os.environ.get("KERNELBENCH", C.REPO.parent / "shared" / "kernelbench"))

# Level-1 problem file -> (CUDA expression of `v`, Triton expression of `x`), the problem's own
# formula (inputs are torch.rand: in [0, 1)).
PROBLEMS: dict[str, tuple[str, str]] = {
    "19_ReLU.py": ("fmaxf(v, 0.0f)", "tl.maximum(x, 0.0)"),
    "20_LeakyReLU.py": ("v > 0.0f ? v : 0.01f * v", "tl.where(x > 0, x, 0.01 * x)"),
    "21_Sigmoid.py": ("1.0f / (1.0f + expf(-v))", "tl.sigmoid(x)"),
    "22_Tanh.py": ("tanhf(v)", "2.0 * tl.sigmoid(2.0 * x) - 1.0"),
    "25_Swish.py": ("v / (1.0f + expf(-v))", "x * tl.sigmoid(x)"),
    "26_GELU_.py": ("0.5f * v * (1.0f + erff(v * 0.70710678118654752f))",
                    "0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))"),
    "28_HardSigmoid.py": ("fminf(fmaxf(v / 6.0f + 0.5f, 0.0f), 1.0f)",
                          "tl.minimum(tl.maximum(x / 6.0 + 0.5, 0.0), 1.0)"),
    "29_Softplus.py": ("v > 20.0f ? v : log1pf(expf(v))",
                       "tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))"),
    "30_Softsign.py": ("v / (1.0f + fabsf(v))", "x / (1.0 + tl.abs(x))"),
    "31_ELU.py": ("v > 0.0f ? v : expf(v) - 1.0f", "tl.where(x > 0, x, tl.exp(x) - 1.0)"),
    "32_HardTanh.py": ("fminf(fmaxf(v, -1.0f), 1.0f)", "tl.minimum(tl.maximum(x, -1.0), 1.0)"),
    "88_MinGPTNewGelu.py": (
        "0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)))",
        "0.5 * x * (2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x)))",
    ),
}  # fmt: skip

CUDA_TEMPLATE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

source = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
// rollout {tag}

__global__ void act_kernel(const float* x, float* out, long long n) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) {
        float v = x[idx];
        out[idx{oob}] = {expr};
    }
}

torch::Tensor act_cuda(torch::Tensor x) {
    auto out = torch::empty_like(x);
    long long n = x.numel();
    const int block = {block};
    const int blocks = (int)((n + block - 1) / block);
    act_kernel<<<blocks, block>>>(x.data_ptr<float>(), out.data_ptr<float>(), n);
    return out;
}
"""

act = load_inline(
    name="act_{stem}",
    cpp_sources="torch::Tensor act_cuda(torch::Tensor x);",
    cuda_sources=source,
    functions=["act_cuda"],
    verbose=False,
)


class ModelNew(nn.Module):
    def __init__(self, *args) -> None:
        super().__init__()

    def forward(self, x):
        return act.act_cuda(x.contiguous())
'''

TRITON_TEMPLATE = """import torch
import torch.nn as nn
import triton
import triton.language as tl

# rollout {tag}


@triton.jit
def act_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets{oob}, {expr}, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, *args) -> None:
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        act_kernel[(triton.cdiv(n, {block}),)](x, out, n, BLOCK={block})
        return out
"""

# What each planted kind does to a candidate, and the verdict it must get.
EXPECTED = {
    "ok": job_pb2.VERDICT_OK,
    "wrong": job_pb2.VERDICT_INCORRECT,
    "compile_error": job_pb2.VERDICT_COMPILE_ERROR,
    "fault": job_pb2.VERDICT_DEVICE_FAULT,
}
DEFAULT_MIX = "ok=44,wrong=10,compile_error=5,fault=5"
# Under Triton's interpreter (--cpu-smoke) nothing compiles (an unknown tl function is an
# AttributeError when it runs) and an out-of-bounds store is a segfault of the job process.
SMOKE_EXPECTED = {
    **EXPECTED,
    "compile_error": job_pb2.VERDICT_RUNTIME_ERROR,
    "fault": job_pb2.VERDICT_CRASHED,
}


def candidate_source(problem: str, backend: str, kind: str, tag: str, block: int) -> str:
    cuda_expr, triton_expr = PROBLEMS[problem]
    cuda = backend == "cuda"
    expr = cuda_expr if cuda else triton_expr
    oob = ""
    if kind == "wrong":
        expr = f"({expr}) + 0.01{'f' if cuda else ''}"
    elif kind == "compile_error":
        expr = "undefined_value * v" if cuda else "tl.undefined_function(x)"
    elif kind == "fault":  # far past the output: an illegal address, whatever the allocation
        oob = " + (1LL << 36)" if cuda else " + (1 << 36)"
    template = CUDA_TEMPLATE if cuda else TRITON_TEMPLATE
    stem = re.sub(r"\W", "_", Path(problem).stem.split("_", 1)[1]).lower()
    out = template.replace("{tag}", tag).replace("{oob}", oob).replace("{expr}", expr)
    return out.replace("{block}", str(block)).replace("{stem}", stem)


def shrink(reference: str) -> str:
    """For --cpu-smoke: the problem's sizes cut to a few thousand elements."""
    reference = re.sub(r"^batch_size = .*$", "batch_size = 16", reference, flags=re.M)
    return re.sub(r"^dim = .*$", "dim = 1024", reference, flags=re.M)


def plan(count: int, mix: str, backends: list[str], seed: int) -> list[dict[str, Any]]:
    """`count` candidates: problems in turn, backends alternating, kinds shuffled by `seed`."""
    kinds: list[str] = []
    for part in mix.split(","):
        name, _, n = part.partition("=")
        if name not in EXPECTED:
            raise SystemExit(f"--mix: unknown kind {name!r} (one of {', '.join(EXPECTED)})")
        kinds += [name] * int(n)
    if len(kinds) != count:
        raise SystemExit(f"--mix adds up to {len(kinds)} candidates, not --count {count}")
    random.Random(seed).shuffle(kinds)
    problems = sorted(PROBLEMS)
    return [
        {"index": i, "problem": problems[i % len(problems)],
         "backend": backends[i % len(backends)], "kind": kinds[i],
         "block": (128, 256, 512, 1024)[(i // len(problems)) % 4]}
        for i in range(count)
    ]  # fmt: skip


def specs_for(
    planned: list[dict[str, Any]], tag: str, smoke: bool, timeout_s: int
) -> list[kernel_pb2.JobSpec]:
    out = []
    for p in planned:
        reference = (KERNELBENCH / "level1" / p["problem"]).read_text()
        if smoke:
            reference = shrink(reference)
        source = candidate_source(
            p["problem"], p["backend"], p["kind"], f"{tag}-{p['index']}", p["block"]
        )
        spec = job_from_sources(
            source, reference, options=kernelbench_options(), client_tag="bench-rl-step"
        )
        spec.options.timeout.seconds = timeout_s
        out.append(spec)
    return out


def phases(events: list[job_pb2.JobEvent]) -> dict[str, float]:
    """Seconds of one job in each phase, from its events (the last attempt's)."""
    queued = C.ts(events[0].time)
    started = [C.ts(e.time) for e in events if e.HasField("started")]
    validating = [
        C.ts(e.time) for e in events
        if e.HasField("phase") and e.phase.phase == job_pb2.PHASE_VALIDATING
    ]  # fmt: skip
    profiling = [
        C.ts(e.time) for e in events
        if e.HasField("phase") and e.phase.phase == job_pb2.PHASE_PROFILING
    ]  # fmt: skip
    end = C.ts(events[-1].time)
    start = started[-1] if started else end
    check = validating[-1] if validating else end
    timed = profiling[-1] if profiling else end
    result = events[-1].finished.result
    waited = result.timing_window.waited.ToNanoseconds() / 1e9 if profiling else 0.0
    return {
        "wait_for_process": (started[0] if started else end) - queued,
        "build": max(0.0, min(check, timed) - start),
        "correctness": max(0.0, timed - check) if validating else 0.0,
        "wait_for_window": min(waited, max(0.0, end - timed)),
        "timed_alone": max(0.0, end - timed - waited) if profiling else 0.0,
        "attempts": float(len(started)),
        "total": end - queued,
    }


class WhileStep(threading.Thread):
    """A thread that does its `tick` every `period` seconds while a step runs (a `with`)."""

    period = 1.0

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.tick()

    def tick(self) -> None:
        raise NotImplementedError


class Progress(WhileStep):
    """While a step runs: every PROGRESS_S, how many verdicts are in, and what the service
    log says jobs have waited long for (jobs/waits.py), so that a stall says what it waits for
    as it happens, not after the run is cut."""

    def __init__(self, svc: C.Service, t0: float, done: Any, count: int) -> None:
        super().__init__()
        self.period = PROGRESS_S
        self.svc, self.t0, self.done, self.count = svc, t0, done, count
        log = svc.root / "service.log"
        self.log, self.offset = log, log.stat().st_size if log.exists() else 0

    def tick(self) -> None:
        lines = []
        if self.log.exists():
            with open(self.log, errors="replace") as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
            lines = [ln for ln in text.splitlines() if "has waited" in ln or "waited" in ln
                     and "never came" in ln]  # fmt: skip
        print(f"  {time.perf_counter() - self.t0:6.1f} s: {self.done()}/{self.count} "
              "verdicts in", flush=True)  # fmt: skip
        for line in lines[-12:]:
            print("    " + line[:600], flush=True)


class GpuMemorySampler(WhileStep):
    """While a step runs: every SAMPLE_S, each process's GPU memory as nvidia-smi reads it,
    summed by what the service says the process is (busy with a job, idle, a spare, a
    standing judge idle or judging; "other" where its pid is not a job process's), and how
    many processes of each role there are ("n busy": job slots in use). What admission
    reserves is a claim of jobs' peaks; this is what the GPU holds. Nothing where nvidia-smi
    is not."""

    def __init__(self, svc: C.Service) -> None:
        super().__init__()
        self.period = SAMPLE_S
        self.svc = svc
        self.samples: list[dict[str, float]] = []

    def __enter__(self) -> GpuMemorySampler:
        if shutil.which("nvidia-smi"):
            self.start()
        return self

    def tick(self) -> None:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                 "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=5, check=True).stdout  # fmt: skip
            with self.svc.client() as c:
                devices = c.list_devices()
        except Exception:  # noqa: BLE001 - a sample missed is a sample fewer
            return
        role = {}
        sample: dict[str, float] = {}
        for d in devices:
            for w in d.workers:
                r = role[w.pid] = (
                    ("judging" if w.job_id else "standing judge") if w.standing_judge
                    else "spare" if w.spare else "busy" if w.job_id else "idle"
                )  # fmt: skip
                # How many of each: a job slot idle while jobs queue waits for a process.
                sample["n " + r] = sample.get("n " + r, 0) + 1
        for line in out.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().isdigit():
                r = role.get(int(pid), "other")
                sample[r] = sample.get(r, 0.0) + int(mib)
                sample["processes"] = sample.get("processes", 0) + 1
        sample["total"] = sum(
            v for k, v in sample.items() if k != "processes" and not k.startswith("n ")
        )
        sample["t"] = time.time()  # the jobs' events' clock: queued_at() reads it
        self.samples.append(sample)

    def summary(self, queued: list[tuple[float, float]]) -> dict[str, Any]:
        """The sample of the most memory held, each role's median, and, over the samples
        while a job of the step waited for its process (`queued`: each job's queued and first
        started times), the median count of processes of each role: busy ones under the job
        processes per GPU with none ready says jobs wait for processes to start; ready ones
        beside a full count says they wait for a job slot."""
        if not self.samples:
            return {}
        top = max(self.samples, key=lambda x: x.get("total", 0.0))
        roles = sorted({k for x in self.samples for k in x} - {"t"})
        waiting = [x for x in self.samples if any(q <= x["t"] < st for q, st in queued)]
        counts = sorted(r for r in roles if r.startswith("n "))
        return {"samples": len(self.samples), "at_most_mib": top,
                "median_mib": {r: statistics.median(x.get(r, 0.0) for x in self.samples)
                               for r in roles},
                "while_jobs_wait": {"samples": len(waiting)} | {
                    r: statistics.median(x.get(r, 0.0) for x in waiting)
                    for r in counts if waiting}}  # fmt: skip


SAMPLE_S = 0.5


def queued_at(events: dict[int, list[job_pb2.JobEvent]]) -> list[tuple[float, float]]:
    """Each job's (queued, first started) times on its events' clock (seconds since the epoch);
    a job that never started waited to its last event."""
    out = []
    for evs in events.values():
        started = [C.ts(e.time) for e in evs if e.HasField("started")]
        out.append((C.ts(evs[0].time), started[0] if started else C.ts(evs[-1].time)))
    return out


def learned_footprints(svc: C.Service, offset: int) -> dict[str, dict[str, float]]:
    """Per side of a job (its kernel's process, its judge), the peaks its processes reported
    and the footprints admission learned from them (the service's log from `offset`)."""
    by: dict[str, dict[str, list[float]]] = {}
    for rec in C.log_records(svc.log, offset):
        if rec.get("message") == "GPU memory learned":
            side = by.setdefault(str(rec.get("side")), {"peak_mib": [], "footprint_mib": []})
            side["peak_mib"].append(float(rec.get("peak_mib", 0)))
            side["footprint_mib"].append(float(rec.get("footprint_mib", 0)))
    return {
        side: {"count": len(v["peak_mib"]), "peak_median_mib": statistics.median(v["peak_mib"]),
               "peak_max_mib": max(v["peak_mib"]),
               "footprint_max_mib": max(v["footprint_mib"])}
        for side, v in by.items()
    }  # fmt: skip


def step(
    svc: C.Service,
    specs: list[kernel_pb2.JobSpec],
    planned: list[dict[str, Any]],
    expected: dict[str, int],
) -> dict[str, Any]:
    events: dict[int, list[job_pb2.JobEvent]] = {}
    finished: dict[int, job_pb2.Job] = {}
    refused = []
    windows = timing_windows(svc)
    log_from = svc.log.stat().st_size if svc.log.exists() else 0
    first: float | None = None  # seconds to the first verdict
    t0 = time.perf_counter()
    watch = Progress(svc, t0, lambda: len(finished) + len(refused), len(specs))
    sampler = GpuMemorySampler(svc)
    with watch, sampler, svc.client() as c:
        for be in c.run_batch(specs, max_in_flight=len(specs)):
            i = int(be.request_tag)
            if be.error is not None:
                refused.append(f"{i}: {be.error.message}")
            elif be.event is not None:
                events.setdefault(i, []).append(be.event)
                if be.event.HasField("finished"):
                    finished[i] = be.event.finished
                    first = first if first is not None else time.perf_counter() - t0
            if len(finished) + len(refused) >= len(specs):
                break
    wall = time.perf_counter() - t0
    after = timing_windows(svc)
    jobs = []
    for p in planned:
        i = p["index"]
        job = finished.get(i)
        got = job_pb2.Verdict.Name(job.result.verdict) if job else "none"
        why = ""
        want = expected[p["kind"]]
        if job and job.result.verdict != want:
            r = job.result
            why = (r.error.message or r.compilation_error or r.fault.description
                   or job.state_reason)[:300]  # fmt: skip
        jobs.append({
            **p, "verdict": got, "expected": job_pb2.Verdict.Name(want),
            "as_planted": job is not None and job.result.verdict == want,
            "why": why, "device": job.device_index if job else -1,
            "speedup": job.result.speedup if job else 0.0,
            "phases": phases(events[i]) if i in events and job else {},
            "window_parts": S.window_parts(job.result.notes) if job else {},
        })  # fmt: skip
    return {
        "wall_s": wall, "finished": len(finished), "refused": refused, "jobs": jobs,
        "as_planted": sum(j["as_planted"] for j in jobs),
        "timing_window_fraction": window_fraction(windows, after, wall),
        "alone_reruns": alone_reruns(svc, log_from), "first_verdict_s": first or 0.0,
        "gpu_memory": sampler.summary(queued_at(events)),
        "footprints": learned_footprints(svc, log_from),
    }  # fmt: skip


def alone_reruns(svc: C.Service, offset: int) -> list[dict[str, str]]:
    """The step's jobs re-run alone after running out of memory beside others (the service's
    log from `offset`): each holds its GPU from new jobs until it ends, which shows as starts
    in bursts. What failed, and what the GPU held then."""
    return [
        {k: str(rec.get(k, "")) for k in ("time", "job_id", "why", "gpus")}
        for rec in C.log_records(svc.log, offset)
        if str(rec.get("message", "")).startswith("job re-run alone")
    ]


PROGRESS_S = 15.0
PHASES = ("wait_for_process", "build", "correctness", "wait_for_window", "timed_alone")


def phase_rows(jobs: list[dict[str, Any]]) -> list[list[Any]]:
    """Per phase: jobs' seconds summed (and as a share of all the jobs' time), the median and
    the largest of one job."""
    rows = []
    total = sum(j["phases"].get("total", 0.0) for j in jobs) or 1.0
    for name in PHASES:
        values = [j["phases"][name] for j in jobs if j["phases"]]
        if not values:
            continue
        s = sum(values)
        rows.append([name, s, s / total, statistics.median(values), max(values)])
    return rows


def layout(args: argparse.Namespace) -> tuple[list[str], int, list[str]]:
    """(the GPUs, job processes per GPU, the candidates' backends) the arguments ask for."""
    smoke = args.cpu_smoke
    devices = [d for d in args.devices.split(",") if d]
    wpd = args.workers_per_device or (1 if smoke else 16)
    return devices, wpd, ["triton"] if smoke else ["cuda", "triton"]


def one_config(
    run: dict[str, Any], flags: list[str], root: Path, args: argparse.Namespace,
    planned: list[dict[str, Any]], expected: dict[str, int], smoke: bool,
) -> None:  # fmt: skip
    """A service with `flags` (on `root`'s state folder): ready, warm, then the steps, into
    `run` as they finish."""
    devices, wpd, backends = layout(args)
    log = root / "service.log"
    if log.exists():  # an earlier configuration's: its readiness line is not this service's
        log.rename(root / f"service-{time.time_ns()}.log")
    t_boot = time.perf_counter()
    svc = C.Service(flags, root=root, nvml="none" if smoke else "real").start()
    try:
        run["pch_s"] = 0.0 if smoke else wait_for_pch(svc, 400)
        svc.wait_workers(wpd * max(1, len(devices)))
        run["pool_ready_s"] = time.perf_counter() - t_boot
        # A first candidate of each backend, untimed: the GPU's and the build processes' first
        # work (a step of a running RL loop never meets a cold service).
        warm = plan(len(backends), f"ok={len(backends)}", backends, args.seed)
        warm_specs = specs_for(warm, f"warm-{time.time_ns()}", smoke, args.timeout_s)
        t_warm = time.perf_counter()
        warm_step = step(svc, warm_specs, warm, expected)
        run["warm_verdicts"] = [j["verdict"] for j in warm_step["jobs"]]
        # The cold start: service start to the first verdict (of the warm-up's candidates).
        run["cold_start_s"] = t_warm - t_boot + warm_step["first_verdict_s"]
        for n in range(args.steps):
            tag = f"step{n}-{time.time_ns()}"
            specs = specs_for(planned, tag, smoke, args.timeout_s)
            pool = pool_now(svc)  # what it held ready, as a loop's next step finds it
            counter = StartCounter(svc)
            try:
                result = step(svc, specs, planned, expected)
            finally:
                counter.close()
            result["processes_started"] = counter.count
            result["pool_before"] = pool
            print(json.dumps({"flags": run["flags"]} | {k: v for k, v in result.items()
                                                        if k != "jobs"}), flush=True)  # fmt: skip
            run["steps"].append(result)
        run["service_log_tail"] = svc.tail()[-3000:]
        keep_log(svc.log, args.out, run["flags"])
        run["windows"] = window_costs(svc)  # with the warm-up's few windows
    finally:
        svc.stop()


def keep_log(log: Path, out: str, flags: str) -> None:
    """The service's log, gzipped beside the results: each job's and process's life in it
    (when each started, waited, was judged, exited) is what a slow step is read from."""
    slug = re.sub(r"[^a-z0-9]+", "-", flags.lower()).strip("-") or "defaults"
    if log.exists():
        Path(out).mkdir(parents=True, exist_ok=True)  # the results are written after
        with open(log, "rb") as f, gzip.open(Path(out) / f"service-{slug}.log.gz", "wb") as g:
            shutil.copyfileobj(f, g)


def config_row(run: dict[str, Any]) -> list[Any]:
    """One configuration's steps: walls, their median, as planted, the share of job-seconds
    spent waiting for a job process and of the wall a window was held (medians over steps),
    job processes started and jobs re-run alone a step, and its windows' OpenWindow and time
    held (medians)."""
    steps = run["steps"]
    walls = [s["wall_s"] for s in steps]
    waits = [dict((r[0], r[2]) for r in phase_rows(s["jobs"])).get("wait_for_process", 0.0)
             for s in steps]  # fmt: skip
    held = [statistics.median(s["timing_window_fraction"].values() or [0.0]) for s in steps]
    return [run["flags"] or "(defaults)", len(steps), ", ".join(f"{w:.1f}" for w in walls),
            statistics.median(walls) if walls else 0.0,
            ", ".join(str(s["as_planted"]) for s in steps),
            statistics.median(waits) if waits else 0.0,
            statistics.median(held) if held else 0.0,
            ", ".join(str(s.get("processes_started", "-")) for s in steps),
            ", ".join(str(len(s.get("alone_reruns", []))) for s in steps),
            run.get("windows", {}).get("open_ms", 0.0),
            run.get("windows", {}).get("held_ms", 0.0)]  # fmt: skip


def memory_row(run: dict[str, Any], i: int) -> list[Any]:
    """One step's GPU memory: learned_footprints and GpuMemorySampler's summary."""
    st = run["steps"][i]
    sides = st.get("footprints", {})
    top = st.get("gpu_memory", {}).get("at_most_mib", {})
    wait = st.get("gpu_memory", {}).get("while_jobs_wait", {})
    return [run["flags"] or "(defaults)", i,
            sides.get("kernel", {}).get("peak_median_mib", "-"),
            sides.get("judge", {}).get("peak_median_mib", "-"),
            top.get("total", "-"), top.get("busy", 0), top.get("judging", 0),
            top.get("standing judge", 0), top.get("idle", 0) + top.get("spare", 0),
            top.get("other", 0), len(st.get("alone_reruns", [])),
            "/".join(str(wait.get(f"n {r}", 0)) for r in ("busy", "idle", "spare", "judging"))
            if wait.get("samples") else "-"]  # fmt: skip


def cold_row(run: dict[str, Any]) -> list[Any]:
    """One configuration's cold start (the headers are made only on a fresh state folder: the
    first configuration's) and its pool before each step (pool_now)."""
    pools = [s.get("pool_before", {}) for s in run["steps"]]
    return [run["flags"] or "(defaults)", run.get("pch_s", 0.0), run.get("pool_ready_s", 0.0),
            run.get("cold_start_s", 0.0),
            ", ".join(str(p.get("processes", "-")) for p in pools),
            ", ".join(f"{p.get('memory_used_mib', 0.0):.0f}" for p in pools)]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--mix", default=DEFAULT_MIX, help="planted kinds, adding up to --count")
    ap.add_argument("--devices", default="0", help="GPUs the service uses, e.g. 0,1")
    ap.add_argument("--workers-per-device", type=int, default=None, help="16 (1 smoke)")
    ap.add_argument("--build-processes", type=int, default=None, help="the service's auto")
    ap.add_argument("--timeout-s", type=int, default=120, help="each job's")
    ap.add_argument("--seed", type=int, default=19)
    ap.add_argument("--steps", type=int, default=2, help="steps, each of fresh candidates")
    ap.add_argument(
        "--configs", default="",
        help="'|'-separated sets of the service's flags, each run in turn with --steps steps "
        "(its own service, one state folder), e.g. '|--standing-judges-per-device 12'; the "
        "first is the baseline",
    )  # fmt: skip
    ap.add_argument(
        "--standing-judges", type=int, default=None,
        help="the service's --standing-judges-per-device (its default: 2; the step's problems: 12)",
    )  # fmt: skip
    args = ap.parse_args()
    smoke = args.cpu_smoke
    devices, wpd, backends = layout(args)
    info = C.machine_info()
    flags = ["--workers-per-device", str(wpd)]
    if args.build_processes is not None:
        flags += ["--build-processes", str(args.build_processes)]
    if args.standing_judges is not None:
        flags += ["--standing-judges-per-device", str(args.standing_judges)]
    if not smoke:
        flags += ["--devices", ",".join(devices)]
    planned = plan(args.count, args.mix, backends, args.seed)
    expected = SMOKE_EXPECTED if smoke else EXPECTED
    data: dict[str, Any] = {
        "count": args.count, "mix": args.mix, "devices": len(devices) if not smoke else 0,
        "workers_per_device": wpd, "backends": backends, "steps": [],
        "standing_judges_per_device": args.standing_judges or 2,
    }  # fmt: skip
    # Each configuration's service on one state folder: the precompiled headers are made once.
    root = Path(tempfile.mkdtemp(prefix="kerneleval-rl-step-"))
    configs = args.configs.split("|") if args.configs else [""]
    runs: list[dict[str, Any]] = []
    try:
        for extra in configs:
            run: dict[str, Any] = {"flags": extra, "steps": []}
            try:
                one_config(run, flags + extra.split(), root, args, planned, expected, smoke)
            except KeyboardInterrupt:  # cut at its time limit: the steps done are written
                run["cut_after_steps"] = len(run["steps"])
                if run["steps"]:
                    runs.append(run)
                if not runs:
                    raise
                break
            runs.append(run)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # the headers: ~5 GB
    data.update({k: v for k, v in runs[0].items() if k != "flags"})
    data["configs"] = runs
    walls = [s["wall_s"] for s in data["steps"]]
    data["median_wall_s"] = statistics.median(walls)
    best = min(data["steps"], key=lambda s: abs(s["wall_s"] - data["median_wall_s"]))
    gpus = data["devices"]
    where = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus else "the CPU (smoke)"
    tables = [
        (f"one RL step: {args.count} candidates through RunBatch at once, {where}",
         ["step", "wall s", "finished", "as planted", "window held (share of wall)"],
         [[i, s["wall_s"], s["finished"], s["as_planted"], json.dumps(
             {k: round(v, 2) for k, v in s["timing_window_fraction"].items()})]
          for i, s in enumerate(data["steps"])]),
    ]  # fmt: skip
    for i, st in enumerate(data["steps"]):
        what = "the first: no problem's GPU memory known yet" if i == 0 else "footprints known"
        tables.append((f"step {i} ({what}): where the jobs' time went, job-seconds",
                       ["phase", "sum s", "share", "median s", "max s"],
                       phase_rows(st["jobs"])))  # fmt: skip
        tables.append(
            (
                f"step {i}: the judges' timed phases, ms per timed job "
                "(in windows: less the waits)",
                ["part", "jobs", "median ms", "max ms"],
                S.window_rows(j["window_parts"] for j in st["jobs"]),
            )
        )
    kinds: dict[tuple[str, str], list[int]] = {}
    for j in best["jobs"]:
        k = kinds.setdefault((j["backend"], j["kind"]), [0, 0])
        k[0] += 1
        k[1] += j["as_planted"]
    tables.append((
        "verdicts against what was planted (the median step)",
        ["backend", "planted", "candidates", "as planted"],
        [[b, k, n[0], n[1]] for (b, k), n in sorted(kinds.items())],
    ))  # fmt: skip
    off = [f"{j['problem']} {j['backend']} {j['kind']}: {j['verdict']} ({j['why'][:160]})"
           for s in data["steps"] for j in s["jobs"] if not j["as_planted"]]  # fmt: skip
    notes = [
        f"step wall time: median {data['median_wall_s']:.1f} s over {len(walls)} steps "
        f"({', '.join(f'{w:.1f}' for w in walls)}); {wpd} job processes per GPU, "
        f"{data['standing_judges_per_device']} standing judges per GPU",
        f"mix: {args.mix}; options: KernelBench's (seed 42, 1 correctness trial, 10 timed)",
        f"precompiled headers made at start in {data['pch_s']:.1f} s (before the steps)",
        "not as planted: " + ("; ".join(off[:8]) if off else "none"),
    ]
    for i, st in enumerate(data["steps"]):
        alone = st.get("alone_reruns", [])
        if alone:  # each held its GPU from new jobs until it ended
            notes.append(f"step {i}: {len(alone)} job(s) re-run alone after running out of "
                         f"memory beside others; the first: {alone[0]['why'][:200]}")  # fmt: skip
    if "cut_after_steps" in data:
        notes.append(f"cut at its time limit after {data['cut_after_steps']} of {args.steps} steps")
    tables.insert(1, (
        "the cold start (service start to the first verdict, on the state folder as the "
        "configuration found it) and what the service held ready before each step",
        ["service flags", "headers made s", "pool ready s", "first verdict s",
         "processes before each step", "GPU memory before each step (MiB)"],
        [cold_row(r) for r in runs],
    ))  # fmt: skip
    tables.append((
        "GPU memory during each step: the peaks job processes reported (what admission learns"
        " its footprints from), by side, and the most the GPU held (nvidia-smi, every "
        f"{SAMPLE_S} s) with its share by role then, MiB",
        ["service flags", "step", "kernel peak (median)", "judge peak (median)", "GPU at most",
         "busy", "standing judges judging", "standing judges idle", "idle + spare",
         "other (leaving)", "re-runs alone",
         "while jobs wait for a process: busy / ready / spare / judging (median counts)"],
        [memory_row(r, i) for r in runs for i in range(len(r["steps"]))],
    ))  # fmt: skip
    if len(configs) > 1:
        tables.insert(2, (
            "configurations of the service, one after the other on one state folder",
            ["service flags", "steps", "wall s", "median s", "as planted",
             "waiting for a process (share)", "window held (share of wall)",
             "processes started", "re-runs alone", "OpenWindow ms", "window held ms"],
            [config_row(r) for r in runs],
        ))  # fmt: skip
        notes.append(f"configurations run: {len(runs)} of {len(configs)}")
    name = f"bench_rl_step_{gpus}gpu" if gpus else "bench_rl_step_smoke"
    C.write_results(args.out, name, "The RL step benchmark (issue 19)", info, data, tables, notes)
    done = all(s["finished"] == args.count for s in data["steps"]) and "cut_after_steps" not in data
    return 0 if not off and done else 1


if __name__ == "__main__":
    sys.exit(main())
