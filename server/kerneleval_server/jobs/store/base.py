"""What every job store does, written once in SQL both engines take (`SqlStore`); each engine
supplies its connection, its transactions and its dialect's few differences."""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.spec.placement import wanted_device, wanted_model

# SQL's BIGINT is int64: a larger Python int raises OverflowError. Numbers that come from a
# client (a sequence, a page's rowid) are clamped to it here as a last line of defence.
_INT64_MAX = 2**63 - 1

TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)
_UNFINISHED = (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING)

# PostgreSQL NOTIFY channels (jobs/shared_queue.py listens): a job's new events (payload: its
# id), a job queued or requeued, a cancel request for a node.
EVENTS_CHANNEL = "kerneleval_events"
QUEUED_CHANNEL = "kerneleval_queued"
CANCEL_CHANNEL = "kerneleval_cancel"
# The shared artifact store (jobs/builds/artifact_store.py): a build request for builders (payload:
# its versions), an artifact written or a build request ended (payload: its key).
BUILDS_CHANNEL = "kerneleval_builds"
ARTIFACTS_CHANNEL = "kerneleval_artifacts"

# reap's and request_cancel's callback: (job, its last event's sequence) -> (the job as it
# must be written, the events that say so).
Decide = Callable[[job_pb2.Job, int], tuple[job_pb2.Job, list[job_pb2.JobEvent]]]


class StoreError(RuntimeError):
    """The store cannot be used (unreachable, a schema newer than this code)."""


class JobStore(Protocol):
    node_id: str

    def close(self) -> None: ...
    def insert(
        self,
        job: job_pb2.Job,
        first_event: job_pb2.JobEvent,
        *,
        cache_key: str = "",
        idempotency_key: str = "",
    ) -> None: ...
    def update(self, job: job_pb2.Job, event: job_pb2.JobEvent | None = None) -> bool: ...
    def add_event(self, event: job_pb2.JobEvent) -> None: ...
    def get(self, job_id: str, include_spec: bool = True) -> job_pb2.Job | None: ...
    def get_spec(self, job_id: str) -> kernel_pb2.JobSpec | None: ...
    def events_after(self, job_id: str, after: int) -> list[job_pb2.JobEvent]: ...
    def last_sequence(self, job_id: str) -> int: ...
    def list(
        self,
        *,
        limit: int,
        before_rowid: int | None = None,
        state: int = 0,
        client_tag: str = "",
        labels: Mapping[str, str] | None = None,
        include_spec: bool = False,
        tenant: str | None = None,
    ) -> list[tuple[int, job_pb2.Job]]: ...
    def unfinished(self) -> Iterator[job_pb2.Job]: ...
    def cache_key(self, job_id: str) -> str: ...
    def cached(self, cache_key: str, since_unix: float) -> job_pb2.Job | None: ...
    def by_idempotency_key(self, client_tag: str, key: str) -> job_pb2.Job | None: ...
    def forget_idempotency_key(self, job_id: str) -> None: ...
    def delete_finished_before(self, cutoff_unix: float) -> int: ...
    def counts(self) -> tuple[dict[int, int], dict[int, int]]: ...
    def schema_version(self) -> int: ...
    def tenant_queued(self, tenant: str) -> int: ...
    def tenant_created(self, tenant: str, limit: int) -> builtins.list[float]: ...
    def claim(
        self,
        node_id: str,
        devices: Mapping[int, str],
        limit: int,
        lease_s: float,
        tenant_max_running: int = 0,
    ) -> builtins.list[job_pb2.Job]: ...
    def renew(self, node_id: str, lease_s: float) -> set[str]: ...
    def release(self, node_id: str, job_ids: Sequence[str]) -> None: ...
    def reap(self, now: float, decide: Decide, limit: int = 100) -> builtins.list[str]: ...
    def request_cancel(self, job_id: str, decide: Decide) -> bool: ...
    def cancel_requests(self, node_id: str) -> builtins.list[str]: ...
    def register_node(self, node_id: str, address: str, devices: bytes, ttl_s: float) -> None: ...
    def forget_node(self, node_id: str) -> None: ...
    def nodes(self) -> builtins.list[tuple[str, str, bytes]]: ...
    def artifact(self, key: str) -> tuple[bytes, str] | None: ...
    def put_artifact(self, key: str, data: bytes, versions: str, built_by: str) -> None: ...
    def forget_artifacts_before(self, cutoff_unix: float) -> int: ...
    def request_build(
        self, key: str, versions: str, arch: str, arguments: str, requested_by: str
    ) -> None: ...
    def build_request(self, key: str) -> BuildRequest | None: ...
    def drop_build_request(self, key: str) -> None: ...
    def claim_builds(
        self, builder_id: str, versions: str, limit: int, lease_s: float
    ) -> builtins.list[tuple[str, str, str]]: ...
    def renew_builds(self, builder_id: str, lease_s: float) -> set[str]: ...
    def release_builds(self, builder_id: str, keys: Sequence[str]) -> None: ...
    def end_build(self, key: str, builder_id: str, state: str, error: str) -> None: ...
    def waiting_builds(self) -> builtins.list[tuple[str, int]]: ...
    def register_builder(
        self, builder_id: str, address: str, versions: str, slots: int, ttl_s: float
    ) -> None: ...
    def forget_builder(self, builder_id: str) -> None: ...
    def builders(self) -> builtins.list[Builder]: ...
    def list_builders(self) -> builtins.list[BuilderStatus]: ...


