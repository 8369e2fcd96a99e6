"""A KernelBench run evaluated through the service: every generated kernel of RUN_DIR against
its problem, KernelBench's result JSON per kernel, and the summary KernelBench reports.

Layout, as KernelBench's scripts make it: RUN_DIR/level_{L}_problem_{P}_sample_{S}_kernel.py
(generate_samples.py) against PROBLEMS/{P}_{Name}.py (PROBLEMS is a level's folder, e.g.
KernelBench/level1, or the folder holding level{L}/). Each finished kernel's result is written
at once to RUN_DIR/kerneleval/level_{L}_problem_{P}_sample_{S}.json in the shape of an entry of
KernelBench's eval_results.json; a run started again skips the kernels that have one, so an
interrupted run resumes. At the end RUN_DIR/eval_results.json ({problem id: [entries]}, as
eval_from_generations.py writes it) and RUN_DIR/analysis_results.json (as
benchmark_eval_analysis.py writes it: compile and correctness rates, fast_p, the geometric mean
speedup of the correct kernels) are written from every result file. With
--compile-baseline (EvalOptions.compile_baseline) each entry also has the reference under
torch.compile (ref_runtime_compile, ref_runtime_compile_stats, its compile time in the metadata)
and the summary a second set of speedup metrics over it (speedup_metrics_torch_compile), as
KernelBench's run_and_check.py reports the speedup over eager and over torch.compile.

A kernel the service could not run on its host (VERDICT_CANNOT_RUN_HERE: it needs a GPU the
host lacks) is not evaluated, as when KernelBench's eval returns None: its entry says
"evaluated": false, the summary counts it as a problem without a result (in every rate's and
fast_p's denominator, never compiled or correct) and in `not_evaluated_count`, and the next run
evaluates it again.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kerneleval.kernelbench import job_from_sources, kernelbench_options
from kerneleval.v1 import job_pb2, kernel_pb2

RESULTS_DIR = "kerneleval"
# benchmark_eval_analysis.py's thresholds.
FAST_P_THRESHOLDS = (0.0, 0.5, 0.8, 1.0, 1.5, 2.0)
_KERNEL_NAME = re.compile(r"^level_(\d+)_problem_(\d+)_sample_(\d+)_kernel\.py$")
_PROBLEM_NAME = re.compile(r"^(\d+)_.*\.py$")


class RunError(ValueError):
    """Bad input: a missing folder, a duplicate problem id, a bad --subset or --inputs."""


@dataclass(frozen=True)
class Sample:
    """One generated kernel and its problem."""

    level: int
    problem_id: int
    sample_id: int
    kernel: Path
    problem: Path

    @property
    def name(self) -> str:
        return f"level_{self.level}_problem_{self.problem_id}_sample_{self.sample_id}"


def find_problems(path: Path, level: int) -> dict[int, Path]:
    """Problem id -> file: PATH's {id}_{name}.py files, or those of PATH/level{L}."""
    if not path.is_dir():
        raise RunError(f"--problems {path}: not a folder")
    nested = path / f"level{level}"
    folder = nested if nested.is_dir() else path
    problems: dict[int, Path] = {}
    for f in sorted(folder.iterdir()):
        m = _PROBLEM_NAME.match(f.name)
        if not m or not f.is_file():
            continue
        pid = int(m.group(1))
        if pid in problems:
            raise RunError(f"problem {pid} twice in {folder}: {problems[pid].name} and {f.name}")
        problems[pid] = f
    if not problems:
        raise RunError(f"no problem files ({{id}}_{{name}}.py) in {folder}")
    return problems


def parse_subset(text: str) -> set[int]:
    """ "19,21,30-35" -> those problem ids (ranges inclusive, as KernelBench's subset)."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            ids.update(range(int(lo), int(hi) + 1) if sep else [int(part)])
        except ValueError:
            raise RunError(f"--subset: {part!r} is not an id or a range like 30-35") from None
    return ids


def find_samples(
    run_dir: Path, level: int, problems: Mapping[int, Path]
) -> tuple[list[Sample], list[str]]:
    """The run's kernels of this level with a problem, and a note per kernel without one."""
    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: not a folder")
    samples, notes = [], []
    for f in sorted(run_dir.iterdir()):
        m = _KERNEL_NAME.match(f.name)
        if not m or int(m.group(1)) != level:
            continue
        pid, sid = int(m.group(2)), int(m.group(3))
        if pid not in problems:
            notes.append(f"{f.name}: no problem {pid} in the problems folder; skipped")
            continue
        samples.append(Sample(level, pid, sid, f, problems[pid]))
    samples.sort(key=lambda s: (s.problem_id, s.sample_id))
    return samples, notes


