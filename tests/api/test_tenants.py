"""Tenants (issue 45), piece by piece: the tokens file, the token check, the result cache's
and the idempotency keys' scope, the fair queue's unit. The service end to end, hostile:
tests/frontend/test_tenants_hostile.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from kerneleval.cli import app
from kerneleval.v1 import kernel_pb2
from kerneleval_server.api import tenants as t
from kerneleval_server.jobs import admission, result_cache
from kerneleval_server.jobs.scheduler import FairQueue, QueuedJob


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_the_file_holds_hashes_and_the_check_finds_the_tenant(tmp_path: Path) -> None:
    alice, line_a = t.new_token("alice")
    bob, line_b = t.new_token("bob.team-2")
    assert alice.startswith("ket_") and alice not in line_a
    assert line_a == f"alice:{t.hash_token(alice)}"
    path = tmp_path / "tenants"
    path.write_text(f"# the tenants\n\n{line_a}\n  {line_b}  \n")
    tenants = t.Tenants(path, admin_token="the-admin")
    assert tenants.on
    assert tenants.resolve(bearer(alice)) == ("alice", "")
    assert tenants.resolve(bearer(bob)) == ("bob.team-2", "")
    assert tenants.resolve(bearer("the-admin")) == (None, "")  # None: every job
    assert tenants.resolve([]) == (None, t.MISSING)
    assert tenants.resolve(bearer("ket_nobody")) == (None, t.WRONG)
    assert tenants.resolve(bearer(t.hash_token(alice))) == (None, t.WRONG)  # the hash is no token
    assert tenants.resolve([("authorization", f"Basic {alice}")]) == (None, t.MISSING)


def test_a_revoked_token_is_refused_after_a_reload_and_a_bad_file_changes_nothing(
    tmp_path: Path,
) -> None:
    alice, line_a = t.new_token("alice")
    bob, line_b = t.new_token("bob")
    path = tmp_path / "tenants"
    path.write_text(f"{line_a}\n{line_b}\n")
    tenants = t.Tenants(path)
    path.write_text(f"{line_a}\n")
    assert tenants.resolve(bearer(bob)) == ("bob", "")  # until the reload (SIGHUP)
    assert tenants.reload()
    assert tenants.resolve(bearer(bob)) == (None, t.WRONG)
    path.write_text("alice:not-a-hash\n")
    assert not tenants.reload()
    assert tenants.resolve(bearer(alice)) == ("alice", "")


@pytest.mark.parametrize(
    "line", ["alice", "alice:abc", ":" + "0" * 64, "al ice:" + "0" * 64, "-a:" + "0" * 64]
)
def test_a_bad_line_is_refused_at_start_with_its_number(tmp_path: Path, line: str) -> None:
    path = tmp_path / "tenants"
    path.write_text(f"# ok\n{line}\n")
    with pytest.raises(ValueError, match=r"tenants:2: not 'tenant-name:sha256-hex-of-token'"):
        t.Tenants(path)


def test_without_a_file_tenants_are_off_and_every_call_sees_all() -> None:
    tenants = t.Tenants(None)
    assert not tenants.on and tenants.resolve([]) == (None, "")
    assert not tenants.reload()


def test_the_cli_prints_a_token_and_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert app.main(["tenant-token", "team-a"]) == 0
    token, line = capsys.readouterr().out.splitlines()
    assert t.parse(line) == {t.hash_token(token): "team-a"}
    assert app.main(["tenant-token", "a:b"]) == 2


def test_a_tenants_cache_key_is_its_own_and_no_tenant_keeps_the_old_key() -> None:
    spec = kernel_pb2.JobSpec(client_tag="x")
    spec.kernel.source_code = "def f(): pass"
    plain = result_cache.cache_key(spec, "target")
    assert result_cache.cache_key(spec, "target", "") == plain
    a, b = (result_cache.cache_key(spec, "target", n) for n in ("alice", "bob"))
    assert len({plain, a, b}) == 3
    assert result_cache.cache_key(spec, "target", "alice") == a


def test_a_tenants_idempotency_keys_are_its_own() -> None:
    assert admission.stored_key("k", "") == "k"
    assert admission.stored_key("", "alice") == ""
    assert admission.stored_key("k", "alice") != admission.stored_key("k", "bob")
    assert admission.stored_key("k", "alice") != "k"


def test_the_fair_queues_unit_is_the_tenant_and_tags_share_its_turn() -> None:
    q = FairQueue()
    # alice floods with three client tags; bob sends one job.
    for i, tag in enumerate(["t1", "t2", "t3", "t1"]):
        q.push(QueuedJob(f"a{i}", tag, None, tenant="alice"))
    q.push(QueuedJob("b0", "t1", None, tenant="bob"))
    order = [job.job_id for job in iter(lambda: q.pop_for(None), None)]
    assert order == ["a0", "b0", "a1", "a2", "a3"]


def test_without_tenants_the_fair_queues_unit_stays_the_client_tag() -> None:
    q = FairQueue()
    for i, tag in enumerate(["t1", "t1", "t2"]):
        q.push(QueuedJob(f"j{i}", tag, None))
    assert q.remove("j1") and not q.remove("j1")
    q.push(QueuedJob("j3", "t1", None))
    assert [job.job_id for job in iter(lambda: q.pop_for(None), None)] == ["j0", "j2", "j3"]


def test_a_tenant_at_its_running_share_is_passed_over_and_keeps_its_turn() -> None:
    """--tenant-max-running: FairQueue.lane_open closes alice's lane; bob's and a client
    tag's (no tenant's) jobs are taken meanwhile; alice's come next once it opens again, and
    a job re-run alone (quota=False) is taken even from a closed lane."""
    q = FairQueue()
    running = {"alice": 1}
    q.lane_open = lambda lane: lane[0] != "tenant" or running.get(lane[1], 0) < 1
    for i in range(2):
        q.push(QueuedJob(f"a{i}", "t", None, tenant="alice"))
    q.push(QueuedJob("b0", "t", None, tenant="bob"))
    q.push(QueuedJob("n0", "t", None))
    assert [job.job_id for job in iter(lambda: q.pop_for(None), None)] == ["b0", "n0"]
    assert len(q) == 2 and q.pop_for(None) is None  # alice's wait, queued
    alone = q.pop_for(None, lambda j: j.job_id == "a1", quota=False)
    assert alone is not None and alone.job_id == "a1"
    running["alice"] = 0
    popped = q.pop_for(None)
    assert popped is not None and popped.job_id == "a0"


def _admission(**quotas: int) -> admission.Admission:
    from kerneleval_server.config import Config

    cfg = Config(result_cache_hours=0, **quotas)  # type: ignore[arg-type]
    return admission.Admission(cfg, None, lambda: [])  # type: ignore[arg-type]


def test_a_tenant_past_its_submissions_a_minute_is_refused_with_when_to_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = kernel_pb2.JobSpec(client_tag="x")
    adm = _admission(tenant_max_per_minute=2)
    now = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    adm.decide(spec, "", 0, "alice")
    now[0] += 20
    adm.decide(spec, "", 0, "alice")
    with pytest.raises(admission.QueueFull) as err:
        adm.decide(spec, "", 0, "alice")
    assert err.value.quota == admission.QUOTA_PER_MINUTE
    assert err.value.retry_after_s == pytest.approx(40.0)  # the first leaves the window
    assert "--tenant-max-per-minute" in str(err.value) and "in 40 s" in str(err.value)
    for _ in range(2):
        adm.decide(spec, "", 0, "bob")  # another tenant's, within its own limit
    for _ in range(5):
        adm.decide(spec, "", 0, "")  # the admin (no tenant) has none
    now[0] += 40.5
    adm.decide(spec, "", 0, "alice")  # the first is a minute old: room for one
    with pytest.raises(admission.QueueFull):
        adm.decide(spec, "", 0, "alice")
    # A gateway's count, from the store: ages given, its own window not used.
    adm = _admission(tenant_max_per_minute=3)
    adm.decide(spec, "", 0, "alice", tenant_ages=[50.0, 10.0])
    with pytest.raises(admission.QueueFull) as err:
        adm.decide(spec, "", 0, "alice", tenant_ages=[55.0, 30.0, 1.0])
    assert err.value.retry_after_s == pytest.approx(5.0)


def test_a_tenants_queue_quota_names_its_limit() -> None:
    spec = kernel_pb2.JobSpec(client_tag="x")
    adm = _admission(tenant_max_queued=2, max_queue=5)
    adm.decide(spec, "", 1, "alice", tenant_queued=1)
    with pytest.raises(admission.QueueFull) as err:
        adm.decide(spec, "", 2, "alice", tenant_queued=2)
    assert err.value.quota == admission.QUOTA_QUEUED
    adm.decide(spec, "", 2, "bob", tenant_queued=0)
    with pytest.raises(admission.QueueFull) as err:
        adm.decide(spec, "", 5, "bob", tenant_queued=0)
    assert err.value.quota == admission.QUOTA_QUEUE


def test_serve_with_a_bad_or_missing_tenants_file_stops_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kerneleval_server.main import main

    bad = tmp_path / "tenants"
    bad.write_text("alice\n")
    for path, says in ((bad, "tenants:1: not 'tenant-name:"), (tmp_path / "none", "No such")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--state-dir", str(tmp_path / "state"), "--tenants-file", str(path)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "--tenants-file: " in err and says in err, err


def test_the_client_sends_the_tenant_token_else_the_admin_token_on_job_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kerneleval import Client

    monkeypatch.delenv("KERNELEVAL_TENANT_TOKEN", raising=False)
    monkeypatch.delenv("KERNELEVAL_ADMIN_TOKEN", raising=False)
    with Client("127.0.0.1:1") as c:
        assert c._job_metadata() is None  # nothing, as before
    with Client("127.0.0.1:1", admin_token="adm") as c:
        assert c._job_metadata() == (("authorization", "Bearer adm"),)
    with Client("127.0.0.1:1", admin_token="adm", tenant_token="ten") as c:
        assert c._job_metadata() == (("authorization", "Bearer ten"),)
        assert c._admin_metadata() == (("authorization", "Bearer adm"),)
    monkeypatch.setenv("KERNELEVAL_TENANT_TOKEN", "from-env")
    with Client("127.0.0.1:1") as c:
        assert c._job_metadata() == (("authorization", "Bearer from-env"),)
