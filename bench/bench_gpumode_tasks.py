"""Every GPU MODE task folder (gpu-mode/reference-kernels problems/) through the service.

Finds every folder with a task.yml under --tasks, decides per folder whether this machine can
run it, and sends the runnable ones' submissions to the service as GPU MODE jobs compared with
the task's reference (`kerneleval gpumode`'s client API: gpumode.load_task, spec_from_task,
Compare), with the service's defaults (100 timed trials, 10 warm-ups, every test and benchmark
case).

Whether a folder can run here, in this order (the first reason found is the one stated):

1. task.yml must load (gpumode.load_task): a folder it refuses is a failure, not a skip.
2. a multi-GPU task (`multi_gpu: true`, or a case's `world_size` over 1) is skipped: a job runs
   on one GPU (GPU MODE launches one process per rank through its own eval.py).
3. reference.py must define GPU MODE's functions (generate_input, ref_kernel,
   check_implementation): a task with its own harness (its eval.py and other names) is skipped.
4. every module the reference and the task's shared files import must be installed here
   (found by importlib.util.find_spec, e.g. aiter on an NVIDIA machine); a submission that
   imports one that is not (helion, cutlass) is skipped alone.
5. tried: the reference itself as the submission (`custom_kernel = ref_kernel`) on the task's
   first test case, not timed. A task whose reference cannot run on this GPU (ROCm-only
   dtypes, Blackwell's fp4 on a GPU of compute capability under 10, a CUDA-only reference on
   the CPU) fails there, and is skipped with that job's message. A task whose every
   submission needs what is not installed (helion) is skipped after it.

Then, per runnable task, cheapest first (the task's own test_timeout + benchmark_timeout, then
its cases' sizes), the folder's submission.py and every file under solutions/correct/ and
submissions/ (--with-wrong adds solutions/wrong/, expected INCORRECT), --in-flight at a time
(default: one per job process, --workers-per-device 4). No job starts after --budget-s (from
the script's start); each job's timeout is --job-timeout-s (the service's 120 s), at most what
is left of the budget plus --tail-s, and the client cancels one still running then. An
interrupt (run_gpu.sh's SIGINT at its limit) still writes what finished.

Recorded per job: task, submission, verdict, runtime (ms: the geometric mean over the benchmark
cases of their medians, as GPU MODE ranks), the reference's, the speedup, the timing source,
the integrity flags, the notes, the error message, the cases passed, the wall time. Results:
<out>/bench_gpumode_tasks.json and .md, with a summary (tasks found, skipped and why, runnable,
jobs OK and not OK, each not-OK one with its reason).

    PYTHONPATH=server:clients/python/src python3 bench/bench_gpumode_tasks.py --out DIR \\
        [--tasks .carry/reference-kernels/problems]
    ... --cpu-smoke   # here, without a GPU: each task's first 3 tests and first benchmark, 3
                      # timed trials (tests/gpumode_tasks runs on the CPU; most reference-kernels
                      # references ask for CUDA and are skipped with their error)
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from kerneleval import errors, gpumode  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

DEFAULT_TASKS = ".carry/reference-kernels/problems"
NAME = "bench_gpumode_tasks"
REFERENCE_FUNCTIONS = ("generate_input", "ref_kernel", "check_implementation")
DEFAULT_TIMEOUT_S = 180  # GPU MODE's per-mode timeout where task.yml gives none
# The modules a task's sources import from each other (the harness's files and its own).
HARNESS_MODULES = frozenset({"reference", "submission", "eval", "task", "utils"})
SUBMISSION_DIRS = ("solutions/correct", "submissions")
WRONG_DIR = "solutions/wrong"
OK = "VERDICT_OK"
# The probe's source: the task's reference, its ref_kernel as the submission's kernel.
PROBE_SUFFIX = "\n\n# kerneleval bench: the reference run as its own submission\n" \
    "custom_kernel = ref_kernel\n"  # fmt: skip


@dataclass
class Submission:
    label: str  # its path in the task folder, e.g. "solutions/correct/ref.py"
    path: Path
    expected: str = OK
    missing: list[str] = field(default_factory=list)  # modules it imports that are absent


@dataclass
class TaskFolder:
    name: str  # its path under --tasks, e.g. "pmpp_v2/vectoradd_py"
    directory: Path
    parsed: dict[str, Any] = field(default_factory=dict)
    task: gpumode.Task | None = None
    skip: str = ""  # why it is not run ("": it is)
    error: str = ""  # why it could not even be read (a failure, counted as not OK)
    submissions: list[Submission] = field(default_factory=list)
    cost: tuple[float, ...] = (0.0,)


# -- finding and judging the task folders (no service) --------------------------------------


def find_tasks(root: Path) -> list[Path]:
    return sorted({p.parent for p in root.rglob("task.yml") if p.is_file()})


def imported_modules(source: str) -> set[str]:
    """The top-level modules a source imports (absolute imports only; those under a try whose
    handler takes ImportError are optional and left out)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    optional: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for inner in node.body:
                optional.update(id(n) for n in ast.walk(inner))
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return handler.type is None or any(
        isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
        for n in names
    )