def load_inputs(path: Path | None) -> dict[int, kernel_pb2.IOContract]:
    """--inputs: {"19": IOContract (proto3 JSON), ...}, inputs that replace those problems'
    get_inputs() (e.g. smaller shapes on a host without a GPU)."""
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise RunError(f"--inputs {path}: expected an object {{problem id: IOContract}}")
        return {int(k): json_format.ParseDict(v, kernel_pb2.IOContract()) for k, v in raw.items()}
    except (OSError, ValueError, json_format.ParseError) as e:
        raise RunError(f"--inputs {path}: {e}") from None


def job_spec(
    sample: Sample,
    options: kernel_pb2.EvalOptions | None = None,
    inputs: Mapping[int, kernel_pb2.IOContract] | None = None,
    client_tag: str = "kernelbench",
) -> kernel_pb2.JobSpec:
    """The job of one kernel: compared with its problem, KernelBench's options by default."""
    spec = job_from_sources(
        sample.kernel.read_text(encoding="utf-8"),
        sample.problem.read_text(encoding="utf-8"),
        kernel_filename=sample.kernel.name,
        reference_filename=sample.problem.name,
        options=options if options is not None else kernelbench_options(),
        client_tag=client_tag,
        reference_io=(inputs or {}).get(sample.problem_id),
    )
    spec.labels.update(
        {
            "level": str(sample.level),
            "problem": str(sample.problem_id),
            "sample": str(sample.sample_id),
        }
    )
    return spec


def not_evaluated(job: job_pb2.Job) -> bool:
    """The job could not run on the service's host: not a result about the kernel."""
    return job.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE


def evaluated(entry: Mapping[str, Any]) -> bool:
    """Whether a result entry judged its kernel (entries written before the key was: yes)."""
    return entry.get("evaluated", True) is not False


def _passed(r: job_pb2.EvalResult) -> bool:
    if r.correctness_status == job_pb2.CORRECTNESS_UNSPECIFIED:
        return r.correctness  # a service older than correctness_status
    return r.correctness_status == job_pb2.CORRECTNESS_PASSED


def _runtime_stats(s: job_pb2.RuntimeStats, device: job_pb2.DeviceInfo) -> dict[str, Any]:
    """KernelBench's runtime_stats keys (ms; its mean is `runtime`), plus the median and p95."""
    if not s.trial_count:
        return {}
    return {
        "mean": s.mean_ms,
        "std": s.std_ms,
        "min": s.min_ms,
        "max": s.max_ms,
        "num_trials": s.trial_count,
        "median": s.median_ms,
        "p95": s.p95_ms,
        "hardware": device.name,
        "device": "cpu" if device.index < 0 else f"cuda:{device.index}",
    }


