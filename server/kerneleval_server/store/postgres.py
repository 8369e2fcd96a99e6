"""The PostgreSQL job store (psycopg 3 and its connection pool).

Each call takes a pooled connection for one transaction; a write commits before it returns, as
SQLite's does. The schema is migrated under a transaction-scoped advisory lock, so front ends
that start together do not race to migrate it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import migrations
from .base import SqlStore, StoreError

_MIGRATION_LOCK = 0x6B65_7276  # "kerv": pg_advisory_xact_lock's key for schema changes
POOL_MAX = 8


class PostgresStore(SqlStore):
    placeholder = "%s"

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0) -> None:
        import psycopg  # the SQLite default needs neither
        from psycopg_pool import ConnectionPool

        self.url = url
        self._errors = psycopg.Error
        self._pool = ConnectionPool(
            url, min_size=1, max_size=POOL_MAX, open=False, name="kerneleval-store"
        )
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
            self._migrate()
        except Exception as exc:
            self._pool.close()
            raise StoreError(f"PostgreSQL job store {_redacted(url)}: {exc}") from exc

    def _migrate(self) -> None:
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            if why := migrations.apply(cur, "postgres", self.placeholder):
                raise StoreError(why)

    def close(self) -> None:
        self._pool.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            yield cur

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._pool.connection() as conn, conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())


def _redacted(url: str) -> str:
    """The URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"
