"""The SQLite job store: one file in WAL mode, for one service on one machine."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import migrations
from .base import SqlStore, StoreError


class SqliteStore(SqlStore):
    def __init__(self, path: Path, *, exclusive: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock_fd = -1
        if exclusive:  # one front end per file: two would both re-run RUNNING jobs at start
            self._lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                os.close(self._lock_fd)
                raise StoreError(f"{path}: another kerneleval front end uses it") from exc
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        os.chmod(path, 0o600)  # tenants' sources: the service's user only
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: survives a process kill
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()

    def _migrate(self) -> None:
        with self._tx() as cur:
            if why := migrations.apply(cur, "sqlite", self.placeholder):
                raise StoreError(f"{self.path}: {why}")

    def close(self) -> None:
        self._db.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the lock goes with the descriptor
            self._lock_fd = -1

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db.cursor()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, args).fetchall()