def kernelbench_entry(
    sample_id: int, job: job_pb2.Job, compile_baseline: bool = False
) -> dict[str, Any]:
    """A finished job as an entry of KernelBench's eval_results.json: sample_id, compiled,
    correctness, metadata, runtime (mean ms, -1.0 when not timed), runtime_stats, and the
    reference's (ref_runtime, ref_runtime_stats: KernelExecResult's fields); `evaluated`
    false when the kernel could not run on the service's host (neither correct nor wrong).
    `compile_baseline` (the job asked for it): also the reference under torch.compile
    (ref_runtime_compile, -1.0 when it has no time, and ref_runtime_compile_stats)."""
    r = job.result
    correct = job.state == job_pb2.JOB_STATE_DONE and _passed(r)
    meta: dict[str, Any] = {"hardware": r.device.name, "device": _runtime_device(r)}
    if not_evaluated(job):
        meta["not_evaluated"] = "not run here (needs a GPU): " + (
            r.error.message.strip().splitlines()[0] if r.error.message.strip() else "no CUDA"
        )
    if r.compilation_error:
        meta["compilation_error"] = r.compilation_error
    if (r.error.message or r.error.exception_type) and not not_evaluated(job):
        key = "reference_error" if r.failed_side == job_pb2.SIDE_REFERENCE else "runtime_error"
        meta[key] = r.error.message
        meta[f"{key}_name"] = r.error.exception_type
    if r.validation_error:
        meta["correctness_issue"] = r.validation_error
    if r.validation.trial_count:
        meta["correctness_trials"] = f"({r.validation.trials_passed} / {r.validation.trial_count})"
        if not correct:
            meta["max_difference"] = [f"{r.validation.max_abs_error:.6f}"]
    if r.fault.description:
        meta["fault"] = r.fault.description
    if r.speedup_suspicious:
        meta["excessive_speedup"] = True
    meta["kerneleval_job_id"] = job.job_id
    meta["kerneleval_state"] = job_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
    meta["kerneleval_verdict"] = job_pb2.Verdict.Name(r.verdict).removeprefix("VERDICT_")
    if r.failed_side != job_pb2.SIDE_UNSPECIFIED:
        meta["kerneleval_failed_side"] = job_pb2.Side.Name(r.failed_side).removeprefix("SIDE_")
    if r.flags:
        meta["kerneleval_flags"] = [f.rule_id for f in r.flags]
    if job.state_reason:
        meta["kerneleval_state_reason"] = job.state_reason
    timed = correct and r.runtime.trial_count > 0
    compiled = timed and r.compiled_reference_runtime.trial_count > 0
    if r.HasField("compile_time"):
        meta["torch_compile_time_s"] = r.compile_time.ToMilliseconds() / 1e3
    entry = {
        "sample_id": sample_id,
        "evaluated": not not_evaluated(job),
        "compiled": r.compiled,
        "correctness": correct,
        "metadata": meta,
        "runtime": r.runtime.mean_ms if timed else -1.0,
        "runtime_stats": _runtime_stats(r.runtime, r.device) if timed else {},
        "ref_runtime": r.reference_runtime.mean_ms if timed else -1.0,
        "ref_runtime_stats": _runtime_stats(r.reference_runtime, r.device) if timed else {},
    }
    if compile_baseline or r.HasField("compiled_reference_runtime"):  # under torch.compile
        entry["ref_runtime_compile"] = r.compiled_reference_runtime.mean_ms if compiled else -1.0
        entry["ref_runtime_compile_stats"] = (
            _runtime_stats(r.compiled_reference_runtime, r.device) if compiled else {}
        )
    return entry


def refused_entry(sample_id: int, message: str) -> dict[str, Any]:
    """A kernel the service refused as bad input (INVALID_ARGUMENT): not compiled."""
    return {
        "sample_id": sample_id,
        "evaluated": True,  # judged: not a valid kernel
        "compiled": False,
        "correctness": False,
        "metadata": {"kerneleval_refused": message},
        "runtime": -1.0,
        "runtime_stats": {},
        "ref_runtime": -1.0,
        "ref_runtime_stats": {},
    }


def _runtime_device(r: job_pb2.EvalResult) -> str:
    return "cpu" if r.device.index < 0 else f"cuda:{r.device.index}"


def result_path(run_dir: Path, sample: Sample) -> Path:
    return run_dir / RESULTS_DIR / f"{sample.name}.json"


