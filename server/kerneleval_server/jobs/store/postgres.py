"""The PostgreSQL job store (psycopg 3 and its connection pool).

Each call takes a pooled connection for one transaction; a write commits before it returns, as
SQLite's does. The schema is migrated under a transaction-scoped advisory lock, so front ends
that start together do not race to migrate it; a service holds a session lock for as long as
it runs (`exclusive`), so a second one on the same database is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import migrations
from .base import SqlStore, StoreError

_MIGRATION_LOCK = 0x6B65_7276  # "kerv": pg_advisory_xact_lock's key for schema changes
# One `--role all` front end per database (a session lock, held while the service runs): two
# would both re-run each other's RUNNING jobs at start. Gateways and nodes hold it shared.
_FRONT_END_LOCK = 0x6B65_7266  # "kerf"
# Nodes' claims under --tenant-max-running, one at a time (SqlStore.claim_lock).
_CLAIM_LOCK = 0x6B65_7271  # "kerq"
IN_USE = (
    "another kerneleval front end uses this database (one --role all per database; "
    "gateways and nodes share one)"
)
IN_USE_SHARED = "a kerneleval --role all uses this database: gateways and nodes cannot share it"
POOL_MAX = 8


class PostgresStore(SqlStore):
    placeholder = "%s"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    lock_row = " FOR UPDATE"
    claim_lock = f"SELECT pg_advisory_xact_lock({_CLAIM_LOCK})"

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 10.0,
        exclusive: bool = False,
        shared: bool = False,
    ) -> None:
        import psycopg  # the SQLite default needs neither
        from psycopg_pool import ConnectionPool

        self.url = url
        self._pool = ConnectionPool(
            url, min_size=1, max_size=POOL_MAX, open=False, name="kerneleval-store"
        )
        self._owner: Any = None  # the connection that holds the front end's lock
        try:
            if exclusive or shared:
                # `all` holds the lock alone; gateways and nodes share it: neither kind starts
                # while the other runs on the database (an `all` re-runs RUNNING jobs at start).
                self._owner = psycopg.connect(
                    url, autocommit=True, connect_timeout=max(1, int(connect_timeout_s))
                )
                how = "pg_try_advisory_lock_shared" if shared else "pg_try_advisory_lock"
                got = self._owner.execute(f"SELECT {how}(%s)", (_FRONT_END_LOCK,)).fetchone()
                if not got or not got[0]:
                    raise StoreError(IN_USE_SHARED if shared else IN_USE)
            self._pool.open(wait=True, timeout=connect_timeout_s)
            self._migrate()
        except Exception as exc:
            self.close()
            raise StoreError(f"PostgreSQL job store {_redacted(url)}: {exc}") from exc

    def _migrate(self) -> None:
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            if why := migrations.apply(cur, "postgres", self.placeholder):
                raise StoreError(why)

    def close(self) -> None:
        self._pool.close()
        if self._owner is not None:
            # Unlock first: the session's end frees it too, but only once the server's backend
            # has noticed the closed socket, which a front end started right after may beat.
            with contextlib.suppress(Exception):
                self._owner.execute("SELECT pg_advisory_unlock_all()")
            self._owner.close()
            self._owner = None

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            yield cur

    def _notify(self, cur: Any, channel: str, payload: str) -> None:
        cur.execute("SELECT pg_notify(%s, %s)", (channel, payload))

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
