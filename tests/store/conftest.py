from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kerneleval_server.jobs.store import JobStore, open_store
from pg_server import PostgresServer


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


# Every store test on both engines (a module may narrow it with a `store` of its own).
@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[JobStore]:
    if request.param == "sqlite":
        s: JobStore = open_store(tmp_path / "jobs.db")
    else:
        server: PostgresServer = request.getfixturevalue("postgres")
        s = open_store(server.new_database())
    try:
        yield s
    finally:
        s.close()
