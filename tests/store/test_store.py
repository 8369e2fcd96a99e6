"""The job store suite, run on both engines: SQLite and a real PostgreSQL server."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import psycopg
import pytest
from kerneleval.v1 import job_pb2
from kerneleval_server.jobs.store import (
    TERMINAL,
    JobStore,
    PostgresStore,
    SqliteStore,
    StoreError,
    migrations,
    open_store,
)
from pg_server import PostgresServer


def make_job(job_id: str, *, state: int = job_pb2.JOB_STATE_QUEUED, tag: str = "") -> job_pb2.Job:
    job = job_pb2.Job(job_id=job_id, state=state)  # type: ignore[arg-type]
    job.spec.client_tag = tag
    job.spec.kernel.source_code = f"# source of {job_id}"
    job.create_time.FromSeconds(1_000)
    return job


def event(job_id: str, seq: int) -> job_pb2.JobEvent:
    ev = job_pb2.JobEvent(job_id=job_id, sequence=seq)
    ev.log.text = f"event {seq}"
    return ev


def test_a_job_round_trips_with_its_spec_and_events(store: JobStore) -> None:
    job = make_job("a", tag="t")
    store.insert(job, event("a", 1))
    got = store.get("a")
    assert got is not None and got.spec.kernel.source_code == "# source of a"
    bare = store.get("a", include_spec=False)
    assert bare is not None and not bare.HasField("spec")
    spec = store.get_spec("a")
    assert spec is not None and spec.client_tag == "t"
    job.state = job_pb2.JOB_STATE_DONE
    job.result.verdict = job_pb2.VERDICT_OK
    job.end_time.FromSeconds(2_000)
    store.update(job, event("a", 2))
    store.add_event(event("a", 3))
    done = store.get("a")
    assert done is not None and done.state == job_pb2.JOB_STATE_DONE
    assert done.result.verdict == job_pb2.VERDICT_OK
    assert [e.sequence for e in store.events_after("a", 0)] == [1, 2, 3]
    assert [e.log.text for e in store.events_after("a", 2)] == ["event 3"]
    assert store.last_sequence("a") == 3 and store.last_sequence("nobody") == 0
    assert store.get("nobody") is None and store.get_spec("nobody") is None


def test_a_failed_write_leaves_nothing_half_done(store: JobStore) -> None:
    job = make_job("a")
    store.insert(job, event("a", 1))
    job.state = job_pb2.JOB_STATE_RUNNING
    with pytest.raises(Exception):  # noqa: B017 - each driver's own IntegrityError
        store.update(job, event("a", 1))  # the event's sequence is taken
    got = store.get("a")
    assert got is not None and got.state == job_pb2.JOB_STATE_QUEUED
    store.update(job, event("a", 2))  # the store works on after the failed transaction
    assert store.last_sequence("a") == 2


def test_list_pages_newest_first_and_filters(store: JobStore) -> None:
    for i in range(5):
        state = job_pb2.JOB_STATE_DONE if i % 2 else job_pb2.JOB_STATE_QUEUED
        store.insert(make_job(f"j{i}", state=state, tag="x" if i < 3 else "y"), event(f"j{i}", 1))
    page = store.list(limit=2)
    assert [j.job_id for _, j in page] == ["j4", "j3"]
    rest = store.list(limit=10, before_rowid=page[-1][0])
    assert [j.job_id for _, j in rest] == ["j2", "j1", "j0"]
    assert [j.job_id for _, j in store.list(limit=10, state=job_pb2.JOB_STATE_DONE)] == [
        "j3",
        "j1",
    ]
    assert [j.job_id for _, j in store.list(limit=10, client_tag="y")] == ["j4", "j3"]
    with_spec = store.list(limit=1, include_spec=True)
    assert with_spec[0][1].spec.kernel.source_code == "# source of j4"
    assert not store.list(limit=1)[0][1].HasField("spec")
    # Numbers from clients past int64 are clamped, not an error.
    assert store.list(limit=2**70, before_rowid=2**70)
    assert store.events_after("j0", 2**70) == []


def test_labels_filter_every_one_must_match(store: JobStore) -> None:
    for i, labels in enumerate([{"problem": "1", "step": "7"}, {"problem": "1"}, {"step": "7"}]):
        job = make_job(f"j{i}")
        job.spec.labels.update(labels)
        store.insert(job, event(f"j{i}", 1))

    def ids(labels: dict[str, str]) -> list[str]:
        return [j.job_id for _, j in store.list(limit=10, labels=labels)]

    assert ids({"problem": "1"}) == ["j1", "j0"]
    assert ids({"problem": "1", "step": "7"}) == ["j0"]
    assert ids({"problem": "2"}) == []
    assert store.get("j0") is not None and dict(store.get("j0").spec.labels) == {  # type: ignore[union-attr]
        "problem": "1",
        "step": "7",
    }


def test_the_cache_gives_only_recent_ok_or_incorrect_results(store: JobStore) -> None:
    verdicts = [job_pb2.VERDICT_OK, job_pb2.VERDICT_DEVICE_FAULT, job_pb2.VERDICT_INCORRECT]
    for i, verdict in enumerate(verdicts):
        job = make_job(f"j{i}", state=job_pb2.JOB_STATE_DONE)
        store.insert(job, event(f"j{i}", 1), cache_key=f"k{i}")
        job.result.verdict = verdict
        job.end_time.FromSeconds(2_000 + i)
        store.update(job, event(f"j{i}", 2))
    hit = store.cached("k0", since_unix=1_500)
    assert hit is not None and hit.job_id == "j0" and hit.result.verdict == job_pb2.VERDICT_OK
    assert store.cached("k0", since_unix=2_001) is None  # older than the cache's age
    assert store.cached("k1", since_unix=0) is None  # a fault is never a cached result
    assert store.cached("k2", since_unix=0) is not None
    assert store.cached("", since_unix=0) is None and store.cache_key("j2") == "k2"
    queued = make_job("q")
    store.insert(queued, event("q", 1), cache_key="k0")
    assert store.cached("k0", since_unix=0).job_id == "j0"  # type: ignore[union-attr]


def test_an_idempotency_key_names_one_job_per_client_tag(store: JobStore) -> None:
    store.insert(make_job("a", tag="t"), event("a", 1), idempotency_key="key")
    store.insert(make_job("b", tag="u"), event("b", 1), idempotency_key="key")
    found = store.by_idempotency_key("t", "key")
    assert found is not None and found.job_id == "a" and found.spec.kernel.source_code
    refused = (sqlite3.IntegrityError, psycopg.errors.IntegrityError)
    with pytest.raises(refused):  # the database itself refuses a second job for the key
        store.insert(make_job("c", tag="t"), event("c", 1), idempotency_key="key")
    assert store.get("c") is None
    store.forget_idempotency_key("a")
    assert store.by_idempotency_key("t", "key") is None
    store.insert(make_job("c", tag="t"), event("c", 1), idempotency_key="key")
    assert store.by_idempotency_key("t", "key").job_id == "c"  # type: ignore[union-attr]


def test_unfinished_counts_and_retention(store: JobStore) -> None:
    states = [job_pb2.JOB_STATE_RUNNING, job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_QUEUED]
    for i, state in enumerate(states):
        job = make_job(f"j{i}", state=state)
        if state in TERMINAL:
            job.end_time.FromSeconds(1_500)
            job.result.verdict = job_pb2.VERDICT_INCORRECT
        store.insert(job, event(f"j{i}", 1))
        store.update(job, event(f"j{i}", 2))
    assert [j.job_id for j in store.unfinished()] == ["j0", "j2"]
    by_state, by_verdict = store.counts()
    assert by_state == {job_pb2.JOB_STATE_RUNNING: 1, job_pb2.JOB_STATE_DONE: 1,
                        job_pb2.JOB_STATE_QUEUED: 1}  # fmt: skip
    assert by_verdict == {job_pb2.VERDICT_INCORRECT: 1}
    assert store.delete_finished_before(1_000) == 0
    assert store.delete_finished_before(2_000) == 1
    assert store.get("j1") is None and store.events_after("j1", 0) == []
    assert store.get("j0") is not None and len(store.events_after("j0", 0)) == 2


def test_the_schema_is_versioned_and_migrated_once(store: JobStore) -> None:
    assert store.schema_version() == migrations.LATEST
    store.insert(make_job("a"), event("a", 1))
    again = (
        open_store(store.url) if isinstance(store, PostgresStore) else open_store(store.path)  # type: ignore[attr-defined]
    )
    try:
        assert again.schema_version() == migrations.LATEST and again.get("a") is not None
    finally:
        again.close()


def test_a_schema_newer_than_the_code_is_refused(tmp_path: Path, postgres: PostgresServer) -> None:
    newer = migrations.LATEST + 1
    path = tmp_path / "jobs.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO kerneleval_schema VALUES (?, 'from the future', 0)", (newer,))
    with pytest.raises(StoreError, match=f"version {newer}, newer than this kerneleval"):
        SqliteStore(path)
    url = postgres.new_database()
    PostgresStore(url).close()
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO kerneleval_schema VALUES (%s, 'from the future', 0)", (newer,))
    with pytest.raises(StoreError, match=f"version {newer}"):
        PostgresStore(url)


def test_a_database_from_before_versions_keeps_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with sqlite3.connect(path) as db:  # the tables as the unversioned store made them
        db.executescript(migrations.MIGRATIONS[0].sqlite)
        db.execute(
            "INSERT INTO jobs (job_id, state, create_time, job, spec) VALUES (?, ?, ?, ?, ?)",
            ("old", 1, 1.0, make_job("old").SerializeToString(), b""),
        )
    store = SqliteStore(path)
    try:
        assert store.schema_version() == migrations.LATEST
        got = store.get("old")
        assert got is not None and got.job_id == "old"
    finally:
        store.close()


def test_an_unreachable_postgresql_says_so_without_its_password(tmp_path: Path) -> None:
    url = f"postgresql://kerneleval:s3cret@/postgres?host={tmp_path}&port=1"
    with pytest.raises(StoreError) as err:
        PostgresStore(url, connect_timeout_s=1.0)
    assert "s3cret" not in str(err.value) and "kerneleval:***@" in str(err.value)


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_one_front_end_per_store(
    engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # Two services on one store would both re-run each other's RUNNING jobs at start.
    if engine == "sqlite":
        location: str | Path = tmp_path / "jobs.db"
    else:
        location = request.getfixturevalue("postgres").new_database()
    first = open_store(location, exclusive=True)
    try:
        with pytest.raises(StoreError, match="another kerneleval front end uses"):
            open_store(location, exclusive=True)
        reader = open_store(location)  # not a front end: tools may still read it
        reader.close()
    finally:
        first.close()
    again = open_store(location, exclusive=True)  # the lock went with the first
    again.close()


def _requeue(job: job_pb2.Job, last: int) -> tuple[job_pb2.Job, list[job_pb2.JobEvent]]:
    job.state = job_pb2.JOB_STATE_QUEUED
    ev = job_pb2.JobEvent(job_id=job.job_id, sequence=last + 1)
    ev.queued.position = 0
    return job, [ev]


def test_a_node_claims_only_jobs_its_gpus_match(store: JobStore) -> None:
    """A job that names a GPU model (any case, a part of the name) goes only to a node with
    such a GPU; with an index as well, that very GPU must be of the model."""
    jobs = {
        "any": make_job("any"),
        "h100": make_job("h100"),
        "h200_on_1": make_job("h200_on_1"),
        "h100_on_1": make_job("h100_on_1"),
        "wild": make_job("wild"),
    }
    jobs["h100"].spec.options.device_model = "h100 80gb"
    jobs["h200_on_1"].spec.options.device_model = "H200"
    jobs["h200_on_1"].spec.options.device_index = 1
    jobs["h100_on_1"].spec.options.device_model = "H100"
    jobs["h100_on_1"].spec.options.device_index = 1
    jobs["wild"].spec.options.device_model = "A1"  # a part of "NVIDIA A100", not "H100"
    for job in jobs.values():
        store.insert(job, event(job.job_id, 1))
    h100_node = {0: "NVIDIA H100 80GB HBM3"}
    mixed_node = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    assert store.claim("n0", {}, limit=9, lease_s=30) == []
    got = [j.job_id for j in store.claim("n1", h100_node, limit=9, lease_s=30)]
    assert got == ["any", "h100"]
    got = [j.job_id for j in store.claim("n2", mixed_node, limit=9, lease_s=30)]
    assert got == ["h200_on_1"]  # H100 on 1: no node has it; A1: no A100 anywhere
    got = [j.job_id for j in store.claim("n3", {1: "NVIDIA A100-SXM4-80GB"}, 9, 30)]
    assert got == ["wild"]


def test_leases_claim_renew_fence_and_reap(store: JobStore) -> None:
    """The shared queue's primitives (roles gateway and node): a job is leased by one node at
    a time, only to a node with the device it names; a node writes only jobs it holds; an
    expired lease sends the job back to the queue through `reap`, exactly once."""
    pinned = make_job("pinned")
    pinned.spec.options.device_index = 3
    for job in (make_job("a"), pinned, make_job("b")):
        store.insert(job, event(job.job_id, 1))
    first = store.claim("n1", {0: "GPU"}, limit=5, lease_s=30)
    assert [j.job_id for j in first] == ["a", "b"] and first[0].spec.kernel.source_code
    assert store.claim("n2", {0: "GPU"}, limit=5, lease_s=30) == []  # held by n1
    assert [j.job_id for j in store.claim("n2", {3: "GPU"}, limit=5, lease_s=30)] == ["pinned"]
    assert store.renew("n1", 30) == {"a", "b"}
    # Fencing: n2's writes of n1's job do nothing; n1's do.
    store.node_id = "n2"
    running = first[0]
    running.state = job_pb2.JOB_STATE_RUNNING
    assert store.update(running, event("a", 2)) is False
    store.add_event(event("a", 2))
    assert store.last_sequence("a") == 1
    store.node_id = "n1"
    assert store.update(running, event("a", 2)) is True
    store.node_id = ""
    # The nodes die: their leases expire; reap requeues each job once.
    assert store.reap(time.time() + 60, _requeue) == ["a", "pinned", "b"]
    assert store.reap(time.time() + 60, _requeue) == []
    again = store.get("a")
    assert again is not None and again.state == job_pb2.JOB_STATE_QUEUED
    assert store.last_sequence("a") == 3
    assert store.renew("n1", 30) == set()
    assert sorted(j.job_id for j in store.claim("n3", {0: "GPU"}, limit=5, lease_s=30)) == [
        "a",
        "b",
    ]
    # Cancels from a front end that does not run the job.
    store.insert(make_job("c"), event("c", 1))
    assert store.request_cancel("c", _cancel) is True  # nobody holds it: it ends here
    c = store.get("c")
    assert c is not None and c.state == job_pb2.JOB_STATE_CANCELLED
    assert store.request_cancel("c", _cancel) is False  # finished already
    assert store.request_cancel("a", _cancel) is True  # held by n3: recorded for it
    assert store.cancel_requests("n3") == ["a"] and store.cancel_requests("n1") == []
    # Nodes register with their address and devices, and age out.
    store.register_node("n3", "10.0.0.3:50051", b"devices", ttl_s=30)
    store.register_node("old", "10.0.0.9:50051", b"", ttl_s=-1)
    assert store.nodes() == [("n3", "10.0.0.3:50051", b"devices")]
    store.forget_node("n3")
    assert store.nodes() == []


def _cancel(job: job_pb2.Job, last: int) -> tuple[job_pb2.Job, list[job_pb2.JobEvent]]:
    job.state = job_pb2.JOB_STATE_CANCELLED
    ev = job_pb2.JobEvent(job_id=job.job_id, sequence=last + 1)
    ev.finished.CopyFrom(job)
    return job, [ev]


def test_role_all_and_shared_roles_exclude_each_other(postgres: PostgresServer) -> None:
    url = postgres.new_database()
    gateway = open_store(url, shared=True)
    node = open_store(url, shared=True)  # gateways and nodes share the database
    try:
        with pytest.raises(StoreError, match="another kerneleval front end uses"):
            open_store(url, exclusive=True)
    finally:
        gateway.close()
        node.close()
    alone = open_store(url, exclusive=True)
    try:
        with pytest.raises(StoreError, match="role all uses this database"):
            open_store(url, shared=True)
    finally:
        alone.close()


def test_jobs_belong_to_their_tenant_and_list_filters_by_it(store: JobStore) -> None:
    for job_id, tenant in (("a1", "alice"), ("b1", "bob"), ("a2", "alice"), ("n1", "")):
        job = make_job(job_id)
        job.tenant = tenant
        store.insert(job, event(job_id, 1))
    def ids(tenant: str | None) -> list[str]:
        return [j.job_id for _, j in store.list(limit=10, tenant=tenant)]

    assert ids("alice") == ["a2", "a1"] and ids("bob") == ["b1"] and ids("") == ["n1"]
    assert ids(None) == ["n1", "a2", "b1", "a1"] and ids("carol") == []
    got = store.get("b1", include_spec=False)
    assert got is not None and got.tenant == "bob"


def test_jobs_from_before_tenants_are_the_default_tenants(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    with sqlite3.connect(path) as db:  # a store at schema 6, the last without tenants
        db.executescript(migrations.SCHEMA_TABLE)
        for step in migrations.MIGRATIONS[:6]:
            db.executescript(step.sqlite)
            db.execute("INSERT INTO kerneleval_schema VALUES (?, ?, 0)", (step.version, "x"))
        db.execute(
            "INSERT INTO jobs (job_id, state, create_time, job, spec) VALUES (?, ?, ?, ?, ?)",
            ("old", 1, 1.0, make_job("old").SerializeToString(), b""),
        )
    store = SqliteStore(path)
    try:
        assert store.schema_version() == migrations.LATEST == 7
        assert [j.job_id for _, j in store.list(limit=5, tenant="")] == ["old"]
        got = store.get("old")
        assert got is not None and got.tenant == ""
    finally:
        store.close()


def test_a_tenants_quotas_are_counted_in_the_store(store: JobStore) -> None:
    """What gateways and nodes check a tenant's quotas against: its QUEUED jobs and its last
    jobs' create times (--tenant-max-queued, --tenant-max-per-minute), and a claim that takes
    a tenant's jobs only while fewer than its share are leased on all nodes
    (--tenant-max-running), other tenants' and no tenant's jobs meanwhile."""
    jobs = [("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("b1", "bob"), ("n1", ""),
            ("b2", "bob")]  # fmt: skip
    for i, (job_id, tenant) in enumerate(jobs):
        job = make_job(job_id)
        job.tenant = tenant
        job.create_time.FromSeconds(1_000 + i)
        store.insert(job, event(job_id, 1))
    assert store.tenant_queued("alice") == 3 and store.tenant_queued("carol") == 0
    assert store.tenant_created("alice", 2) == [1_002.0, 1_001.0]
    assert store.tenant_created("bob", 9) == [1_005.0, 1_003.0]
    gpu = {0: "GPU"}
    first = [j.job_id for j in store.claim("n1", gpu, limit=3, lease_s=30, tenant_max_running=1)]
    assert first == ["a1", "b1", "n1"]  # one of alice's, one of bob's, and no tenant's
    # Another node: alice and bob are at their share (a1 and b1 leased, queued or running).
    assert store.claim("n2", gpu, limit=9, lease_s=30, tenant_max_running=1) == []
    a1 = store.get("a1")
    assert a1 is not None
    a1.state = job_pb2.JOB_STATE_DONE
    a1.end_time.FromSeconds(2_000)
    store.update(a1)
    got = [j.job_id for j in store.claim("n2", gpu, limit=9, lease_s=30, tenant_max_running=1)]
    assert got == ["a2"]  # alice's next, once one of hers ended; bob's b2 still waits
    assert store.tenant_queued("alice") == 2  # a2 (taken, not started) and a3
    got = [j.job_id for j in store.claim("n3", gpu, limit=9, lease_s=30, tenant_max_running=2)]
    assert got == ["a3", "b2"]
