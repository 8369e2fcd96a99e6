"""The store's schema, as numbered steps, applied in order when a store opens.

`kerneleval_schema` records each step applied (version, what it does, when). A store opens
only when its schema is at most as new as this code: a database a newer kerneleval migrated is
refused with the versions named, never written by older code. Each step is written for both
engines; a step once released is never edited, a change is a new step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    sqlite: str
    postgres: str


MIGRATIONS = (
    Migration(
        1,
        "jobs and their events",
        # IF NOT EXISTS: databases made before the schema had versions already have them.
        sqlite="""
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
""",
        postgres="""
CREATE TABLE IF NOT EXISTS jobs (
  rowid BIGSERIAL PRIMARY KEY,
  job_id TEXT NOT NULL UNIQUE,
  state INTEGER NOT NULL,
  verdict INTEGER NOT NULL DEFAULT 0,
  client_tag TEXT NOT NULL DEFAULT '',
  create_time DOUBLE PRECISION NOT NULL,
  end_time DOUBLE PRECISION,
  job BYTEA NOT NULL,
  spec BYTEA NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_tag ON jobs(client_tag);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(create_time);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL,
  sequence BIGINT NOT NULL,
  event BYTEA NOT NULL,
  PRIMARY KEY (job_id, sequence)
);
""",
    ),
    Migration(
        2,
        "result cache keys, idempotency keys of Submit, labels",
        sqlite="""
ALTER TABLE jobs ADD COLUMN cache_key TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN idempotency_key TEXT;
CREATE INDEX jobs_cache ON jobs(cache_key, end_time);
CREATE UNIQUE INDEX jobs_idempotency ON jobs(client_tag, idempotency_key)
  WHERE idempotency_key IS NOT NULL;
CREATE TABLE job_labels (
  job_id TEXT NOT NULL,
  label TEXT NOT NULL,
  value TEXT NOT NULL,
  PRIMARY KEY (job_id, label)
) WITHOUT ROWID;
CREATE INDEX job_labels_value ON job_labels(label, value);
""",
        postgres="""
ALTER TABLE jobs ADD COLUMN cache_key TEXT NOT NULL DEFAULT '';
ALTER TABLE jobs ADD COLUMN idempotency_key TEXT;
CREATE INDEX jobs_cache ON jobs(cache_key, end_time);
CREATE UNIQUE INDEX jobs_idempotency ON jobs(client_tag, idempotency_key)
  WHERE idempotency_key IS NOT NULL;
CREATE TABLE job_labels (
  job_id TEXT NOT NULL,
  label TEXT NOT NULL,
  value TEXT NOT NULL,
  PRIMARY KEY (job_id, label)
);
CREATE INDEX job_labels_value ON job_labels(label, value);
""",
    ),
    Migration(
        3,
        "leases of a shared queue (roles gateway and node), cancel requests, nodes",
        sqlite="""
ALTER TABLE jobs ADD COLUMN want_device INTEGER;
ALTER TABLE jobs ADD COLUMN lease_node TEXT;
ALTER TABLE jobs ADD COLUMN lease_expires REAL;
ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_lease ON jobs(lease_node, lease_expires);
CREATE TABLE nodes (
  node_id TEXT PRIMARY KEY,
  address TEXT NOT NULL DEFAULT '',
  devices BLOB,
  expires REAL NOT NULL
) WITHOUT ROWID;
""",
        postgres="""
ALTER TABLE jobs ADD COLUMN want_device INTEGER;
ALTER TABLE jobs ADD COLUMN lease_node TEXT;
ALTER TABLE jobs ADD COLUMN lease_expires DOUBLE PRECISION;
ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_lease ON jobs(lease_node, lease_expires);
CREATE TABLE nodes (
  node_id TEXT PRIMARY KEY,
  address TEXT NOT NULL DEFAULT '',
  devices BYTEA,
  expires DOUBLE PRECISION NOT NULL
);
""",
    ),
    Migration(
        4,
        "the GPU model a job asks for (placement.py), lower-cased",
        sqlite="ALTER TABLE jobs ADD COLUMN want_model TEXT;",
        postgres="ALTER TABLE jobs ADD COLUMN want_model TEXT;",
    ),
    Migration(
        5,
        "the shared artifact store: built load_inline extensions by content key, build requests"
        " that builders lease (--role builder), the builders",
        sqlite="""
