"""The store behind a real PgBouncer in transaction-pooling mode, on both drivers (C25, C8).

PgBouncer hands each transaction to whichever server connection is free, so a
server-side prepared statement made by one client connection is seen (or missed)
by another: psycopg 3 prepares a query after its fifth execution on a connection,
and behind the pooler that turns into ``DuplicatePreparedStatement`` /
``InvalidSqlStatementName``. The engine the extension builds must not prepare.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Any

import pytest
from flask import jsonify, request
from sqlalchemy.engine import URL, make_url

from flask_idempotency import idempotent
from flask_idempotency.store.connect import create_store_engine
from tests.conftest import PG_DRIVERS, driver_url
from tests.support.pgbouncer import PgBouncer

pytestmark = [pytest.mark.postgres]

THREADS = 8
REQUESTS_PER_THREAD = 12


@pytest.mark.slow
@pytest.mark.parametrize("driver", PG_DRIVERS, ids=("psycopg2", "psycopg3"))
def test_i10_1_c25_store_behind_pgbouncer_transaction_pooling_has_no_errors(
    make_app: Any, pg_database: URL, pgbouncer: PgBouncer, driver: str
) -> None:
    """C8/C25: many threads claim, complete and replay through PgBouncer: no 5xx, no 503."""
    url = pgbouncer.route(driver_url(pg_database, driver))
    table = f"idem_bouncer_{uuid.uuid4().hex[:10]}"
    app, _ = make_app(
        {
            "IDEMPOTENCY_DATABASE_URI": url.render_as_string(hide_password=False),
            "IDEMPOTENCY_TABLE": table,
        }
    )
    runs: dict[str, int] = {}
    lock = threading.Lock()

    @app.post("/pay")
    @idempotent
    def pay():  # type: ignore[no-untyped-def]
        key = str(request.headers["Idempotency-Key"])
        with lock:
            runs[key] = runs.get(key, 0) + 1
        return jsonify(ok=True), 201

    statuses: list[int] = []
    bodies: list[bytes] = []

    def client(n: int) -> None:
        with app.test_client() as http:
            for i in range(REQUESTS_PER_THREAD):
                key = f"k-{n}-{i}"
                for _ in range(2):  # the original, then a replay
                    response = http.post("/pay", json={"n": n}, headers={"Idempotency-Key": key})
                    with lock:
                        statuses.append(response.status_code)
                        if response.status_code >= 500:
                            bodies.append(response.data)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    store = app.extensions["idempotency"].store
    try:
        errors = [s for s in statuses if s >= 500]
        assert not errors, f"{len(errors)} of {len(statuses)} answers were 5xx: {bodies[:3]}"
        assert sorted(set(statuses)) == [201]
        assert len(statuses) == THREADS * REQUESTS_PER_THREAD * 2
        assert (
            all(count == 1 for count in runs.values())
            and len(runs) == THREADS * REQUESTS_PER_THREAD
        )
    finally:
        store.table.drop(store.engine, checkfirst=True)


@pytest.mark.parametrize("driver", PG_DRIVERS, ids=("psycopg2", "psycopg3"))
def test_i10_1_c25_engine_gives_up_on_a_silent_server_within_seconds(driver: str) -> None:
    """C25: a server that accepts and never answers fails the connect within seconds."""
    driver_url(make_url("postgresql://postgres@127.0.0.1/test"), driver)  # installed?
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        engine = create_store_engine(f"postgresql+{driver}://postgres@127.0.0.1:{port}/test")
        started = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - the driver's own OperationalError
            engine.connect()
        elapsed = time.monotonic() - started
        engine.dispose()
    assert elapsed < 15, f"connect gave up after {elapsed:.1f} s"
