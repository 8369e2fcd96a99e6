"""Where a job's time goes, from its own events' timestamps: the segments bench_overhead and
bench_throughput report (medians over their jobs)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import _common as C
from kerneleval.v1 import job_pb2

SEGMENTS = {
    "accepted -> started": ("created", "started"),
    "started -> compiling (job process got it)": ("started", "PHASE_COMPILING"),
    "compiling (import, build, load)": ("PHASE_COMPILING", "PHASE_VALIDATING"),
    "validating (inputs, reference, checks)": ("PHASE_VALIDATING", "after_validating"),
    "profiling (warm-up, timed trials)": ("PHASE_PROFILING", "finished"),
    "finished -> result at client": ("finished", "client"),
    # A judged job (its verdict from a judge process): validating and profiling above then
    # run from the kernel's phases to the job's end, and these split them.
    "judged: kernel checked -> judge given the job": ("PHASE_VALIDATING", "judge"),
    "judged: judge got it -> reference built, record read": ("judge", "judge PHASE_VALIDATING"),
    "judged: judge's checks (reference runs, compare)": (
        "judge PHASE_VALIDATING", "judge checked"),
    "judged: judge timing the reference": ("judge PHASE_PROFILING", "finished"),
}
JUDGE_LOG = "kerneleval: the kernel ran; judged by "  # jobs/judging.py's event at hand-over


def breakdown(
    events: Iterable[job_pb2.JobEvent], created: float, client_done: float | None = None
) -> dict[str, float]:
    """Seconds of each segment of one job (`created`: its create_time; `client_done`: when
    its result reached the client, if known)."""
    at: dict[str, float] = {"created": created}
    if client_done is not None:
        at["client"] = client_done
    judge = ""  # "judge " once its judge has the job: the phases after are the judge's
    for ev in events:
        kind = ev.WhichOneof("kind")
        if kind == "phase":
            at.setdefault(judge + job_pb2.Phase.Name(ev.phase.phase), C.ts(ev.time))
        elif kind in ("started", "finished"):
            at.setdefault(kind, C.ts(ev.time))
        elif kind == "log" and ev.log.text.startswith(JUDGE_LOG):
            at.setdefault("judge", C.ts(ev.time))
            judge = "judge "
    at["after_validating"] = at.get("PHASE_PROFILING", at.get("finished", 0.0))
    if "judge" in at:
        at["judge checked"] = at.get("judge PHASE_PROFILING", at.get("finished", 0.0))
    return {name: at[b] - at[a] for name, (a, b) in SEGMENTS.items() if a in at and b in at}


def medians_ms(per_job: Iterable[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Each segment's summary over the jobs that had it, in milliseconds."""
    parts: dict[str, list[float]] = {}
    for job in per_job:
        for name, seconds in job.items():
            parts.setdefault(name, []).append(seconds * 1e3)
    return {name: C.summary(values) for name, values in parts.items()}


_PARTS = re.compile(r"the judge's timed phase: (\d+) ms \(([^)]*)\)")


def window_parts(notes: Sequence[str]) -> dict[str, float]:
    """Milliseconds of a judge's timed phase by part, from its result's note (judge.py's
    _Stopwatch): {"total": ..., "waiting for the window": ..., "reference": ..., ...}."""
    for note in notes:
        m = _PARTS.search(note)
        if m:
            parts = {"total": float(m.group(1))}
            for item in m.group(2).split(", "):
                name, _, ms = item.rpartition(" ")
                parts[name] = float(ms)
            # the windows themselves: the phase less its waits for them (other jobs' windows)
            parts["in windows"] = parts["total"] - parts.get("waiting for the window", 0.0)
            return parts
    return {}


def window_rows(per_job: Iterable[dict[str, float]]) -> list[list[Any]]:
    """Per part of the judges' timed phases: jobs, the median and the largest, ms."""
    timed = [t for t in per_job if t]
    names = sorted({k for t in timed for k in t}, key=lambda k: (k != "total", k))
    return [[k, len([t for t in timed if k in t]),
             statistics.median(t.get(k, 0.0) for t in timed),
             max(t.get(k, 0.0) for t in timed)] for k in names]  # fmt: skip