CREATE TABLE artifacts (
  key TEXT PRIMARY KEY,
  data BLOB NOT NULL,
  versions TEXT NOT NULL,
  built_by TEXT NOT NULL,
  created REAL NOT NULL,
  used REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX artifacts_used ON artifacts(used);
CREATE TABLE build_requests (
  key TEXT PRIMARY KEY,
  versions TEXT NOT NULL,
  arch TEXT NOT NULL,
  arguments TEXT NOT NULL,
  requested_by TEXT NOT NULL,
  created REAL NOT NULL,
  lease_builder TEXT,
  lease_expires REAL,
  attempts INTEGER NOT NULL DEFAULT 0,
  state TEXT NOT NULL DEFAULT '',
  error TEXT NOT NULL DEFAULT ''
) WITHOUT ROWID;
CREATE INDEX build_requests_versions ON build_requests(versions, created);
CREATE TABLE builders (
  builder_id TEXT PRIMARY KEY,
  address TEXT NOT NULL DEFAULT '',
  versions TEXT NOT NULL,
  slots INTEGER NOT NULL,
  built INTEGER NOT NULL DEFAULT 0,
  expires REAL NOT NULL
) WITHOUT ROWID;
""",
        postgres="""
CREATE TABLE artifacts (
  key TEXT PRIMARY KEY,
  data BYTEA NOT NULL,
  versions TEXT NOT NULL,
  built_by TEXT NOT NULL,
  created DOUBLE PRECISION NOT NULL,
  used DOUBLE PRECISION NOT NULL
);
CREATE INDEX artifacts_used ON artifacts(used);
CREATE TABLE build_requests (
  key TEXT PRIMARY KEY,
  versions TEXT NOT NULL,
  arch TEXT NOT NULL,
  arguments TEXT NOT NULL,
  requested_by TEXT NOT NULL,
  created DOUBLE PRECISION NOT NULL,
  lease_builder TEXT,
  lease_expires DOUBLE PRECISION,
  attempts INTEGER NOT NULL DEFAULT 0,
  state TEXT NOT NULL DEFAULT '',
  error TEXT NOT NULL DEFAULT ''
);
CREATE INDEX build_requests_versions ON build_requests(versions, created);
CREATE TABLE builders (
  builder_id TEXT PRIMARY KEY,
  address TEXT NOT NULL DEFAULT '',
  versions TEXT NOT NULL,
  slots INTEGER NOT NULL,
  built INTEGER NOT NULL DEFAULT 0,
  expires DOUBLE PRECISION NOT NULL
);
""",
    ),
    Migration(
        6,
        "when each builder last beat (ListBuilders)",
        # 0 for a row written before: every live builder rewrites its row at its next beat.
        sqlite="ALTER TABLE builders ADD COLUMN heartbeat REAL NOT NULL DEFAULT 0;",
        postgres="ALTER TABLE builders ADD COLUMN heartbeat DOUBLE PRECISION NOT NULL DEFAULT 0;",
    ),
    Migration(
        7,
        "the tenant that submitted each job (--tenants-file); earlier jobs are the default's, ''",
        sqlite="""
ALTER TABLE jobs ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
CREATE INDEX jobs_tenant ON jobs(tenant, rowid);
""",
        postgres="""
ALTER TABLE jobs ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
CREATE INDEX jobs_tenant ON jobs(tenant, rowid);
""",
    ),
)

LATEST = MIGRATIONS[-1].version

SCHEMA_TABLE = """
CREATE TABLE IF NOT EXISTS kerneleval_schema (
  version INTEGER PRIMARY KEY,
  description TEXT NOT NULL,
  applied_at DOUBLE PRECISION NOT NULL
)"""


def too_new(found: int) -> str:
    """Why a database at schema version `found` cannot be used ("" when it can)."""
    if found <= LATEST:
        return ""
    return (
        f"the job store's schema is at version {found}, newer than this kerneleval knows "
        f"({LATEST}): a newer kerneleval migrated it; run that one, or another database"
    )


def statements(script: str) -> list[str]:
    """A step's statements, one by one (neither engine's driver runs a script in one call
    inside a transaction the same way)."""
    return [s.strip() for s in script.split(";") if s.strip()]


def apply(cur: Any, engine: str, placeholder: str) -> str:
    """Brings the schema up to date in the caller's transaction (`cur`: a DB-API cursor;
    `engine`: "sqlite" or "postgres"). Returns why the database cannot be used ("" when
    it can): then nothing was changed."""
    cur.execute(SCHEMA_TABLE)
    cur.execute("SELECT MAX(version) FROM kerneleval_schema")
    found = int(cur.fetchone()[0] or 0)
    if why := too_new(found):
        return why
    insert = "INSERT INTO kerneleval_schema (version, description, applied_at) VALUES (?, ?, ?)"
    for step in MIGRATIONS:
        if step.version > found:
            for statement in statements(getattr(step, engine)):
                cur.execute(statement)
            cur.execute(
                insert.replace("?", placeholder), (step.version, step.description, time.time())
            )
    return ""