def missing_modules(sources: list[str], own: set[str]) -> list[str]:
    """Modules the sources import that are neither the task's own, the standard library's,
    nor installed here (tried with importlib.util.find_spec)."""
    missing = set()
    for name in set().union(*(imported_modules(s) for s in sources)) if sources else set():
        if name in own or name in HARNESS_MODULES or name in sys.stdlib_module_names:
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.add(name)
    return sorted(missing)


def defined_names(source: str) -> set[str]:
    """The module-level names a source defines or imports."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names)
    return out


def world_size(parsed: dict[str, Any]) -> int:
    sizes = [
        case.get("world_size", 1)
        for key in ("tests", "benchmarks")
        for case in (parsed.get(key) or [])
        if isinstance(case, dict)
    ]
    return max([s for s in sizes if isinstance(s, int)] or [1])


def case_size(case: Any) -> float:
    """A rough size of a case: the product of its integer values but the seed."""
    if not isinstance(case, dict):
        return 1.0
    size = 1.0
    for key, value in case.items():
        values = value if isinstance(value, list) else [value]
        if key == "seed" or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            continue
        size *= max(1, sum(values))
    return size


def task_cost(parsed: dict[str, Any]) -> tuple[float, ...]:
    """Cheapest first: the task's own timeouts (its authors' estimate), then its size."""
    timeouts = sum(
        float(v) if isinstance(v := parsed.get(k), (int, float)) else DEFAULT_TIMEOUT_S
        for k in ("test_timeout", "benchmark_timeout")
    )
    cases = [*(parsed.get("tests") or []), *(parsed.get("benchmarks") or [])]
    return (timeouts, sum(case_size(c) for c in cases), len(cases))


def submissions_of(directory: Path, with_wrong: bool) -> list[Submission]:
    out = []
    if (directory / gpumode.DEFAULT_SUBMISSION).is_file():
        out.append(Submission(gpumode.DEFAULT_SUBMISSION, directory / gpumode.DEFAULT_SUBMISSION))
    dirs = [*SUBMISSION_DIRS, *([WRONG_DIR] if with_wrong else [])]
    for sub in dirs:
        for path in sorted((directory / sub).glob("*.py")):
            expected = "VERDICT_INCORRECT" if sub == WRONG_DIR else OK
            out.append(Submission(str(path.relative_to(directory)), path, expected))
    return out


def examine(root: Path, directory: Path, gpu_count: int, with_wrong: bool) -> TaskFolder:
    """A task folder and, without running anything, whether it can run here."""
    t = TaskFolder(str(directory.relative_to(root)), directory)
    try:
        t.parsed = gpumode.parse_task_yml(
            (directory / "task.yml").read_text(encoding="utf-8"), str(directory / "task.yml")
        )
        t.task = gpumode.load_task(directory)
        t.cost = task_cost(t.parsed)
    except (gpumode.TaskError, OSError) as e:
        t.error = f"kerneleval cannot read the task: {e}"
        return t
    t.submissions = submissions_of(directory, with_wrong)
    ranks = world_size(t.parsed)
    if t.parsed.get("multi_gpu") or ranks > 1:
        t.skip = (
            f"multi-GPU task (multi_gpu: {t.parsed.get('multi_gpu', False)}, world_size "
            f"{ranks}; this machine has {gpu_count} GPU(s)): GPU MODE runs one process per rank "
            "through its own eval.py, a kerneleval job runs on one GPU"
        )
        return t
    lacking = [f for f in REFERENCE_FUNCTIONS if f not in defined_names(t.task.reference)]
    if lacking:
        t.skip = (
            f"its own harness (config.main {t.parsed.get('config', {}).get('main', '?')}): "
            f"reference.py defines no {', '.join(lacking)}"
        )
        return t
    own = {f.name.removesuffix(".py") for f in t.task.task.files}
    missing = missing_modules([t.task.reference, *(f.content for f in t.task.task.files)], own)
    if missing:
        t.skip = f"its reference needs {', '.join(missing)}, not installed here"
        return t
    if not t.submissions:
        t.skip = "no submission in the folder"
        return t
    for s in t.submissions:
        s.missing = missing_modules([s.path.read_text(encoding="utf-8", errors="replace")], own)
    return t


# -- running jobs -----------------------------------------------------------------------------


@dataclass
class Job:
    task: TaskFolder
    label: str  # the submission's label, or "(reference as its kernel)" for a probe
    spec: kernel_pb2.JobSpec
    expected: str = OK
    probe: bool = False
    row: dict[str, Any] = field(default_factory=dict)


def job_row(job: job_pb2.Job) -> dict[str, Any]:
    r = job.result
    verdict = (
        job_pb2.Verdict.Name(r.verdict) if r.verdict in job_pb2.Verdict.values() else str(r.verdict)
    )
    message = (
        r.compilation_error or r.validation_error or r.error.message or r.fault.description
        or job.state_reason
    )  # fmt: skip
    cases = [*r.test_cases, *r.benchmark_cases]
    return {
        "job_id": job.job_id,
        "state": job_pb2.JobState.Name(job.state),
        "verdict": verdict,
        "failed_side": job_pb2.Side.Name(r.failed_side),
        "runtime_ms": r.runtime.median_ms,
        "reference_ms": r.reference_runtime.median_ms,
        "speedup": r.speedup,
        "timing_source": job_pb2.TimingSource.Name(r.runtime.source),
        "flags": [f.rule_id for f in r.flags],
        "notes": list(r.notes),
        "timed": timed_by(list(r.notes), r.runtime.median_ms),
        "message": message,
        "cases_passed": f"{sum(1 for c in cases if c.passed)}/{len(cases)}",
        "run_s": C.ts(job.end_time) - C.ts(job.start_time) if job.end_time.seconds else 0.0,
        "cases": [
            {
                "spec": c.spec,
                "passed": c.passed,
                "message": c.message[:300],
                "median_ms": c.runtime.median_ms,
                "reference_ms": c.reference_runtime.median_ms,
            }
            for c in cases
        ],  # fmt: skip
    }


def timed_by(notes: list[str], runtime_ms: float) -> str:
    """Who timed the kernel: its judge, from outside its process, or its own process."""
    if any(n.startswith("timed from outside") for n in notes):
        return "outside"
    if runtime_ms > 0:
        return "own process"
    return ""


class Runner:
    """Sends jobs `in_flight` at a time; none starts after `start_by` (time.monotonic()), each
    is cancelled if still running at `end_by` (+ CANCEL_AFTER_S) and given up on GIVE_UP_S
    later. An interrupt (run_gpu.sh's SIGINT at its limit) stops it: what finished is kept."""

    CANCEL_AFTER_S = 15.0
    GIVE_UP_S = 20.0

    def __init__(
        self, svc: C.Service, in_flight: int, start_by: float, end_by: float, job_timeout: float
    ) -> None:
        self.svc = svc
        self.in_flight = in_flight
        self.start_by = start_by
        self.end_by = end_by
        self.job_timeout = job_timeout
        self.stopped = threading.Event()

    def run(self, jobs: list[Job]) -> None:
        queue = list(jobs)
        lock = threading.Lock()

        def worker() -> None:
            with self.svc.client(timeout=60) as c:
                while True:
                    with lock:
                        if not queue:
                            return
                        job = queue.pop(0)
                    if self.stopped.is_set() or time.monotonic() > self.start_by:
                        why = "interrupted" if self.stopped.is_set() else "the budget ran out first"
                        job.row = {"verdict": "NOT_RUN", "message": why}
                        continue
                    self._one(c, job)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.in_flight)]
        for th in threads:
            th.start()
        try:
            for th in threads:
                th.join()
        except KeyboardInterrupt:
            self.stopped.set()
            print("interrupted: the jobs that finished are reported", flush=True)
        for job in jobs:
            job.row = job.row or {"verdict": "NOT_RUN", "message": "interrupted while running"}

    def _one(self, c: Any, job: Job) -> None:
        t = time.perf_counter()
        left = self.end_by - time.monotonic()
        spec = kernel_pb2.JobSpec()
        spec.CopyFrom(job.spec)
        spec.options.timeout.seconds = int(max(5, min(self.job_timeout, left)))
        try:
            submitted = c.submit(spec)
            done = self._wait(c, submitted.job_id)
            job.row = job_row(done)
            if done.state not in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_FAILED):
                job.row["verdict"] = job_pb2.JobState.Name(done.state)
                job.row["message"] = (
                    "cancelled by the bench at the end of its budget"
                    if done.state == job_pb2.JOB_STATE_CANCELLED
                    else "still running when the bench stopped"
                )
        except errors.KernelEvalError as e:
            job.row = {"verdict": "RPC_ERROR", "message": f"{type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 - the bench goes on: the row says what broke
            job.row = {"verdict": "BENCH_ERROR", "message": f"{type(e).__name__}: {e}"}
        job.row["wall_s"] = time.perf_counter() - t
        r = job.row
        print(f"  {job.task.name} {job.label}: {r['verdict']} {r.get('runtime_ms', 0):.4g} ms "
              f"{r['wall_s']:.1f} s {str(r.get('message', ''))[:160]!r}", flush=True)  # fmt: skip

    def _wait(self, c: Any, job_id: str) -> job_pb2.Job:
        cancel_at = self.end_by + self.CANCEL_AFTER_S
        cancelled = False
        while True:
            job = c.get_job(job_id)
            if job.state in (
                job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED
            ):  # fmt: skip
                return job
            now = time.monotonic()
            if self.stopped.is_set() or now > cancel_at + self.GIVE_UP_S:
                return job  # still running: its state stands for its verdict in the report
            if now > cancel_at and not cancelled:
                c.cancel_job(job_id)
                cancelled = True
            time.sleep(0.25)


def probe_spec(t: TaskFolder, smoke: bool) -> kernel_pb2.JobSpec:
    """The task's reference as its own submission on its first test case, not timed."""
    assert t.task is not None
    spec = gpumode.spec_from_task(
        t.task, t.task.reference + PROBE_SUFFIX, client_tag="bench-gpumode-probe"
    )
    del spec.gpu_mode.tests[1:]
    del spec.gpu_mode.benchmarks[:]
    spec.options.perf_trial_count = 0
    return spec


def submission_spec(t: TaskFolder, s: Submission, smoke: bool) -> kernel_pb2.JobSpec:
    assert t.task is not None
    spec = gpumode.spec_from_task(
        t.task, s.path.read_text(encoding="utf-8"), client_tag="bench-gpumode",
        labels={"task": t.name.replace("/", ".")[:200]},
    )  # fmt: skip
    if smoke:  # the CPU: the first 3 tests, the first benchmark timed a few times
        del spec.gpu_mode.tests[3:]
        del spec.gpu_mode.benchmarks[1:]
        spec.options.perf_trial_count = 3
        spec.options.warmup_count = 1
    return spec


def probe_reason(row: dict[str, Any]) -> str:
    """Why a task's reference cannot run here, from its probe's row ("": it can)."""
    if row.get("verdict") == OK:
        return ""
    message = " ".join(str(row.get("message", "")).split())
    first = message.split(". ", 1)[0]  # torch's CUDA errors run on for lines
    return f"its reference cannot run here ({row.get('verdict')}): {first[:240]}"


# -- the report -------------------------------------------------------------------------------


def short_notes(notes: list[str]) -> str:
    kept = [n for n in notes if not n.startswith("timed from outside")][:3]
    return "; ".join(n[:120] for n in kept)


def main() -> int:
    began = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap)
    ap.add_argument(
        "--tasks", nargs="+", default=[DEFAULT_TASKS],
        help="problems/ trees (or task folders); with several, each task named under its tree",
    )  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no job after this")
    ap.add_argument("--tail-s", type=float, default=45.0, help="jobs end by budget + this")
    ap.add_argument("--job-timeout-s", type=float, default=120.0, help="a job's timeout")
    ap.add_argument("--workers-per-device", type=int, default=0, help="(default 4; smoke 2)")
    ap.add_argument("--in-flight", type=int, default=0, help="jobs at a time (the workers)")
    ap.add_argument("--with-wrong", action="store_true", help="solutions/wrong/ too")
    ap.add_argument("--only", default="", help="only tasks whose name contains this")
    ap.add_argument("--nvml", default="", help="the service's --nvml (default: real; smoke none)")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    info = C.machine_info()
    tasks: list[TaskFolder] = []
    for given in args.tasks:
        root = Path(given)
        if not root.is_dir():
            raise SystemExit(
                f"no folder {root}: pass --tasks (gpu-mode/reference-kernels' problems/)"
            )
        top = root.parent if (root / "task.yml").is_file() else root  # one task folder
        for d in find_tasks(root):
            t = examine(top, d, info["gpu_count"], args.with_wrong)
            if len(args.tasks) > 1:
                t.name = f"{top.name}/{t.name}"
            if args.only in t.name:
                tasks.append(t)
    tasks.sort(key=lambda t: (t.cost, t.name))
    print(f"{len(tasks)} task folders under {' '.join(args.tasks)}", flush=True)
    for t in tasks:
        print(f"  {t.name}: {t.error or t.skip or 'to try'}", flush=True)

    wpd = args.workers_per_device = args.workers_per_device or (2 if smoke else 4)
    args.in_flight = args.in_flight or wpd
    flags = ["--workers-per-device", str(wpd)] + ([] if smoke else ["--devices", "0"])
    nvml = args.nvml or ("none" if smoke else "real")
    start_by = began + args.budget_s
    end_by = start_by + args.tail_s
    probes: list[Job] = []
    jobs: list[Job] = []
    svc = C.Service(flags, nvml=nvml).start()
    try:
        svc.wait_workers(wpd)
        runner = Runner(svc, args.in_flight, start_by, end_by, args.job_timeout_s)
        tried = [t for t in tasks if not (t.error or t.skip)]
        probes = [Job(t, "(reference as its kernel)", probe_spec(t, smoke), probe=True)
                  for t in tried]  # fmt: skip
        print(f"\nprobing {len(probes)} references", flush=True)
        runner.run(probes)
        for p in probes:
            p.task.skip = probe_reason(p.row)
        for t in tried:
            if not t.skip and all(s.missing for s in t.submissions):
                needs = sorted({m for s in t.submissions for m in s.missing})
                t.skip = f"every submission needs {', '.join(needs)}, not installed here"
        for t in tried:
            for s in [] if t.skip else t.submissions:
                if s.missing:
                    continue
                jobs.append(Job(t, s.label, submission_spec(t, s, smoke), s.expected))
        print(f"\nrunning {len(jobs)} submissions", flush=True)
        runner.run(jobs)
        log_tail = svc.tail()[-3000:]
    finally:
        svc.stop()
    return report(args, info, tasks, probes, jobs, log_tail, time.monotonic() - began)


