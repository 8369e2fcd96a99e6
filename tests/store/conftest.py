from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from ke_service import ServiceProcess
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


@pytest.fixture
def services(postgres: PostgresServer) -> Iterator[tuple[str, list[ServiceProcess]]]:
    """A fresh database, and the services a test starts on it (stopped after it)."""
    started: list[ServiceProcess] = []
    try:
        yield postgres.new_database(), started
    finally:
        for service in started:
            service.stop(timeout=20)