# A build request's end states (build_requests.state; "" while it waits or builds).
BUILD_FAILED = "failed"  # the build failed (its build process died, ran too long): answered
BUILD_REFUSED = "refused"  # the builder would not build it (versions, refusal): built elsewhere
MAX_BUILD_ATTEMPTS = 3  # builders that took a request and were lost, before none takes it
# A builder whose registration ran out (it was lost: SIGKILL, its machine) stays in `builders`
# this long, so that ListBuilders can show it as expired; then any front end's read drops it.
LOST_BUILDER_KEPT_S = 900.0


@dataclass(frozen=True)
class BuildRequest:
    state: str
    error: str
    lease_builder: str
    lease_expires: float
    attempts: int

    def held(self, now: float) -> bool:
        """A live builder holds it (its lease not expired)."""
        return bool(self.lease_builder) and self.lease_expires >= now


@dataclass(frozen=True)
class Builder:
    builder_id: str
    address: str
    versions: str
    slots: int
    built: int
    heartbeat: float = 0.0  # when it last registered (0: before schema step 6)
    expires: float = 0.0


@dataclass(frozen=True)
class BuilderStatus:
    """A builder as ListBuilders shows it: its registration and the build requests about it."""

    builder: Builder
    leased: int  # requests it holds now (building, or queued for its build processes)
    waiting: int  # requests of its versions nobody holds: any builder of them may take them


