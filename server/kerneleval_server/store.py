"""The durable job store: SQLite in WAL mode.

A job row holds the Job message (without its spec) and the JobSpec as protobuf blobs, plus the
columns that queries filter on. Every event of a job is a row too, so Watch replays across
restarts. Calls are synchronous and short; the event loop calls them directly, so a write is
on disk (WAL, synchronous=NORMAL survives a process kill) before the RPC answers.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

from kerneleval.v1 import job_pb2, kernel_pb2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  rowid INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL UNIQUE,
  state INTEGER NOT NULL,
  verdict INTEGER NOT NULL DEFAULT 0,
  client_tag TEXT NOT NULL DEFAULT '',
  create_time REAL NOT NULL,
  end_time REAL,
  job BLOB NOT NULL,
  spec BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_tag ON jobs(client_tag);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(create_time);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL,
  sequence INTEGER NOT NULL,
  event BLOB NOT NULL,
  PRIMARY KEY (job_id, sequence)
) WITHOUT ROWID;
"""

# SQLite's INTEGER is int64: a larger Python int raises OverflowError. Numbers that come from
# a client (a sequence, a page's rowid) are clamped to it here as a last line of defence.
_INT64_MAX = 2**63 - 1

TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def insert(self, job: job_pb2.Job, first_event: job_pb2.JobEvent) -> None:
        """Writes a new job and its first event in one transaction."""
        bare = job_pb2.Job()
        bare.CopyFrom(job)
        bare.ClearField("spec")
        with self._tx():
            self._db.execute(
                "INSERT INTO jobs (job_id, state, client_tag, create_time, job, spec)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    job.job_id,
                    job.state,
                    job.spec.client_tag,
                    job.create_time.ToNanoseconds() / 1e9,
                    bare.SerializeToString(),
                    job.spec.SerializeToString(),
                ),
            )
            self._put_event(first_event)

    def update(self, job: job_pb2.Job, event: job_pb2.JobEvent | None = None) -> None:
        """Writes the job's new state (and the event that tells it) in one transaction."""
        bare = job_pb2.Job()
        bare.CopyFrom(job)
        bare.ClearField("spec")
        end = job.end_time.ToNanoseconds() / 1e9 if job.HasField("end_time") else None
        with self._tx():
            self._db.execute(
                "UPDATE jobs SET state = ?, verdict = ?, end_time = ?, job = ? WHERE job_id = ?",
                (job.state, job.result.verdict, end, bare.SerializeToString(), job.job_id),
            )
            if event is not None:
                self._put_event(event)

    def add_event(self, event: job_pb2.JobEvent) -> None:
        self._put_event(event)

    def _put_event(self, event: job_pb2.JobEvent) -> None:
        self._db.execute(
            "INSERT INTO events (job_id, sequence, event) VALUES (?, ?, ?)",
            (event.job_id, event.sequence, event.SerializeToString()),
        )

    def _tx(self) -> _Transaction:
        return _Transaction(self._db)

    def get(self, job_id: str, include_spec: bool = True) -> job_pb2.Job | None:
        row = self._db.execute("SELECT job, spec FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return _job_from_row(row[0], row[1] if include_spec else None) if row else None

    def get_spec(self, job_id: str) -> kernel_pb2.JobSpec | None:
        row = self._db.execute("SELECT spec FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return kernel_pb2.JobSpec.FromString(row[0]) if row else None

    def events_after(self, job_id: str, after: int) -> list[job_pb2.JobEvent]:
        rows = self._db.execute(
            "SELECT event FROM events WHERE job_id = ? AND sequence > ? ORDER BY sequence",
            (job_id, _clamp(after)),
        ).fetchall()
        return [job_pb2.JobEvent.FromString(r[0]) for r in rows]

    def last_sequence(self, job_id: str) -> int:
        row = self._db.execute(
            "SELECT MAX(sequence) FROM events WHERE job_id = ?", (job_id,)
        ).fetchone()
        return int(row[0] or 0)

    def list(
        self,
        *,
        limit: int,
        before_rowid: int | None = None,
        state: int = 0,
        client_tag: str = "",
        include_spec: bool = False,
    ) -> list[tuple[int, job_pb2.Job]]:
        """Jobs newest first, with the rowid that pages after them."""
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
        spec_col = "spec" if include_spec else "NULL"
        rows = self._db.execute(
            f"SELECT rowid, job, {spec_col} FROM jobs WHERE {' AND '.join(where)}"
            " ORDER BY rowid DESC LIMIT ?",
            (*args, _clamp(limit)),
        ).fetchall()
        return [(int(r[0]), _job_from_row(r[1], r[2])) for r in rows]

    def unfinished(self) -> Iterator[job_pb2.Job]:
        """QUEUED and RUNNING jobs, oldest first (what a restart must pick up)."""
        rows = self._db.execute(
            "SELECT job, spec FROM jobs WHERE state IN (?, ?) ORDER BY rowid",
            (job_pb2.JOB_STATE_QUEUED, job_pb2.JOB_STATE_RUNNING),
        ).fetchall()
        for job_blob, spec_blob in rows:
            yield _job_from_row(job_blob, spec_blob)

    def delete_finished_before(self, cutoff_unix: float) -> int:
        with self._tx():
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT job_id FROM jobs WHERE state IN (?, ?, ?) AND end_time < ?",
                    (*TERMINAL, cutoff_unix),
                ).fetchall()
            ]
            for job_id in ids:
                self._db.execute("DELETE FROM events WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,))
        return len(ids)

    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Job counts by state and by verdict (finished jobs)."""
        by_state = dict(self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"))
        by_verdict = dict(
            self._db.execute(
                "SELECT verdict, COUNT(*) FROM jobs WHERE verdict != 0 GROUP BY verdict"
            )
        )
        return by_state, by_verdict


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _clamp(value: int) -> int:
    return max(-_INT64_MAX - 1, min(_INT64_MAX, int(value)))


def _job_from_row(job_blob: bytes, spec_blob: bytes | None) -> job_pb2.Job:
    job = job_pb2.Job.FromString(job_blob)
    if spec_blob is not None:
        job.spec.ParseFromString(spec_blob)
    return job
