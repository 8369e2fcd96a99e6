"""gpu_scale_out.py's pieces on the CPU: the jobs it plans, the phases it asks of a replay, the
PostgreSQL binaries it finds (the pgserver wheel's without importing it), a process tree killed
as a whole. The bench's own --cpu-smoke run checks the whole scenario (about 30 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _common as C  # noqa: E402
import bench_scale_out as S  # noqa: E402
import gpu_scale_out as G  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402

KB = REPO.parent / "shared" / "kernelbench"
needs_kernelbench = pytest.mark.skipif(not (KB / "level1").is_dir(), reason="no kernelbench")


@needs_kernelbench
def test_jobs_take_the_problems_in_turn_and_are_distinct_valid_specs() -> None:
    problems = G.select_problems(KB / "level1", 0, smoke=True)
    assert [G.problem_id(p) for p in problems] == list(G.SMOKE_PROBLEMS)
    assert len(G.select_problems(KB / "level1", 0, smoke=False)) == 100
    assert [G.problem_id(p) for p in G.select_problems(KB / "level1", 3, smoke=False)] == [1, 2, 3]
    planned = G.plan(problems, 30, {1, 19})
    assert [p["index"] for p in planned] == list(range(30))
    assert planned[12]["problem"] == planned[0]["problem"] and planned[12]["round"] == 1
    assert [p["pid"] for p in planned if p["wrong"]] == [1, 19, 1, 19, 1, 19]
    assert G.expected_verdict(planned[0]) == job_pb2.VERDICT_INCORRECT
    assert G.expected_verdict(planned[1]) == job_pb2.VERDICT_OK
    specs = [
        G.job_spec(p, G.scaled(problems[p["index"] % 12].read_text(), 64), "t", 60)
        for p in planned
    ]
    assert len({s.kernel.source_code for s in specs}) == 30  # no cache can answer one
    for s in specs:
        assert validate_spec(s) == []
        assert s.options.timeout.seconds == 60 and s.options.seed == 42
        assert "class ModelNew" in s.kernel.source_code
    assert "+ 1.0" in specs[0].kernel.source_code and "+ 1.0" not in specs[1].kernel.source_code


def _ev(kind: str, **kw: object) -> job_pb2.JobEvent:
    e = job_pb2.JobEvent()
    if kind in ("compiling", "validating", "profiling"):
        e.phase.phase = {"compiling": job_pb2.PHASE_COMPILING,
                         "validating": job_pb2.PHASE_VALIDATING,
                         "profiling": job_pb2.PHASE_PROFILING}[kind]  # fmt: skip
    elif kind == "started":
        e.started.attempt = int(kw.get("attempt", 1))  # type: ignore[call-overload]
    elif kind == "fault":
        e.fault.description = str(kw.get("why", ""))
    elif kind == "progress":
        e.progress.done_count = 1
    else:
        getattr(e, kind).SetInParent()
    return e


def test_missing_phases() -> None:
    ok = [_ev(k) for k in ("queued", "started", "compiling", "validating", "progress",
                           "profiling", "finished")]  # fmt: skip
    assert G.life(ok) == [["queued"], ["started", "compiling", "validating", "profiling",
                                       "finished"]]  # fmt: skip
    assert G.missing_phases(ok, ok=True, retried=False) == []
    wrong = [e for e in ok if G.event_kind(e) != "profiling"]
    assert G.missing_phases(wrong, ok=False, retried=False) == []
    assert G.missing_phases(wrong, ok=True, retried=False) == ["profiling"]
    assert G.missing_phases(ok[1:], ok=True, retried=False) == ["queued"]
    lost = "the node running the job on w1 was lost (its lease expired); re-queued (attempt 2)"
    retried = [_ev("queued"), _ev("started"), _ev("compiling"), _ev("fault", why=lost),
               _ev("queued"), _ev("started", attempt=2), _ev("compiling"), _ev("validating"),
               _ev("profiling"), _ev("finished")]  # fmt: skip
    assert G.missing_phases(retried, ok=True, retried=True) == []
    assert G.missing_phases(ok, ok=True, retried=True) == [
        "a second start (attempt 2)", "the fault: lease expired", "queued again"
    ]  # fmt: skip
    assert G.finished_events(retried) == 1 and G.finished_events(retried[:3]) == 0


def test_pgserver_binaries_are_found_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "pgserver"
    (pkg / "pginstall" / "bin").mkdir(parents=True)
    (pkg / "pginstall" / "lib").mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('its dependencies are not here')\n")
    (pkg / "pginstall" / "bin" / "initdb").write_text("")
    (tmp_path / "pgserver.libs").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert C.pgserver_bin() == pkg / "pginstall" / "bin"
    assert C.postgres_bin("pgserver") == (pkg / "pginstall" / "bin", "pgserver")
    assert C.postgres_bin(str(pkg / "pginstall" / "bin"))[1] == "given"  # type: ignore[index]
    assert C.postgres_bin(str(tmp_path)) is None
    assert "pgserver" not in sys.modules


@pytest.mark.skipif(C.postgres_bin("system") is None, reason="no PostgreSQL binaries")
def test_postgres_starts_as_an_unprivileged_user_and_stops() -> None:
    import psycopg

    pg = C.Postgres("system").start()
    try:
        assert (pg.user != "") == (os.geteuid() == 0)
        with psycopg.connect(pg.new_database()) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("kerneleval",)
    finally:
        pg.stop()
    assert not pg.root.exists()


def test_kill_tree_kills_every_descendant_even_in_a_session_of_its_own(tmp_path: Path) -> None:
    proc = S.Proc(tmp_path / "p", [])
    script = f"setsid sh -c 'echo $$ > {tmp_path}/inner; sleep 300' & sleep 300 & wait"
    proc.proc = subprocess.Popen(["sh", "-c", script])
    deadline = time.monotonic() + 10
    while not (tmp_path / "inner").exists() or not (tmp_path / "inner").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    inner = int((tmp_path / "inner").read_text())
    killed = proc.kill_tree()
    assert proc.pid in killed and inner in killed and len(killed) >= 4
    assert proc.proc.poll() is not None
    deadline = time.monotonic() + 10
    while Path(f"/proc/{inner}").exists():  # reaped by init (or a subreaper) once dead
        state = Path(f"/proc/{inner}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        assert time.monotonic() < deadline, "the inner process lives"
        time.sleep(0.05)
