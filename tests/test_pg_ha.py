"""PostgreSQL behind a failover: multi-host URLs, a read-only server, a silent one (issue 25).

CONTRACT C25, C55.

- Item 2: every multi-host URL form of the query reaches the live host through the
  store's own engine, on both drivers; a server that turned read-only (SQLSTATE 25006:
  a standby, a demoted primary) is an outage (503 + ``Retry-After``), its connections
  leave the pool, and a fresh connection reaches a new primary behind the same
  address at once; the outage log line names every host's error.
- Item 5: a server that stops answering (a proxy that forwards nothing, as a host that
  drops off the network or freezes) costs a request at most the statement deadline
  (5 s) and a 503, or, once the pool has given up on it, the connect timeout (3 s);
  a view whose completion meets it still answers its client in that time, and the
  completion lands when the server answers again.

The read-only server is a private PostgreSQL (tests/support/postgres_server.py) made
read-only with ``default_transaction_read_only`` and a reload: its open sessions
refuse their next write as a demoted primary's would. The machine's own server is
never reconfigured.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, jsonify
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

from flask_idempotency import idempotent
from flask_idempotency.records import COMPLETED
from flask_idempotency.store.connect import CONNECT_TIMEOUT
from flask_idempotency.store.deadline import STATEMENT_DEADLINE
from tests.conftest import service_missing
from tests.support.postgres_server import PostgresServer, postgres_bindir
from tests.support.redis_server import free_port
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

from .conftest import driver_url
from .test_lifecycle import REPLAYED, rows

pytestmark = pytest.mark.postgres

DRIVERS = pytest.mark.parametrize("driver", ["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
#: Room on a loaded 2-core machine above the time the layer itself may take.
SLACK = 3.0


def protected_app(make_app: Any, url: str, table: str) -> Flask:
    app, _ = make_app({"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_TABLE": table})

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(paid=True), 201

    return app


def post(app: Flask, key: str) -> Any:
    return app.test_client().post("/pay", json={"a": 1}, headers={"Idempotency-Key": key})


def assert_store_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.get_json()["code"] == "store-unavailable"
    assert response.headers.get("Retry-After")


def timed_post(app: Flask, key: str, limit: float) -> tuple[Any, float]:
    """``post(app, key)`` from a thread; the answer and its time, or a failure naming the
    wait when none came within ``limit`` seconds (the request would have hung)."""
    answer: list[Any] = []
    started = time.monotonic()
    worker = threading.Thread(target=lambda: answer.append(post(app, key)), daemon=True)
    worker.start()
    worker.join(limit)
    elapsed = time.monotonic() - started
    if not answer:
        raise AssertionError(f"no answer after {elapsed:.1f} s: the request hangs")
    return answer[0], elapsed


# -- item 2: multi-host URLs ---------------------------------------------------------------


def multi_host_url(form: str, driver: str, base: URL, dead: int) -> str:
    """A URL listing a host that refuses connections, then this session's server."""
    user = base.username or "postgres"
    auth = user if base.password is None else f"{user}:{base.password}"
    host, port = base.host or "127.0.0.1", base.port or 5432
    head, db = f"postgresql+{driver}://{auth}@", base.database
    rw = "target_session_attrs=read-write"
    return {
        "repeated": f"{head}/{db}?host=127.0.0.1:{dead}&host={host}:{port}&{rw}",
        "lists": f"{head}/{db}?host=127.0.0.1,{host}&port={dead},{port}&{rw}",
        "comma": f"{head}/{db}?host=127.0.0.1:{dead},{host}:{port}&{rw}",
    }[form]


@DRIVERS
@pytest.mark.parametrize("form", ["repeated", "lists", "comma"])
def test_i25_2_c55_every_multi_host_url_form_reaches_the_live_host(
    pg_database: URL, make_app: Any, pg_table: str, driver: str, form: str
) -> None:
    """``?host=h1:p1&host=h2:p2`` and ``?host=h1,h2&port=p1,p2`` are SQLAlchemy's own forms;
    ``?host=h1:p1,h2:p2`` is libpq's (SQLAlchemy made it the port ``","``), and works too.
    (libpq's ``h1:p1,h2:p2`` in the host part SQLAlchemy cannot parse: ``init_app``
    refuses it, tests/test_store_connect.py.)"""
    url = multi_host_url(form, driver, driver_url(pg_database, driver), free_port())
    app = protected_app(make_app, url, pg_table)
    try:
        assert post(app, "k1").status_code == 201
        again = post(app, "k1")
        assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
    finally:
        store = app.extensions["idempotency"].store
        store.table.drop(store.engine, checkfirst=True)