class SqlStore:
    """The queries, with `?` placeholders (`_sql` turns them into the engine's)."""

    placeholder = "?"
    skip_locked = ""  # PostgreSQL: " FOR UPDATE SKIP LOCKED" (SQLite's writes are serial)
    lock_row = ""  # PostgreSQL: " FOR UPDATE"
    # Taken first by a claim under --tenant-max-running, so that two nodes' claims do not both
    # count a tenant's share free (PostgreSQL: a transaction's advisory lock; SQLite's
    # transactions are serial already).
    claim_lock = ""
    # A node's id when this store serves a node of a shared queue: its writes of jobs are
    # fenced by its leases (update, add_event).
    node_id = ""

    # ---- what an engine provides ----------------------------------------------------------

    def _tx(self) -> contextlib.AbstractContextManager[Any]:
        """A transaction; yields a cursor-like object with execute(sql, args)."""
        raise NotImplementedError

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ---- the store ------------------------------------------------------------------------

    def _sql(self, sql: str) -> str:
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def insert(
        self,
        job: job_pb2.Job,
        first_event: job_pb2.JobEvent,
        *,
        cache_key: str = "",
        idempotency_key: str = "",
    ) -> None:
        """Writes a new job, its labels and its first event in one transaction (cache_key:
        what identical jobs share, result_cache.py; idempotency_key: its Submit's key)."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "INSERT INTO jobs (job_id, state, client_tag, create_time, job, spec,"
                    " cache_key, idempotency_key, want_device, want_model, tenant)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                ),
                (
                    job.job_id,
                    job.state,
                    job.spec.client_tag,
                    job.create_time.ToNanoseconds() / 1e9,
                    _bare(job),
                    job.spec.SerializeToString(),
                    cache_key,
                    idempotency_key or None,
                    wanted_device(job.spec),
                    wanted_model(job.spec) or None,
                    job.tenant,
                ),
            )
            for label, value in sorted(job.spec.labels.items()):
                cur.execute(
                    self._sql("INSERT INTO job_labels (job_id, label, value) VALUES (?, ?, ?)"),
                    (job.job_id, label, value),
                )
            self._put_event(cur, first_event)
            self._notify(cur, QUEUED_CHANNEL, job.job_id)

    def update(self, job: job_pb2.Job, event: job_pb2.JobEvent | None = None) -> bool:
        """Writes the job's new state (and the event that tells it) in one transaction. A
        node's store (`node_id` set) writes only jobs it holds the lease of: False (nothing
        written) for a job whose lease it lost (another node runs it now)."""
        end = job.end_time.ToNanoseconds() / 1e9 if job.HasField("end_time") else None
        fence, fence_args = self._fence()
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "UPDATE jobs SET state = ?, verdict = ?, end_time = ?, job = ?"
                    f" WHERE job_id = ?{fence}"
                ),
                (job.state, job.result.verdict, end, _bare(job), job.job_id, *fence_args),
            )
            if fence and cur.rowcount == 0:
                return False
            if event is not None:
                self._put_event(cur, event)
        return True

    def add_event(self, event: job_pb2.JobEvent) -> None:
        with self._tx() as cur:
            if self.node_id:  # a node adds events only to jobs it holds (see update)
                cur.execute(
                    self._sql("SELECT 1 FROM jobs WHERE job_id = ? AND lease_node = ?"),
                    (event.job_id, self.node_id),
                )
                if cur.fetchone() is None:
                    return
            self._put_event(cur, event)

    def _fence(self) -> tuple[str, tuple[Any, ...]]:
        return (" AND lease_node = ?", (self.node_id,)) if self.node_id else ("", ())

    def _put_event(self, cur: Any, event: job_pb2.JobEvent) -> None:
        cur.execute(
            self._sql("INSERT INTO events (job_id, sequence, event) VALUES (?, ?, ?)"),
            (event.job_id, event.sequence, event.SerializeToString()),
        )
        self._notify(cur, EVENTS_CHANNEL, event.job_id)

    def _notify(self, cur: Any, channel: str, payload: str) -> None:
        """Wakes the followers of other front ends when the transaction commits (PostgreSQL's
        NOTIFY; SQLite has one front end, nobody to wake)."""

    def get(self, job_id: str, include_spec: bool = True) -> job_pb2.Job | None:
        rows = self._query(self._sql("SELECT job, spec FROM jobs WHERE job_id = ?"), (job_id,))
        return _job_from_row(rows[0][0], rows[0][1] if include_spec else None) if rows else None

    def get_spec(self, job_id: str) -> kernel_pb2.JobSpec | None:
        rows = self._query(self._sql("SELECT spec FROM jobs WHERE job_id = ?"), (job_id,))
        return kernel_pb2.JobSpec.FromString(bytes(rows[0][0])) if rows else None

    def events_after(self, job_id: str, after: int) -> list[job_pb2.JobEvent]:
        rows = self._query(
            self._sql(
                "SELECT event FROM events WHERE job_id = ? AND sequence > ? ORDER BY sequence"
            ),
            (job_id, _clamp(after)),
        )
        return [job_pb2.JobEvent.FromString(bytes(r[0])) for r in rows]

    def last_sequence(self, job_id: str) -> int:
        rows = self._query(
            self._sql("SELECT MAX(sequence) FROM events WHERE job_id = ?"), (job_id,)
        )
        return int(rows[0][0] or 0)

    def list(
        self,
        *,
        limit: int,
        before_rowid: int | None = None,
        state: int = 0,
        client_tag: str = "",
        labels: Mapping[str, str] | None = None,
        include_spec: bool = False,
        tenant: str | None = None,
    ) -> list[tuple[int, job_pb2.Job]]:
        """Jobs newest first, with the rowid that pages after them (labels: every one must
        match; tenant: that tenant's jobs only, None: every tenant's)."""
        where: list[str] = ["1 = 1"]
        args: list[object] = []
        if before_rowid is not None:
            where.append("rowid < ?")
            args.append(_clamp(before_rowid))
        if state:
            where.append("state = ?")
            args.append(_clamp(state))
        if client_tag:
            where.append("client_tag = ?")
            args.append(client_tag)
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        for label, value in sorted((labels or {}).items()):
            where.append("job_id IN (SELECT job_id FROM job_labels WHERE label = ? AND value = ?)")
            args.extend((label, value))
        spec_col = "spec" if include_spec else "NULL"
        rows = self._query(
            self._sql(
                f"SELECT rowid, job, {spec_col} FROM jobs WHERE {' AND '.join(where)}"
                " ORDER BY rowid DESC LIMIT ?"
            ),
            (*args, max(0, _clamp(limit))),
        )
        return [(int(r[0]), _job_from_row(r[1], r[2])) for r in rows]

    def unfinished(self) -> Iterator[job_pb2.Job]:
        """QUEUED and RUNNING jobs, oldest first (what a restart must pick up)."""
        rows = self._query(
            self._sql("SELECT job, spec FROM jobs WHERE state IN (?, ?) ORDER BY rowid"),
            (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING),
        )
        for job_blob, spec_blob in rows:
            yield _job_from_row(job_blob, spec_blob)

    def cache_key(self, job_id: str) -> str:
        rows = self._query(self._sql("SELECT cache_key FROM jobs WHERE job_id = ?"), (job_id,))
        return str(rows[0][0]) if rows else ""

    def cached(self, cache_key: str, since_unix: float) -> job_pb2.Job | None:
        """The newest job with this cache key that ended VERDICT_OK or VERDICT_INCORRECT at or
        after `since_unix` (the only results the cache gives out); None for no key."""
        if not cache_key:
            return None
        rows = self._query(
            self._sql(
                "SELECT job FROM jobs WHERE cache_key = ? AND end_time >= ? AND state = ?"
                " AND verdict IN (?, ?) ORDER BY end_time DESC LIMIT 1"
            ),
            (
                cache_key,
                since_unix,
                job_pb2.JOB_STATE_DONE,
                job_pb2.VERDICT_OK,
                job_pb2.VERDICT_INCORRECT,
            ),
        )
        return _job_from_row(rows[0][0], None) if rows else None

    def by_idempotency_key(self, client_tag: str, key: str) -> job_pb2.Job | None:
        rows = self._query(
            self._sql("SELECT job, spec FROM jobs WHERE client_tag = ? AND idempotency_key = ?"),
            (client_tag, key),
        )
        return _job_from_row(rows[0][0], rows[0][1]) if rows else None

    def forget_idempotency_key(self, job_id: str) -> None:
        """The key may make a new job again (its job is past the key's lifetime)."""
        with self._tx() as cur:
            cur.execute(
                self._sql("UPDATE jobs SET idempotency_key = NULL WHERE job_id = ?"), (job_id,)
            )

    def delete_finished_before(self, cutoff_unix: float) -> int:
        with self._tx() as cur:
            for table in ("events", "job_labels"):
                cur.execute(
                    self._sql(
                        f"DELETE FROM {table} WHERE job_id IN (SELECT job_id FROM jobs"
                        " WHERE state IN (?, ?, ?) AND end_time < ?)"
                    ),
                    (*TERMINAL, cutoff_unix),
                )
            cur.execute(
                self._sql("DELETE FROM jobs WHERE state IN (?, ?, ?) AND end_time < ?"),
                (*TERMINAL, cutoff_unix),
            )
            return int(cur.rowcount)

    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Job counts by state and by verdict (finished jobs)."""
        by_state = self._query("SELECT state, COUNT(*) FROM jobs GROUP BY state")
        by_verdict = self._query(
            "SELECT verdict, COUNT(*) FROM jobs WHERE verdict != 0 GROUP BY verdict"
        )
        return (
            {int(k): int(v) for k, v in by_state},
            {int(k): int(v) for k, v in by_verdict},
        )

    # ---- a tenant's quotas where the queue is the store's (gateways and nodes) ------------

    def tenant_queued(self, tenant: str) -> int:
        """The tenant's jobs QUEUED now, on every front end (--tenant-max-queued)."""
        rows = self._query(
            self._sql("SELECT COUNT(*) FROM jobs WHERE tenant = ? AND state = ?"),
            (tenant, job_pb2.JOB_STATE_QUEUED),
        )
        return int(rows[0][0]) if rows else 0

    def tenant_created(self, tenant: str, limit: int) -> builtins.list[float]:
        """When the tenant's last `limit` jobs were submitted (unix seconds, newest first), on
        every front end (--tenant-max-per-minute; read along the jobs_tenant index)."""
        if limit <= 0:
            return []
        rows = self._query(
            self._sql("SELECT create_time FROM jobs WHERE tenant = ? ORDER BY rowid DESC LIMIT ?"),
            (tenant, _clamp(limit)),
        )
        return [float(r[0]) for r in rows]

    # ---- the shared queue: leases, cancel requests, nodes (jobs/shared_queue.py) ----------

    def claim(
        self,
        node_id: str,
        devices: Mapping[int, str],
        limit: int,
        lease_s: float,
        tenant_max_running: int = 0,
    ) -> builtins.list[job_pb2.Job]:
        """Leases up to `limit` QUEUED jobs nobody holds, oldest first, that may run on one of
        `devices` (index -> GPU name): a job that names a device index or a GPU model waits
        for a node that has it (placement.py; the model as a lower-cased substring, which
        validation keeps free of LIKE's wildcards). With `tenant_max_running` (> 0), a
        tenant's jobs are taken only while fewer than that many of its jobs are leased on
        every node together (running, or taken and about to start): its other jobs stay in
        the store, and other tenants' are taken."""
        if limit <= 0 or not devices:
            return []
        fits = " OR ".join(  # '%' as arguments: psycopg reads a '%' in the SQL as its own
            "((want_device IS NULL OR want_device = ?)"
            " AND (want_model IS NULL OR ? LIKE ? || want_model || ?))"
            for _ in devices
        )
        places = [a for i, name in sorted(devices.items()) for a in (i, name.lower(), "%", "%")]
        with self._tx() as cur:
            if tenant_max_running > 0:
                ids = self._claimable_by_tenant(cur, fits, places, limit, tenant_max_running)
            else:
                cur.execute(
                    self._sql(
                        "SELECT job_id FROM jobs WHERE state = ? AND lease_node IS NULL"
                        f" AND cancel_requested = 0 AND ({fits})"
                        f" ORDER BY rowid LIMIT ?{self.skip_locked}"
                    ),
                    (job_pb2.JOB_STATE_QUEUED, *places, _clamp(limit)),
                )
                ids = [str(r[0]) for r in cur.fetchall()]
            jobs = []
            for job_id in ids:
                cur.execute(
                    self._sql("UPDATE jobs SET lease_node = ?, lease_expires = ? WHERE job_id = ?"),
                    (node_id, time.time() + lease_s, job_id),
                )
                cur.execute(self._sql("SELECT job, spec FROM jobs WHERE job_id = ?"), (job_id,))
                row = cur.fetchone()
                jobs.append(_job_from_row(row[0], row[1]))
        return jobs

    def _claimable_by_tenant(
        self, cur: Any, fits: str, places: builtins.list[Any], limit: int, share: int
    ) -> builtins.list[str]:
        """claim's choice under --tenant-max-running: the oldest fitting jobs, a tenant's
        only while its leased jobs and those chosen stay under `share` (no tenant's, "": no
        limit), in the claim's transaction (after `claim_lock`)."""
        if self.claim_lock:
            cur.execute(self.claim_lock)
        cur.execute(
            self._sql(
                "SELECT tenant, COUNT(*) FROM jobs WHERE tenant != '' AND lease_node IS NOT NULL"
                " AND state IN (?, ?) GROUP BY tenant"
            ),
            _UNFINISHED,
        )
        held = {str(t): int(n) for t, n in cur.fetchall()}
        chosen: builtins.list[str] = []
        after = 0  # rowid: each look goes on past the last
        while len(chosen) < limit:
            full = sorted(t for t, n in held.items() if n >= share)
            skip = f" AND tenant NOT IN ({', '.join('?' for _ in full)})" if full else ""
            cur.execute(
                self._sql(
                    "SELECT rowid, job_id, tenant FROM jobs WHERE state = ? AND lease_node IS NULL"
                    f" AND cancel_requested = 0 AND rowid > ? AND ({fits}){skip}"
                    f" ORDER BY rowid LIMIT ?{self.skip_locked}"
                ),
                (job_pb2.JOB_STATE_QUEUED, after, *places, *full, _clamp(limit - len(chosen))),
            )
            rows = cur.fetchall()
            if not rows:
                break
            for rowid, job_id, tenant in rows:
                after = int(rowid)
                tenant = str(tenant)
                if tenant and held.get(tenant, 0) >= share:
                    continue  # filled up by a job chosen just before
                chosen.append(str(job_id))
                if tenant:
                    held[tenant] = held.get(tenant, 0) + 1
        return chosen

    def renew(self, node_id: str, lease_s: float) -> set[str]:
        """Extends the node's leases of its unfinished jobs; returns the jobs it still holds."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "UPDATE jobs SET lease_expires = ? WHERE lease_node = ? AND state IN (?, ?)"
                ),
                (time.time() + lease_s, node_id, *_UNFINISHED),
            )
            cur.execute(
                self._sql("SELECT job_id FROM jobs WHERE lease_node = ? AND state IN (?, ?)"),
                (node_id, *_UNFINISHED),
            )
            return {str(r[0]) for r in cur.fetchall()}

    def release(self, node_id: str, job_ids: Sequence[str]) -> None:
        """Gives back the leases of QUEUED jobs the node took and will not start (it stops)."""
        with self._tx() as cur:
            for job_id in job_ids:
                cur.execute(
                    self._sql(
                        "UPDATE jobs SET lease_node = NULL, lease_expires = NULL"
                        " WHERE job_id = ? AND lease_node = ? AND state = ?"
                    ),
                    (job_id, node_id, job_pb2.JOB_STATE_QUEUED),
                )
            if job_ids:
                self._notify(cur, QUEUED_CHANNEL, "")

    def reap(self, now: float, decide: Decide, limit: int = 100) -> builtins.list[str]:
        """Jobs whose lease expired (their node died or lost the store): each, locked, goes to
        `decide(job, last sequence)`, which returns the job as it must be written (QUEUED again,
        or ended) and the events that say so; the lease is cleared. Returns their ids."""
        done = []
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "SELECT job_id, job, spec FROM jobs WHERE lease_expires < ?"
                    f" AND state IN (?, ?) ORDER BY rowid LIMIT ?{self.skip_locked}"
                ),
                (now, *_UNFINISHED, _clamp(limit)),
            )
            for job_id, job_blob, spec_blob in cur.fetchall():
                cur.execute(
                    self._sql("SELECT MAX(sequence) FROM events WHERE job_id = ?"), (job_id,)
                )
                last = int(cur.fetchone()[0] or 0)
                job, events = decide(_job_from_row(job_blob, spec_blob), last)
                self._write_decided(cur, job, events)
                done.append(str(job_id))
            if done:
                self._notify(cur, QUEUED_CHANNEL, "")
        return done

    def request_cancel(self, job_id: str, decide: Decide) -> bool:
        """A cancel from a front end that does not run the job: a QUEUED job nobody holds ends
        here (`decide` as in reap); otherwise the request is recorded for the node that holds
        it (cancel_requests). False for an unknown or finished job."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    f"SELECT job, spec, lease_node FROM jobs WHERE job_id = ?{self.lock_row}"
                ),
                (job_id,),
            )
            row = cur.fetchone()
            if row is None:
                return False
            job = _job_from_row(row[0], row[1])
            if job.state in TERMINAL:
                return False
            if job.state == job_pb2.JOB_STATE_QUEUED and row[2] is None:
                cur.execute(
                    self._sql("SELECT MAX(sequence) FROM events WHERE job_id = ?"), (job_id,)
                )
                last = int(cur.fetchone()[0] or 0)
                self._write_decided(cur, *decide(job, last))
                return True
            cur.execute(
                self._sql("UPDATE jobs SET cancel_requested = 1 WHERE job_id = ?"), (job_id,)
            )
            self._notify(cur, CANCEL_CHANNEL, job_id)
        return True

    def cancel_requests(self, node_id: str) -> builtins.list[str]:
        """Unfinished jobs the node holds that a client asked to cancel."""
        rows = self._query(
            self._sql(
                "SELECT job_id FROM jobs WHERE lease_node = ? AND cancel_requested = 1"
                " AND state IN (?, ?)"
            ),
            (node_id, *_UNFINISHED),
        )
        return [str(r[0]) for r in rows]

    def _write_decided(
        self, cur: Any, job: job_pb2.Job, events: Sequence[job_pb2.JobEvent]
    ) -> None:
        end = job.end_time.ToNanoseconds() / 1e9 if job.HasField("end_time") else None
        cur.execute(
            self._sql(
                "UPDATE jobs SET state = ?, verdict = ?, end_time = ?, job = ?,"
                " lease_node = NULL, lease_expires = NULL WHERE job_id = ?"
            ),
            (job.state, job.result.verdict, end, _bare(job), job.job_id),
        )
        for event in events:
            self._put_event(cur, event)

    def register_node(self, node_id: str, address: str, devices: bytes, ttl_s: float) -> None:
        """A node says it lives (until now + ttl_s), where it serves and what devices it has."""
        with self._tx() as cur:
            cur.execute(self._sql("DELETE FROM nodes WHERE node_id = ?"), (node_id,))
            cur.execute(
                self._sql(
                    "INSERT INTO nodes (node_id, address, devices, expires) VALUES (?, ?, ?, ?)"
                ),
                (node_id, address, devices, time.time() + ttl_s),
            )

    def forget_node(self, node_id: str) -> None:
        with self._tx() as cur:
            cur.execute(self._sql("DELETE FROM nodes WHERE node_id = ?"), (node_id,))

    def nodes(self) -> builtins.list[tuple[str, str, bytes]]:
        """Live nodes: (node id, gRPC address, their devices as they registered them)."""
        with self._tx() as cur:
            cur.execute(self._sql("DELETE FROM nodes WHERE expires < ?"), (time.time(),))
        rows = self._query("SELECT node_id, address, devices FROM nodes ORDER BY node_id")
        return [(str(r[0]), str(r[1]), bytes(r[2] or b"")) for r in rows]

    # ---- the shared artifact store, build requests, builders (jobs/builds/artifact_store.py) -----

    def artifact(self, key: str) -> tuple[bytes, str] | None:
        """A built artifact by its content key: (its bytes, who built it). Its use is noted
        (at most once a minute), which keeps it from forget_artifacts_before."""
        rows = self._query(
            self._sql("SELECT data, built_by, used FROM artifacts WHERE key = ?"), (key,)
        )
        if not rows:
            return None
        now = time.time()
        if float(rows[0][2]) < now - 60:
            with self._tx() as cur:
                cur.execute(self._sql("UPDATE artifacts SET used = ? WHERE key = ?"), (now, key))
        return bytes(rows[0][0]), str(rows[0][1])

    def put_artifact(self, key: str, data: bytes, versions: str, built_by: str) -> None:
        """Keeps what `key` builds to (the first writer's: a key builds to one thing); its build
        request is done. NOTIFYs the nodes waiting for it."""
        now = time.time()
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "INSERT INTO artifacts (key, data, versions, built_by, created, used)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING"
                ),
                (key, data, versions, built_by, now, now),
            )
            cur.execute(self._sql("DELETE FROM build_requests WHERE key = ?"), (key,))
            cur.execute(
                self._sql("UPDATE builders SET built = built + 1 WHERE builder_id = ?"),
                (built_by,),
            )
            self._notify(cur, ARTIFACTS_CHANNEL, key)

    def forget_artifacts_before(self, cutoff_unix: float) -> int:
        """Drops artifacts nobody used since `cutoff_unix`; returns how many."""
        with self._tx() as cur:
            cur.execute(self._sql("DELETE FROM artifacts WHERE used < ?"), (cutoff_unix,))
            return int(cur.rowcount or 0)

    def request_build(
        self, key: str, versions: str, arch: str, arguments: str, requested_by: str
    ) -> None:
        """Asks builders with exactly `versions` for the build of `key` (once: a request for a
        key already asked joins it). NOTIFYs the builders."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "INSERT INTO build_requests (key, versions, arch, arguments, requested_by,"
                    " created) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING"
                ),
                (key, versions, arch, arguments, requested_by, time.time()),
            )
            self._notify(cur, BUILDS_CHANNEL, versions)

    def build_request(self, key: str) -> BuildRequest | None:
        rows = self._query(
            self._sql(
                "SELECT state, error, lease_builder, lease_expires, attempts"
                " FROM build_requests WHERE key = ?"
            ),
            (key,),
        )
        if not rows:
            return None
        r = rows[0]
        return BuildRequest(str(r[0]), str(r[1]), str(r[2] or ""), float(r[3] or 0), int(r[4]))

    def drop_build_request(self, key: str) -> None:
        """The requester builds it itself, or needs it no more: the request goes unless a live
        builder holds it (that build still ends in the store for the next one who asks)."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "DELETE FROM build_requests WHERE key = ? AND (state <> ''"
                    " OR lease_builder IS NULL OR lease_expires < ?)"
                ),
                (key, time.time()),
            )

    def claim_builds(
        self, builder_id: str, versions: str, limit: int, lease_s: float
    ) -> builtins.list[tuple[str, str, str]]:
        """Leases up to `limit` waiting build requests of exactly `versions` that nobody holds
        (or whose builder's lease expired), oldest first: (key, arch, arguments)."""
        if limit <= 0:
            return []
        now = time.time()
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "SELECT key, arch, arguments FROM build_requests WHERE versions = ?"
                    " AND state = '' AND attempts < ?"
                    " AND (lease_builder IS NULL OR lease_expires < ?)"
                    f" ORDER BY created LIMIT ?{self.skip_locked}"
                ),
                (versions, MAX_BUILD_ATTEMPTS, now, _clamp(limit)),
            )
            rows = [(str(r[0]), str(r[1]), str(r[2])) for r in cur.fetchall()]
            for key, _, _ in rows:
                cur.execute(
                    self._sql(
                        "UPDATE build_requests SET lease_builder = ?, lease_expires = ?,"
                        " attempts = attempts + 1 WHERE key = ?"
                    ),
                    (builder_id, now + lease_s, key),
                )
        return rows

    def renew_builds(self, builder_id: str, lease_s: float) -> set[str]:
        """Extends the builder's leases; returns the requests it still holds."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "UPDATE build_requests SET lease_expires = ?"
                    " WHERE lease_builder = ? AND state = ''"
                ),
                (time.time() + lease_s, builder_id),
            )
            cur.execute(
                self._sql("SELECT key FROM build_requests WHERE lease_builder = ? AND state = ''"),
                (builder_id,),
            )
            return {str(r[0]) for r in cur.fetchall()}

    def release_builds(self, builder_id: str, keys: Sequence[str]) -> None:
        """Gives back requests the builder took and will not build (it stops)."""
        with self._tx() as cur:
            for key in keys:
                cur.execute(
                    self._sql(
                        "UPDATE build_requests SET lease_builder = NULL, lease_expires = NULL,"
                        " attempts = attempts - 1 WHERE key = ? AND lease_builder = ?"
                    ),
                    (key, builder_id),
                )
            if keys:
                self._notify(cur, BUILDS_CHANNEL, "")

    def end_build(self, key: str, builder_id: str, state: str, error: str) -> None:
        """A build the builder holds ends without an artifact: BUILD_FAILED (its requester
        answers its jobs with `error`) or BUILD_REFUSED (its requester builds it)."""
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "UPDATE build_requests SET state = ?, error = ?, lease_builder = NULL,"
                    " lease_expires = NULL WHERE key = ? AND lease_builder = ?"
                ),
                (state, error, key, builder_id),
            )
            self._notify(cur, ARTIFACTS_CHANNEL, key)

    def waiting_builds(self) -> builtins.list[tuple[str, int]]:
        """Build requests nobody holds, by versions: (versions, how many)."""
        rows = self._query(
            self._sql(
                "SELECT versions, COUNT(*) FROM build_requests WHERE state = ''"
                " AND (lease_builder IS NULL OR lease_expires < ?) GROUP BY versions"
            ),
            (time.time(),),
        )
        return [(str(r[0]), int(r[1])) for r in rows]

    def register_builder(
        self, builder_id: str, address: str, versions: str, slots: int, ttl_s: float
    ) -> None:
        """A builder says it lives (until now + ttl_s), with the versions it builds with and
        how many builds it runs at once."""
        now = time.time()
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "INSERT INTO builders (builder_id, address, versions, slots, expires,"
                    " heartbeat) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (builder_id) DO UPDATE"
                    " SET address = excluded.address, versions = excluded.versions,"
                    " slots = excluded.slots, expires = excluded.expires,"
                    " heartbeat = excluded.heartbeat"
                ),
                (builder_id, address, versions, slots, now + ttl_s, now),
            )

    def forget_builder(self, builder_id: str) -> None:
        with self._tx() as cur:
            cur.execute(self._sql("DELETE FROM builders WHERE builder_id = ?"), (builder_id,))

    def builders(self) -> builtins.list[Builder]:
        """Live builders."""
        now = time.time()
        return [b for b in self._builders(now) if b.expires >= now]

    def _builders(self, now: float) -> builtins.list[Builder]:
        """Live builders and those lost within LOST_BUILDER_KEPT_S (older ones are dropped)."""
        with self._tx() as cur:
            cur.execute(
                self._sql("DELETE FROM builders WHERE expires < ?"), (now - LOST_BUILDER_KEPT_S,)
            )
        rows = self._query(
            "SELECT builder_id, address, versions, slots, built, heartbeat, expires"
            " FROM builders ORDER BY builder_id"
        )
        return [
            Builder(str(r[0]), str(r[1]), str(r[2]), int(r[3]), int(r[4]), float(r[5]), float(r[6]))
            for r in rows
        ]

    def list_builders(self) -> builtins.list[BuilderStatus]:
        """Every builder registered (live, or lost within LOST_BUILDER_KEPT_S) with the build
        requests it holds and those of its versions nobody holds: two grouped counts of the
        requests in flight, which are few (a request goes when its build ends)."""
        now = time.time()
        builders = self._builders(now)
        if not builders:
            return []
        held = self._query(
            self._sql(
                "SELECT lease_builder, COUNT(*) FROM build_requests WHERE state = ''"
                " AND lease_expires >= ? GROUP BY lease_builder"
            ),
            (now,),
        )
        free = self._query(
            self._sql(
                "SELECT versions, COUNT(*) FROM build_requests WHERE state = ''"
                " AND attempts < ? AND (lease_builder IS NULL OR lease_expires < ?)"
                " GROUP BY versions"
            ),
            (MAX_BUILD_ATTEMPTS, now),
        )
        leased = {str(r[0]): int(r[1]) for r in held}
        waiting = {str(r[0]): int(r[1]) for r in free}
        return [
            BuilderStatus(b, leased.get(b.builder_id, 0), waiting.get(b.versions, 0))
            for b in builders
        ]

    def schema_version(self) -> int:
        rows = self._query("SELECT MAX(version) FROM kerneleval_schema")
        return int(rows[0][0] or 0)


def _bare(job: job_pb2.Job) -> bytes:
    bare = job_pb2.Job()
    bare.CopyFrom(job)
    bare.ClearField("spec")
    return bare.SerializeToString()


def _clamp(value: int) -> int:
    return max(-_INT64_MAX - 1, min(_INT64_MAX, int(value)))


def _job_from_row(job_blob: Any, spec_blob: Any | None) -> job_pb2.Job:
    job = job_pb2.Job.FromString(bytes(job_blob))
    if spec_blob is not None:
        job.spec.ParseFromString(bytes(spec_blob))
    return job