def report(
    args: argparse.Namespace, info: dict[str, Any], tasks: list[TaskFolder], probes: list[Job],
    jobs: list[Job], log_tail: str, wall_s: float,
) -> int:  # fmt: skip
    skipped_subs = [
        (t, s) for t in tasks if not (t.error or t.skip) for s in t.submissions if s.missing
    ]
    runnable = [t for t in tasks if not (t.error or t.skip)]
    ran = [j for j in jobs if j.row.get("verdict") != "NOT_RUN"]
    good = [j for j in ran if j.row.get("verdict") == j.expected]
    bad = [j for j in ran if j.row.get("verdict") != j.expected]
    not_run = [j for j in jobs if j.row.get("verdict") == "NOT_RUN"]
    unread = [t for t in tasks if t.error]
    cols = ["task", "submission", "verdict", "runtime_ms", "reference_ms", "speedup",
            "timing_source", "timed", "flags", "cases_passed", "wall_s", "notes",
            "message"]  # fmt: skip

    def cells(j: Job) -> list[Any]:
        r = j.row
        return [
            j.task.name, j.label, r.get("verdict", ""), r.get("runtime_ms", 0.0),
            r.get("reference_ms", 0.0), r.get("speedup", 0.0),
            str(r.get("timing_source", "")).removeprefix("TIMING_SOURCE_"), r.get("timed", ""),
            ",".join(r.get("flags", [])), r.get("cases_passed", ""), r.get("wall_s", 0.0),
            short_notes(r.get("notes", [])), " ".join(str(r.get("message", "")).split())[:200],
        ]  # fmt: skip

    summary = {
        "tasks_found": len(tasks),
        "tasks_runnable": len(runnable),
        "tasks_skipped": len([t for t in tasks if t.skip]),
        "tasks_unreadable": len(unread),
        "tasks_all_as_expected": len(
            [
                t
                for t in runnable
                if all(j.row.get("verdict") == j.expected for j in jobs if j.task is t)
            ]
        ),  # fmt: skip
        "jobs": len(jobs),
        "jobs_run": len(ran),
        "jobs_as_expected": len(good),
        "jobs_not_as_expected": len(bad),
        "jobs_not_run": len(not_run),  # the budget ran out, or interrupted
        "submissions_skipped_missing_modules": len(skipped_subs),
        "wall_s": round(wall_s, 1),
    }
    summary_rows = [[k, v] for k, v in summary.items()]
    for j in bad:
        why = " ".join(str(j.row.get("message", "")).split())[:200]
        summary_rows.append([f"not OK: {j.task.name} {j.label}",
                             f"{j.row.get('verdict')} (expected {j.expected}): {why}"])  # fmt: skip
    for t in unread:
        summary_rows.append([f"not OK: {t.name}", t.error[:300]])
    skip_rows = [[t.name, t.skip] for t in tasks if t.skip]
    skip_rows += [[f"{t.name} {s.label}", f"the submission needs {', '.join(s.missing)}, "
                   "not installed here"] for t, s in skipped_subs]  # fmt: skip
    probe_cols = ["task", "verdict", "wall_s", "message"]
    tables = [
        ("summary", ["what", "value"], summary_rows),
        ("jobs (cheapest task first)", cols, [cells(j) for j in jobs]),
        ("skipped", ["task", "why"], skip_rows),
        ("probes: each reference as its own kernel, first test case, not timed", probe_cols,
         [[p.task.name, p.row.get("verdict", ""), p.row.get("wall_s", 0.0),
           " ".join(str(p.row.get("message", "")).split())[:200]] for p in probes]),
    ]  # fmt: skip
    notes = [
        "runtime_ms: the geometric mean over the task's benchmark cases of their medians (GPU "
        "MODE ranks by the geometric mean); speedup: ref_kernel's over the submission's",
        f"options: the service's defaults{' (smoke: 3 trials, first benchmark)' if args.cpu_smoke else ''}; "  # noqa: E501
        f"budget {args.budget_s:g} s, job timeout {args.job_timeout_s:g} s, {args.in_flight} in flight, {args.workers_per_device} workers",  # noqa: E501
    ]  # fmt: skip

    def dump(j: Job) -> dict[str, Any]:
        return {"task": j.task.name, "submission": j.label, "expected": j.expected, **j.row}

    data = {
        "summary": summary,
        "tasks": [
            {"task": t.name, "skip": t.skip, "error": t.error, "cost": list(t.cost),
             "gpus": t.parsed.get("gpus"),
             "submissions": [s.label for s in t.submissions],
             "missing": {s.label: s.missing for s in t.submissions if s.missing}}
            for t in tasks
        ],
        "probes": [dump(p) for p in probes],
        "jobs": [dump(j) for j in jobs],
        "service_log": log_tail,
    }  # fmt: skip
    C.write_results(args.out, NAME, "GPU MODE reference-kernels tasks (issue 43)", info, data,
                    tables, notes)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
