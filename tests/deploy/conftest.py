"""Fixtures of the deployment matrix: one PgBouncer and one private Redis per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from tests.conftest import redis_server_binary, service_missing
from tests.support.pgbouncer import PgBouncer, pgbouncer_binary


@pytest.fixture(scope="session")
def pg_database(load_pg_database: URL) -> URL:
    """The matrix is heavy (gunicorn hosts with their pools, cell after cell): its
    databases, and the PgBouncer in front of them, are on the load server
    (tests/conftest.py), not on the machine's PostgreSQL that the other tests share."""
    return load_pg_database


@pytest.fixture(scope="session")
def pgbouncer(pg_database: URL) -> Iterator[PgBouncer]:
    """A real PgBouncer in transaction-pooling mode in front of the test PostgreSQL.

    Its pool is smaller than the clients' pools, so server connections really are
    shared between client connections, as they are in production.
    """
    binary = pgbouncer_binary()
    if binary is None:
        service_missing("pgbouncer", "the binary is not installed (apt-get install pgbouncer)")
    bouncer = PgBouncer(
        str(binary),
        str(pg_database.host or "127.0.0.1"),
        int(pg_database.port or 5432),
        pool_size=4,
    )
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture(scope="session")
def redis_binary() -> str:
    return redis_server_binary()


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("deploy")
