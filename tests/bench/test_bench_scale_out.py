"""bench_scale_out.py's pure helpers: rates, efficiency, CPU readings, pickup times."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_scale_out as S  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402


def test_time_job_is_distinct_and_valid() -> None:
    a, b = S.time_job(0.5, 1, tag="c1"), S.time_job(0.5, 2)
    assert json.loads(a.kernel.source_code) == {"do": "time", "seconds": 0.5, "n": 1}
    assert a.kernel.source_code != b.kernel.source_code
    assert a.client_tag == "c1"
    assert validate_spec(a) == []


def test_rate_and_steady_rate() -> None:
    assert S.rate([], 0.0) == 0.0
    assert S.rate([1.0, 2.0, 4.0, 5.0], 0.0) == pytest.approx(4 / 5)
    # 11 finishes one per second after a slow start: the steady part ignores the start.
    times = [10.0 + i for i in range(11)]
    assert S.steady_rate(times) == pytest.approx(1.0)
    assert S.steady_rate([1.0, 2.0]) == 0.0
    assert S.steady_rate([3.0, 3.0, 3.0]) == 0.0


def test_efficiency() -> None:
    eff = S.efficiency({1: 2.0, 2: 3.8, 4: 7.0})
    assert eff == pytest.approx({1: 1.0, 2: 0.95, 4: 0.875})
    assert S.efficiency({2: 1.0}) == {2: 0.0}


def test_cpu_line_and_busy_share() -> None:
    line = "cpu  100 0 50 800 50 0 0 0 0 0\n"
    assert S.parse_cpu_line(line) == (150.0, 1000.0)
    assert S.busy_share((150.0, 1000.0), (450.0, 1600.0)) == pytest.approx(0.5)
    assert S.busy_share((1.0, 1.0), (1.0, 1.0)) == 0.0
    with pytest.raises(ValueError):
        S.parse_cpu_line("cpu0 1 2 3 4")
    busy, total = S.cpu_times()
    assert 0 <= busy <= total


def _event(at: float, **fields: object) -> job_pb2.JobEvent:
    e = job_pb2.JobEvent()
    e.time.FromNanoseconds(int(at * 1e9))
    for name, value in fields.items():
        getattr(e, name).CopyFrom(value)
    return e


def test_pickup_from_a_replay() -> None:
    lost = job_pb2.FaultInfo(description="the node ... was lost (its lease expired); re-queued")
    events = [
        _event(99.0, started=job_pb2.JobStarted(attempt=1)),
        _event(108.5, fault=lost),
        _event(109.25, started=job_pb2.JobStarted(attempt=2)),
    ]
    assert S.pickup(events, 100.0) == {"requeued_s": 8.5, "started_s": 9.25}
    assert S.pickup(events[:1], 100.0) == {"requeued_s": -1.0, "started_s": -1.0}


def test_stat_and_process_tree() -> None:
    # comm may hold spaces and parentheses; fields after it: state ppid ... utime(14) ...
    rest = ["S", "7"] + ["0"] * 9 + ["30", "12", "5", "3"] + ["0"] * 10
    text = "42 (a (b) c) " + " ".join(rest)
    assert S.parse_stat(text) == (7, 42.0, 8.0)
    stats = {1: (0, 0.0, 0.0), 2: (1, 0.0, 0.0), 3: (2, 0.0, 0.0), 4: (1, 0.0, 0.0),
             5: (9, 0.0, 0.0)}  # fmt: skip
    assert S.descendants(stats, {2}) == {2, 3}
    assert S.descendants(stats, {2, 5, 77}) == {2, 3, 5}
    assert S.proc_cpu_s(1 << 30) == 0.0
    assert S.own_cpu_s(1 << 30) == 0.0
