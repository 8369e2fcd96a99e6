"""What every job store does, written once in SQL both engines take (`SqlStore`); each engine
supplies its connection, its transactions and its dialect's few differences."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from kerneleval.v1 import job_pb2, kernel_pb2

# SQL's BIGINT is int64: a larger Python int raises OverflowError. Numbers that come from a
# client (a sequence, a page's rowid) are clamped to it here as a last line of defence.
_INT64_MAX = 2**63 - 1

TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)


class StoreError(RuntimeError):
    """The store cannot be used (unreachable, a schema newer than this code)."""


class JobStore(Protocol):
    def close(self) -> None: ...
    def insert(
        self,
        job: job_pb2.Job,
        first_event: job_pb2.JobEvent,
        *,
        cache_key: str = "",
        idempotency_key: str = "",
    ) -> None: ...
    def update(self, job: job_pb2.Job, event: job_pb2.JobEvent | None = None) -> None: ...
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
    ) -> list[tuple[int, job_pb2.Job]]: ...
    def unfinished(self) -> Iterator[job_pb2.Job]: ...
    def cache_key(self, job_id: str) -> str: ...
    def cached(self, cache_key: str, since_unix: float) -> job_pb2.Job | None: ...
    def by_idempotency_key(self, client_tag: str, key: str) -> job_pb2.Job | None: ...
    def forget_idempotency_key(self, job_id: str) -> None: ...
    def delete_finished_before(self, cutoff_unix: float) -> int: ...
    def counts(self) -> tuple[dict[int, int], dict[int, int]]: ...
    def schema_version(self) -> int: ...


class SqlStore:
    """The queries, with `?` placeholders (`_sql` turns them into the engine's)."""

    placeholder = "?"

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
                    " cache_key, idempotency_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
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
                ),
            )
            for label, value in sorted(job.spec.labels.items()):
                cur.execute(
                    self._sql("INSERT INTO job_labels (job_id, label, value) VALUES (?, ?, ?)"),
                    (job.job_id, label, value),
                )
            self._put_event(cur, first_event)

    def update(self, job: job_pb2.Job, event: job_pb2.JobEvent | None = None) -> None:
        """Writes the job's new state (and the event that tells it) in one transaction."""
        end = job.end_time.ToNanoseconds() / 1e9 if job.HasField("end_time") else None
        with self._tx() as cur:
            cur.execute(
                self._sql(
                    "UPDATE jobs SET state = ?, verdict = ?, end_time = ?, job = ? WHERE job_id = ?"
                ),
                (job.state, job.result.verdict, end, _bare(job), job.job_id),
            )
            if event is not None:
                self._put_event(cur, event)

    def add_event(self, event: job_pb2.JobEvent) -> None:
        with self._tx() as cur:
            self._put_event(cur, event)

    def _put_event(self, cur: Any, event: job_pb2.JobEvent) -> None:
        cur.execute(
            self._sql("INSERT INTO events (job_id, sequence, event) VALUES (?, ?, ?)"),
            (event.job_id, event.sequence, event.SerializeToString()),
        )

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
    ) -> list[tuple[int, job_pb2.Job]]:
        """Jobs newest first, with the rowid that pages after them (labels: every one must
        match)."""
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
