"""The judges' measures of their own path, kept across judge processes (jobs/path_measures.py)."""

from __future__ import annotations

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval_server.jobs import path_measures as pm


def measure(ns: int, sizes: tuple[int, ...] = (16,)) -> job_channel_pb2.PathMeasure:
    return job_channel_pb2.PathMeasure(lead="flush", output_bytes=sizes, ns=ns)


def test_measures_are_kept_per_gpu_and_reference_the_last_ones_oldest_first() -> None:
    paths = pm.PathMeasures()
    paths.learn(0, "ref-a", [measure(i + 1) for i in range(pm.KEPT + 3)])
    paths.learn(1, "ref-a", [measure(7)])
    given = paths.given(0, "ref-a")
    assert [m.ns for m in given] == list(range(4, pm.KEPT + 4))  # the last KEPT
    assert [m.ns for m in paths.given(1, "ref-a")] == [7]
    assert paths.given(0, "ref-b") == []


def test_what_is_nobodys_path_is_not_kept() -> None:
    # No outputs, no time, over a second: a judge's outcome that says such is not a measure.
    paths = pm.PathMeasures()
    paths.learn(0, "ref", [measure(0), measure(pm.MAX_NS + 1), measure(5, sizes=())])
    paths.learn(0, "", [measure(5)])  # a job without a reference key
    assert paths.given(0, "ref") == [] and paths.given(0, "") == []


def test_the_least_recently_used_reference_is_forgotten(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pm, "KNOWN_REFERENCES", 2)
    paths = pm.PathMeasures()
    paths.learn(0, "a", [measure(1)])
    paths.learn(0, "b", [measure(2)])
    assert paths.given(0, "a")  # used: "b" is the least recently used now
    paths.learn(0, "c", [measure(3)])
    assert paths.given(0, "b") == [] and paths.given(0, "a") and paths.given(0, "c")
