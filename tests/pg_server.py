"""A real PostgreSQL server for tests: bench/_common.py's `Postgres` (one way to start one, for
the benchmarks and the tests) on Debian's binaries, which `make` installs, else the pgserver
wheel's (a GPU machine has no Debian packages), in a temporary folder: unix socket only, trust
authentication, no fsync; as root it runs as the `postgres` user (PostgreSQL refuses root).
Skipped where there are no binaries."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _common import Postgres, postgres_bin  # noqa: E402


class PostgresServer(Postgres):
    def __init__(self) -> None:
        if postgres_bin("auto") is None:
            pytest.skip("no PostgreSQL server binaries (make installs Debian's postgresql)")
        super().__init__("auto")

    def start(self) -> PostgresServer:
        super().start()
        return self
