"""A real PostgreSQL server for tests, from the Debian package's binaries (`make` installs
them), in a temporary folder: unix socket only, trust authentication, no fsync. As root it
runs as the `postgres` user (PostgreSQL refuses root)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


class PostgresServer:
    def __init__(self) -> None:
        bindir = pg_bin()
        if bindir is None:
            pytest.skip("no PostgreSQL server binaries (make installs Debian's postgresql)")
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="kerneleval-pg-"))
        self.port = 5432 + (os.getpid() % 1000) + 1
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            pwd.getpwnam("postgres")  # the package's user
            shutil.chown(self.root, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> PostgresServer:
        data = self.root / "data"
        self._run(str(self.bindir / "initdb"), "-D", str(data), "-A", "trust", "-U",
                  "kerneleval", "--no-sync", "-E", "UTF8")  # fmt: skip
        options = f"-k {self.root} -p {self.port} -c listen_addresses='' -c fsync=off"
        self._run(str(self.bindir / "pg_ctl"), "-D", str(data), "-l", str(self.root / "log"),
                  "-o", options, "-w", "start")  # fmt: skip
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://kerneleval@/{database}?host={self.root}&port={self.port}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m",
                      "immediate", "-w", "stop")  # fmt: skip
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
