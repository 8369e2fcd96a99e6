"""The durable job store: one interface (`JobStore`), two engines.

- SQLite (`SqliteStore`, the default: `<state>/jobs.db`): one service on one machine, nothing
  to run beside it.
- PostgreSQL (`PostgresStore`, `--store postgresql://...`): a database server operators
  already run and back up; what gateways and nodes share (`--role`, jobs/shared_queue.py):
  the queue with leases, events woken across front ends by LISTEN/NOTIFY.

A job row holds the Job message (without its spec) and the JobSpec as protobuf blobs, plus the
columns that queries filter on. Every event of a job is a row too, so Watch replays across
restarts. Calls are synchronous and short, made from the event loop, so that a write is
durable before the RPC answers. The schema is versioned (`migrations.py`) and brought up to
date when a store opens.
"""

from __future__ import annotations

from pathlib import Path

from .base import TERMINAL, JobStore, StoreError
from .postgres import PostgresStore
from .sqlite import SqliteStore

__all__ = ["TERMINAL", "JobStore", "PostgresStore", "SqliteStore", "StoreError", "open_store"]


def open_store(location: str | Path, *, exclusive: bool = False, shared: bool = False) -> JobStore:
    """A postgresql:// (or postgres://) URL opens PostgreSQL; anything else is a SQLite file
    (a sqlite:/// URL or a path). `exclusive`: this process is the store's one front end
    (StoreError when another holds it); `shared` (PostgreSQL): one of the gateways and nodes
    that share it."""
    text = str(location)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresStore(text, exclusive=exclusive, shared=shared)
    return SqliteStore(Path(text.removeprefix("sqlite://")), exclusive=exclusive)