# -- item 2: a read-only server ------------------------------------------------------------


class PrivateServer:
    """A private PostgreSQL whose sessions can all be made read-only at once."""

    def __init__(self, server: PostgresServer) -> None:
        self.server = server
        self.port = server.port

    def url(self, driver: str, database: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql+{driver}://{user}@127.0.0.1:{self.port}/{database}"

    def read_only(self, on: bool) -> None:
        """Every session's next transaction is read-only (or writable again), as on a
        primary demoted to a standby: ``default_transaction_read_only`` and a reload."""
        value = "on" if on else "off"
        self.server.execute(f"ALTER SYSTEM SET default_transaction_read_only = {value}")
        self.server.execute("SELECT pg_reload_conf()")
        wait_until(
            lambda: self.server.execute("SHOW default_transaction_read_only") == [(value,)],
            f"default_transaction_read_only = {value}",
        )

    def client_backends(self) -> dict[int, str]:
        """The other client backends: pid -> the last statement each ran."""
        found = self.server.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE backend_type = 'client backend'"
            " AND pid <> pg_backend_pid()"
        )
        return {int(str(pid)): str(query) for pid, query in found}


@pytest.fixture(scope="module")
def private_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateServer]:
    if postgres_bindir() is None:
        service_missing("PostgreSQL server binaries", "initdb/postgres not found")
    server = PostgresServer(Path(tmp_path_factory.mktemp("ha-pg")))
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start a private PostgreSQL: {exc}")
    try:
        yield PrivateServer(server)
    finally:
        server.stop()


@pytest.fixture
def writable(private_pg: PrivateServer) -> Iterator[PrivateServer]:
    """The private server, writable at the start and at the end of the test."""
    private_pg.read_only(False)
    try:
        yield private_pg
    finally:
        private_pg.read_only(False)


def store_unavailable_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and "durable store unavailable" in r.getMessage()
    ]