def write_json(path: Path, value: Any) -> None:
    """Written whole or not at all (a run interrupted while writing leaves no half file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_results(run_dir: Path, samples: Iterable[Sample]) -> dict[Sample, dict[str, Any]]:
    """The result files of these samples that exist."""
    out = {}
    for s in samples:
        path = result_path(run_dir, s)
        if path.is_file():
            try:
                out[s] = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                continue  # unreadable: evaluated again
    return out


def eval_results(results: Mapping[Sample, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """eval_results.json: {problem id: [entry per sample]} as eval_from_generations.py."""
    out: dict[str, list[dict[str, Any]]] = {}
    for s in sorted(results, key=lambda s: (s.problem_id, s.sample_id)):
        out.setdefault(str(s.problem_id), []).append(results[s])
    return out


def fast_p(speedups: list[float | None], p: float) -> float:
    """The share of all problems whose kernel is correct and more than p times as fast as the
    reference (benchmark_eval_analysis.py's fastp: None for an incorrect or missing one)."""
    if not speedups:
        return 0.0
    return sum(1 for x in speedups if x is not None and x > p) / len(speedups)


def geometric_mean(values: list[float]) -> float:
    """0 for none, as KernelBench's geometric_mean_speed_ratio_correct_only."""
    positive = [v for v in values if v > 0]
    if not positive:
        return 0.0
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def summary(
    run_name: str,
    level: int,
    problem_ids: Iterable[int],
    results: Mapping[Sample, dict[str, Any]],
) -> dict[str, Any]:
    """analysis_results.json as benchmark_eval_analysis.py writes it, over every problem of
    the level (or --subset): a problem without a result of sample 0 counts as failed, as there.
    A kernel not evaluated (it could not run on the service's host, as when KernelBench's eval
    returns None) is taken as no result: in the denominators, never compiled or correct, and
    counted apart in `not_evaluated_count`, not as a wrong kernel. The baseline of each
    speedup is the reference timed in the same job, not a timing file."""
    by_problem = {s.problem_id: e for s, e in results.items() if s.sample_id == 0}
    ids = sorted(problem_ids)
    given = [by_problem.get(pid) for pid in ids]
    entries = [e if e is not None and evaluated(e) else None for e in given]
    speedups = _speedups(entries, "ref_runtime")
    total = len(ids)
    compiled = sum(1 for e in entries if e is not None and e["compiled"])
    correct = sum(1 for e in entries if e is not None and e["correctness"])
    out = {
        "run_name": run_name,
        "level": level,
        "baseline": "the reference, timed in the same job (kerneleval)",
        "summary": {
            "total_problems": total,
            "total_evaluated": sum(1 for e in entries if e is not None),
            "not_evaluated_count": sum(1 for e in given if e is not None and not evaluated(e)),
            "compiled_count": compiled,
            "correct_count": correct,
            "compilation_rate": compiled / total if total else 0.0,
            "correctness_rate": correct / total if total else 0.0,
        },
        "speedup_metrics": _speedup_metrics(speedups),
    }
    if any(e is not None and "ref_runtime_compile" in e for e in entries):
        # --compile-baseline: the same metrics over the reference under torch.compile
        # (run_and_check.py's "speedup over torch.compile"; a problem whose compiled
        # reference has no time counts as one without a result).
        out["speedup_metrics_torch_compile"] = _speedup_metrics(
            _speedups(entries, "ref_runtime_compile")
        )
    return out


def _speedups(entries: list[dict[str, Any] | None], baseline: str) -> list[float | None]:
    """Per problem, `baseline`'s mean over the kernel's (None: incorrect, or not timed)."""
    out: list[float | None] = []
    for e in entries:
        ok = e is not None and e["correctness"] and e["runtime"] > 0
        base = e.get(baseline, -1.0) if e is not None else -1.0
        out.append(base / e["runtime"] if ok and e is not None and base > 0 else None)
    return out


def _speedup_metrics(speedups: list[float | None]) -> dict[str, Any]:
    return {
        "geometric_mean_speedup": geometric_mean([x for x in speedups if x is not None]),
        "fast_p": {str(p): fast_p(speedups, p) for p in FAST_P_THRESHOLDS},
    }


def summary_text(s: dict[str, Any]) -> str:
    """The summary as KernelBench prints it, in short."""
    n = s["summary"]
    m = s["speedup_metrics"]
    lines = [
        f"level {s['level']}: {n['total_evaluated']} of {n['total_problems']} problems evaluated",
        f"compiled  {n['compiled_count']}/{n['total_problems']} "
        f"({n['compilation_rate'] * 100:.1f}%)",
        f"correct   {n['correct_count']}/{n['total_problems']} "
        f"({n['correctness_rate'] * 100:.1f}%)",
        f"geometric mean speedup of the correct ones: {m['geometric_mean_speedup']:.4f}",
        "fast_p    " + "  ".join(f"p={float(p):g}: {v:.3f}" for p, v in m["fast_p"].items()),
    ]
    c = s.get("speedup_metrics_torch_compile")
    if c is not None:
        lines[-2] = lines[-2].replace("speedup of", "speedup over eager of")
        lines += [
            "geometric mean speedup over torch.compile of the correct ones: "
            f"{c['geometric_mean_speedup']:.4f}",
            "fast_p    "
            + "  ".join(f"p={float(p):g}: {v:.3f}" for p, v in c["fast_p"].items())
            + "  (over torch.compile)",
        ]
    skipped = n.get("not_evaluated_count", 0)
    if skipped:
        lines.insert(
            1,
            f"not evaluated  {skipped}: not run here (needs a GPU); neither compiled nor correct "
            "here, in fast_p's denominator as problems without a result; the next run evaluates "
            "them again",
        )
    return "\n".join(lines)
