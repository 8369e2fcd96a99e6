"""bench_restart's jobs and bookkeeping, checked on the CPU: the drain's jobs are distinct valid
compared specs carrying what was planted, the load_inline jobs distinct valid TORCH_CUDA specs,
and a job after the restart is put where its events and the drain's log put it (before the
signal, in the drain, re-run and why, queued then run, lost)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _kernels as K  # noqa: E402
import bench_restart as R  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402


def test_the_drains_jobs_are_distinct_valid_and_carry_their_plant() -> None:
    planned = R.drain_plan(20, 4, seed=41)
    assert planned == R.drain_plan(20, 4, seed=41)  # seeded
    assert sum(p["wrong"] for p in planned) == 4
    assert Counter(p["backend"] for p in planned) == {"triton": 10, "torch": 10}
    assert {p["problem"] for p in planned} == set(R.PROBLEMS)
    specs = [R.drain_spec(p, "t", 16, 256, K.options(correct=1, perf=3)) for p in planned]
    assert len({s.kernel.source_code for s in specs}) == 20
    for p, spec in zip(planned, specs, strict=True):
        assert validate_spec(spec) == [], p
        want = kernel_pb2.KERNEL_TYPE_TRITON if p["backend"] == "triton" else (
            kernel_pb2.KERNEL_TYPE_TORCH
        )  # fmt: skip
        assert spec.kernel.type == want
        assert "class Model(" in spec.reference.source_code
        assert (f"+ {R.WRONG_BY}" in spec.kernel.source_code) == p["wrong"]


def test_load_inline_jobs_are_distinct_and_valid() -> None:
    for smoke in (True, False):
        opts = R.inline_options(smoke)
        specs = [R.inline_spec(f"relu_{i}", 100 + i, smoke, 16, 256, opts) for i in range(3)]
        assert len({s.kernel.source_code for s in specs}) == 3
        for spec in specs:
            assert validate_spec(spec) == []
            assert ("cuda_sources" in spec.kernel.source_code) == (not smoke)


def _event(seq: int, t: float, **kind: object) -> job_pb2.JobEvent:
    e = job_pb2.JobEvent(job_id="j", sequence=seq)
    e.time.FromNanoseconds(int(t * 1e9))
    if "started" in kind:
        e.started.attempt = int(kind["started"])  # type: ignore[call-overload]
    if "fault" in kind:
        e.fault.description = str(kind["fault"])
    if "finished" in kind:
        e.finished.state = job_pb2.JOB_STATE_DONE
    return e


def _job(end: float, attempts: int = 1, state: int = job_pb2.JOB_STATE_DONE) -> job_pb2.Job:
    job = job_pb2.Job(job_id="j", state=state, attempt_count=attempts)  # type: ignore[arg-type]
    job.result.verdict = job_pb2.VERDICT_OK
    if end:
        job.end_time.FromNanoseconds(int(end * 1e9))
    return job


def test_each_job_is_put_where_its_events_say() -> None:
    signal, exit_ = 100.0, 104.0
    once = [_event(1, 90, started=1), _event(2, 99, finished=True)]
    assert R.classify(_job(99), once, signal, exit_, {})["recorded"] == "before the signal"
    drained = [_event(1, 95, started=1), _event(2, 102, finished=True)]
    got = R.classify(_job(102), drained, signal, exit_, {})
    assert (got["recorded"], got["finished_events"], got["why_again"]) == ("in the drain", 1, "")
    queued = [_event(1, 110, started=1), _event(2, 111, finished=True)]
    got = R.classify(_job(111), queued, signal, exit_, {})
    assert got["recorded"] == "queued at the signal, ran after the restart"
    assert got["started_before_exit"] == 0
    again = [
        _event(1, 95, started=1),
        _event(2, 110, fault="the front end restarted while the job ran on w1; re-queued"),
        _event(3, 111, started=2),
        _event(4, 112, finished=True),
    ]
    why = "the 30 s grace ended while its kernel still ran (VALIDATING)"
    got = R.classify(_job(112, attempts=2), again, signal, exit_, {"j": why})
    assert (got["recorded"], got["why_again"], got["starts"]) == (
        "re-run after the restart", why, 2
    )  # fmt: skip
    got = R.classify(_job(112, attempts=2), again, signal, exit_, {})
    assert got["why_again"].startswith("the front end restarted")  # without the log line
    lost = R.classify(_job(0, state=job_pb2.JOB_STATE_FAILED), [], signal, exit_, {})
    assert lost["recorded"] == "lost"


def test_the_drains_log_lines_and_a_builds_time() -> None:
    said = R.drain_lines([
        {"message": "shutting down: draining 3 started job(s) for up to 30 s (2 queued ...)"},
        {"message": "job abc re-runs at the next start: the 30 s grace ended while it waited"},
        {"message": "drained in 1.5 s: 1 started job(s) left to re-run"},
        {"message": "job finished"},
    ])  # fmt: skip
    assert said["reruns"] == {"abc": "the 30 s grace ended while it waited"}
    assert said["drained_s"] == 1.5 and len(said["lines"]) == 3
    said_by_job = "load_inline('relu_1'): built in 7.9 s (fast build)"
    logs = [
        job_pb2.JobEvent(log=job_pb2.JobLog(text=said_by_job)),
        job_pb2.JobEvent(log=job_pb2.JobLog(text="kerneleval: load_inline: built in 8.0 s")),
    ]
    assert R.build_of(logs) == {"build_s": 8.0, "cache_hit": False, "fast": True}
    hit = [job_pb2.JobEvent(log=job_pb2.JobLog(text="load_inline('x'): from the build cache"))]
    assert R.build_of(hit) == {"build_s": -1.0, "cache_hit": True, "fast": False}


def test_the_bar() -> None:
    def waves(first: float, later: float) -> dict[str, object]:
        w = {"median_build_s": first}
        return {"wave": 8, "waves": {"warm first": w, "warm later": {"median_build_s": later}}}

    assert R.warm_bar(waves(4.2, 4.0))[0]
    assert not R.warm_bar(waves(30.0, 4.0))[0]
    assert not R.warm_bar({"wave": 8, "waves": {}})[0]