@pytest.mark.slow
@DRIVERS
def test_i25_2_c25_a_read_only_server_is_an_outage_and_its_connections_leave_the_pool(
    writable: PrivateServer,
    make_app: Any,
    pg_table: str,
    driver: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pooled connection whose server turned read-only: 503 + Retry-After, never 500 or a
    view run without its claim; the connection that met it is closed, not kept for the
    next request; writable again, the server serves the next request."""
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    app = protected_app(make_app, writable.url(driver), pg_table)
    app.extensions["idempotency"].store.engine.dispose()  # create_table's connection
    assert post(app, "k1").status_code == 201
    served = set(writable.client_backends())  # the connections of the request path
    assert served
    writable.read_only(True)
    answer = post(app, "k2")
    assert_store_unavailable(answer)
    assert any("read-only" in line for line in store_unavailable_lines(caplog)), caplog.text
    assert not served & set(writable.client_backends()), (
        "the connection that met the read-only server is still open (kept in the pool)"
    )
    writable.read_only(False)
    assert post(app, "k2").status_code == 201
    assert post(app, "k3").status_code == 201


@pytest.mark.slow
@DRIVERS
def test_i25_2_c55_a_primary_demoted_behind_one_address_is_left_for_the_new_one(
    writable: PrivateServer,
    pg_database: URL,
    make_app: Any,
    pg_table: str,
    driver: str,
) -> None:
    """One address (a virtual IP, a DNS name, a proxy) moves from a primary that was
    demoted to the new one: the pooled connections to the old one meet "read-only",
    leave the pool, and the very request that met them is answered through a fresh
    connection to the new primary: 201, not a 503 for every pooled connection."""
    base = driver_url(pg_database, driver)
    user, database = base.username or "postgres", str(base.database)
    # The old primary: the private server, with this session's database name and user,
    # so that one URL fits both servers.
    writable.server.execute(f'CREATE DATABASE "{database}"')
    if user != "postgres":
        writable.server.execute(f'CREATE ROLE "{user}" SUPERUSER LOGIN')
    proxy = TcpProxy("127.0.0.1", writable.port).start()
    new_primary = create_engine(base)
    try:
        url = base.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        app = protected_app(make_app, url, pg_table)
        store = app.extensions["idempotency"].store
        for key in ("k1", "k2", "k3"):
            assert post(app, key).status_code == 201
        store.table.create(new_primary, checkfirst=True)
        writable.read_only(True)
        proxy.target = (base.host or "127.0.0.1", base.port or 5432)  # new connections
        answer = post(app, "k4")
        assert answer.status_code == 201, answer.get_data(as_text=True)
        assert post(app, "k5").status_code == 201
        with new_primary.connect() as conn:
            keys = conn.execute(text(f"SELECT count(*) FROM {pg_table}")).scalar_one()
        assert keys == 2
        store.table.drop(new_primary, checkfirst=True)
    finally:
        proxy.stop()
        new_primary.dispose()
        writable.read_only(False)
        writable.server.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@pytest.mark.slow
@DRIVERS
def test_i25_2_c25_the_outage_log_line_names_every_hosts_error(
    writable: PrivateServer,
    make_app: Any,
    pg_table: str,
    driver: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Through ``host=dead&host=standby&target_session_attrs=read-write``: 503, and the log
    line says why each host failed, not only the first (psycopg2) or last (psycopg 3)."""
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    dead = free_port()
    url = (
        f"postgresql+{driver}://postgres@/postgres?host=127.0.0.1:{dead}"
        f"&host=127.0.0.1:{writable.port}&target_session_attrs=read-write"
    )
    app = protected_app(make_app, url, pg_table)
    assert post(app, "k1").status_code == 201
    writable.read_only(True)
    assert_store_unavailable(post(app, "k2"))
    lines = store_unavailable_lines(caplog)
    assert lines, caplog.text
    line = lines[-1]
    assert "\n" not in line
    assert f"port {dead} failed: Connection refused" in line, line
    assert f"port {writable.port} failed: session is read-only" in line, line
    writable.read_only(False)
    app.extensions["idempotency"].store.engine.dispose()


# -- item 5: a server that stops answering ----------------------------------------------------


@pytest.fixture(params=["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
def stalling(request: Any, pg_database: URL, make_app: Any, pg_table: str) -> Iterator[Any]:
    """An app whose store is this session's database behind a proxy that can stall."""
    base = driver_url(pg_database, request.param)
    proxy = TcpProxy(base.host or "127.0.0.1", base.port or 5432).start()
    url = base.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    app, _ = make_app({"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_TABLE": pg_table})
    app.proxy = proxy  # type: ignore[attr-defined]
    yield app
    proxy.restore()
    store = app.extensions["idempotency"].store
    try:
        store.table.drop(store.engine, checkfirst=True)
    finally:
        proxy.stop()


@pytest.mark.slow
def test_i25_5_c25_a_server_that_stops_answering_is_503_within_the_deadline(
    stalling: Flask,
) -> None:
    """The proxy keeps every connection open and forwards nothing: a pooled connection's
    claim is cut off after the statement deadline (503), the next request's new
    connection after the connect timeout (503), and the store serves again as soon as
    the server answers."""
    app, proxy = stalling, stalling.proxy  # type: ignore[attr-defined]

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(paid=True), 201

    assert post(app, "k1").status_code == 201  # a pooled connection through the proxy
    proxy.stall()
    first, on_pooled = timed_post(app, "k2", STATEMENT_DEADLINE + CONNECT_TIMEOUT + 30)
    assert_store_unavailable(first)
    second, on_new = timed_post(app, "k3", STATEMENT_DEADLINE + CONNECT_TIMEOUT + 30)
    assert_store_unavailable(second)
    print(f"\nstalled server: 503 in {on_pooled:.2f} s (pooled), {on_new:.2f} s (new connection)")
    assert on_pooled <= STATEMENT_DEADLINE + SLACK
    assert on_new <= CONNECT_TIMEOUT + SLACK
    proxy.restore()
    assert post(app, "k4").status_code == 201


@pytest.mark.slow
def test_i25_5_c55_a_completion_that_meets_a_silent_server_answers_and_lands_later(
    stalling: Flask,
) -> None:
    """The server stops answering while the view runs: its client gets the 201 once the
    completion's deadline passes, and the completion, kept (C55), lands when the server
    answers again; a retry then replays it."""
    app, proxy = stalling, stalling.proxy  # type: ignore[attr-defined]
    runs: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        runs.append(1)
        proxy.stall()
        return jsonify(paid=True), 201

    answer, elapsed = timed_post(app, "k1", STATEMENT_DEADLINE + 30)
    print(f"\ncompletion on a stalled server: answered in {elapsed:.2f} s")
    assert answer.status_code == 201
    assert elapsed <= STATEMENT_DEADLINE + SLACK
    proxy.restore()
    wait_until(lambda: [r["state"] for r in rows(app)] == [COMPLETED], "the kept completion")
    again = post(app, "k1")
    assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
    assert runs == [1]
