"""fe_fake_engine with a judge: its job processes say they judge (a `judge_job`), so the front
end records compared jobs for a judge process, and launches a kernel built ahead alone when
its reference has host code (jobs/builds/prebuild.py: reference_judged). The kernel's process writes
what it is into the record; the judge answers with what it read there and who it is:
  {"do": "build", "judged_wrong": true}   the judge finds the outputs wrong (INCORRECT)
  {"do": "build", "forged_paths": true}   the kernel's outcome claims a path measure
Used with `serve --engine fe_fake_engine_judges` (tests/frontend on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import fe_fake_engine as fake
from fe_fake_engine import EngineConfig, Outcome, build_job, configure_process_environment
from kerneleval.v1 import job_pb2

__all__ = [
    "EngineConfig", "Outcome", "PathMeasure", "Recorder", "build_job",
    "configure_process_environment", "judge_job", "run_job",
]  # fmt: skip


class PathMeasure(NamedTuple):
    """As the engine's (engine/types.py): a judge's measure of its own path."""

    lead: str
    output_bytes: tuple[int, ...]
    ns: int


_judged = 0  # jobs this process judged


class Recorder:
    """The record's descriptor, as the real one takes it (nothing handed over by socket)."""

    def __init__(self, fd: int, max_bytes: int, share_fd: int = -1, share_max: int = 0) -> None:
        self.fd, self.shared_bytes = fd, 0


def run_job(spec: Any, reporter: Any, config: Any, prebuilt: Any = ()) -> Outcome:
    outcome = fake.run_job(spec, reporter, config, prebuilt)
    recorder = getattr(config, "recorder", None)
    if recorder is not None:
        said = (
            f"outputs of {os.environ.get('KERNELEVAL_WORKER_ID')}, prebuilt "
            f"{[a.role for a in prebuilt]}, reference judged elsewhere: "
            f"{getattr(config, 'reference_judged', False)}"
        )
        os.pwrite(recorder.fd, said.encode(), 0)
    if json.loads(spec.kernel.source_code).get("forged_paths"):
        # A kernel's process saying it measured the judge's path: only judges' are kept.
        outcome.path_measures = [PathMeasure("none", (16,), 1)]  # type: ignore[attr-defined]
    return outcome


def judge_job(
    spec: Any, reporter: Any, config: Any, candidate: job_pb2.EvalResult, record_fd: int,
    record_max_bytes: int, share_fd: int = -1, share_max_bytes: int = 0,
    kernel_gone: bool = False, reference_time: Any = None, go: Any = None,
    kernel_serves: bool = False, kernel_must_serve: bool = False,
    path_measures: Any = (),
) -> Outcome:  # fmt: skip
    global _judged
    _judged += 1
    # The engine's judge's phases: the reference built, its check, its timing if timed and
    # not given (an earlier judge's time: then it is this job's). Started ahead (`go`): the
    # reference "runs" in its check, then the kernel's report is awaited and the check asked
    # for again, as the engine's judge does.
    reporter.phase(job_pb2.PHASE_COMPILING)
    reporter.phase(job_pb2.PHASE_VALIDATING)
    if go is not None:
        got = go()
        if got is None:
            return Outcome(job_pb2.EvalResult(notes=["left: the job ended first"]))
        candidate, kernel_gone, reference_time = got[:3]
        reporter.phase(job_pb2.PHASE_VALIDATING)
    result = job_pb2.EvalResult()
    result.CopyFrom(candidate)
    if reference_time is not None:
        result.reference_runtime.CopyFrom(reference_time[0])
        result.reference_runtime_age.FromNanoseconds(int(reference_time[1] * 1e9))
        result.notes.append(f"reference time given, {reference_time[1]:.3f} s old")
    elif candidate.runtime.median_ms > 0:
        reporter.phase(job_pb2.PHASE_PROFILING)
        # Which judge timed it, and its how-manieth job: tests tell the times apart.
        worker = os.environ.get("KERNELEVAL_WORKER_ID", "?")
        result.reference_runtime.median_ms = 1000.0 * (1 + abs(hash(worker)) % 997) + _judged
    wrong = json.loads(spec.kernel.source_code).get("judged_wrong")
    result.verdict = job_pb2.VERDICT_INCORRECT if wrong else job_pb2.VERDICT_OK
    result.correctness = not wrong
    result.notes.append(
        f"judged by {os.environ.get('KERNELEVAL_WORKER_ID')} (judge {_judged} here"
        f"{', ahead' if go is not None else ''}); the "
        f"record: {os.pread(record_fd, 200, 0).decode(errors='replace')}"
    )
    # As the engine's judge: a measure of its own path taken only where none was given.
    result.notes.append(f"path measures given: {len(path_measures)}")
    outcome = Outcome(result)
    outcome.path_measures = [] if path_measures else [PathMeasure("none", (16,), 12345)]  # type: ignore[attr-defined]
    return outcome
