"""MariaDB/MySQL behind a failover: a server that turned read-only (issue 25, item 2).

CONTRACT C25, C55.

A demoted MariaDB/MySQL primary refuses writes with error 1290
(ER_OPTION_PREVENTS_STATEMENT: "... running with the --read-only option ...", or
``--super-read-only`` on MySQL), a read-only transaction with error 1792
(ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION, SQLSTATE 25006). Either is what SQLSTATE
25006 is on PostgreSQL (tests/test_pg_ha.py): an outage (503 + ``Retry-After``, never
a 500, no view run without its claim), whose pooled connections leave the pool, the
statement tried once more on a fresh connection.

The read-only server is a private MariaDB (tests/support/mariadb_server.py) made
read-only with ``SET GLOBAL read_only``; the app connects as a user of its own with
privileges on its database only (``root`` holds ``READ_ONLY ADMIN`` and would write on).
The machine's own MariaDB is never reconfigured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest
from flask import Flask, jsonify, request
from sqlalchemy import event

from flask_idempotency import idempotent
from flask_idempotency.store.errors import is_read_only, sqlstate
from tests.conftest import running_mariadb, service_missing
from tests.support.mariadb_server import MariaDBServer
from tests.support.waiting import wait_until

#: The MySQL drivers the project supports; mysqlclient is optional (the Makefile adds it
#: when it builds against libmariadb-dev): its cases skip where it is not installed, and
#: fail under CI=true, as every real-driver test does.
DRIVERS = pytest.mark.parametrize("driver", ["pymysql", "mysqldb"])

APP_USER, APP_DATABASE = "idem_app", "idem_app"
MARIADB_READ_ONLY = (
    "The MariaDB server is running with the --read-only option so it cannot execute this statement"
)


# -- what the errors say (no server) -------------------------------------------------------


#: (errno, SQLSTATE the server sends, message, read-only?)
ERRORS = {
    "1290": (1290, "HY000", MARIADB_READ_ONLY, True),
    "1290-mysql": (1290, "HY000", MARIADB_READ_ONLY.replace("MariaDB", "MySQL"), True),
    "1290-super": (
        1290,
        "HY000",
        MARIADB_READ_ONLY.replace("MariaDB", "MySQL").replace("--", "--super-"),
        True,
    ),
    "1290-read_only": (1290, "HY000", "The server is running with read_only = ON", True),
    "1792": (1792, "25006", "Cannot execute statement in a READ ONLY transaction", True),
    "1290-file": (
        1290,
        "HY000",
        "The MariaDB server is running with the --secure-file-priv option so it cannot"
        " execute this statement",
        False,
    ),
    "1290-grants": (
        1290,
        "HY000",
        "The MySQL server is running with the --skip-grant-tables option so it cannot"
        " execute this statement",
        False,
    ),
    "1213": (1213, "40001", "Deadlock found when trying to get lock", False),
}


@pytest.mark.parametrize("wire_sqlstate", [False, True], ids=["no-sqlstate", "sqlstate"])
@pytest.mark.parametrize("case", list(ERRORS))
def test_i25_2_c25_mysql_read_only_errors_are_read_only(case: str, wire_sqlstate: bool) -> None:
    """1290 only when its message names the read-only option (the same number is shared
    by ``--secure-file-priv``, ``--skip-grant-tables`` and others); 1792 always. Whether
    the driver keeps the server's SQLSTATE (PyMySQL 1.2) or not (mysqlclient)."""
    errno, state, message, read_only = ERRORS[case]
    exc = pymysql.err.OperationalError(errno, message, sqlstate=state if wire_sqlstate else None)
    assert is_read_only(exc) is read_only


def test_i25_2_c25_mysql_read_only_transaction_has_sqlstate_25006() -> None:
    """MySQL documents SQLSTATE 25006 for 1792; mysqlclient reports none."""
    exc = pymysql.err.OperationalError(1792, "Cannot execute statement in a READ ONLY transaction")
    assert sqlstate(exc) == "25006"


# -- a private MariaDB ---------------------------------------------------------------------


class PrivateMariaDB:
    """A private MariaDB that can be made read-only, with a database and a user for the app
    (privileges on that database only: no ``READ_ONLY ADMIN``, no ``SUPER``)."""

    def __init__(self, server: MariaDBServer) -> None:
        self.server = server
        server.execute(f"CREATE DATABASE `{APP_DATABASE}` CHARACTER SET utf8mb4")
        server.execute(f"CREATE USER '{APP_USER}'@'%' IDENTIFIED BY 'pw'")
        server.execute(
            "GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, DROP, INDEX, ALTER"
            f" ON `{APP_DATABASE}`.* TO '{APP_USER}'@'%'"
        )

    def url(self, driver: str) -> str:
        if driver == "mysqldb":
            try:
                import MySQLdb  # noqa: F401
            except ImportError as exc:  # `make test` builds it: under CI=true a failure
                service_missing("the mysqlclient driver", str(exc))
        return f"mysql+{driver}://{APP_USER}:pw@127.0.0.1:{self.server.port}/{APP_DATABASE}"

    def read_only(self, on: bool) -> None:
        """The server takes no writes from the app's user (or takes them again), as a
        demoted primary: ``SET GLOBAL read_only``."""
        value = "ON" if on else "OFF"
        self.server.execute(f"SET GLOBAL read_only = {value}")
        assert self.server.execute("SELECT @@GLOBAL.read_only") == [(1 if on else 0,)]

    def sessions(self) -> set[int]:
        """The ids of the app user's connections to the server."""
        found = self.server.execute(
            f"SELECT ID FROM information_schema.PROCESSLIST WHERE USER = '{APP_USER}'"
        )
        return {int(str(row[0])) for row in found}


@pytest.fixture(scope="module")
def private_mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    with running_mariadb(Path(tmp_path_factory.mktemp("ha-mariadb"))) as server:
        yield PrivateMariaDB(server)


@pytest.fixture
def writable(private_mariadb: PrivateMariaDB) -> Iterator[PrivateMariaDB]:
    """The private server, writable at the start and at the end of the test."""
    private_mariadb.read_only(False)
    try:
        yield private_mariadb
    finally:
        private_mariadb.read_only(False)


def protected_app(make_app: Any, url: str, table: str) -> tuple[Flask, list[str]]:
    """An app with one protected view on ``url``; the keys its view ran for."""
    app, _ = make_app({"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_TABLE": table})
    ran: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        ran.append(request.headers["Idempotency-Key"])
        return jsonify(paid=True), 201

    return app, ran


def post(app: Flask, key: str) -> Any:
    return app.test_client().post("/pay", json={"a": 1}, headers={"Idempotency-Key": key})


def assert_store_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["code"] == "store-unavailable"
    assert response.headers.get("Retry-After")


def store_unavailable_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and "durable store unavailable" in r.getMessage()
    ]


def assert_left(server: PrivateMariaDB, served: set[int]) -> None:
    """The connections in ``served`` are closed (not kept in the pool): gone from the
    server's processlist within a moment."""
    try:
        wait_until(lambda: not served & server.sessions(), "the old connections to close", within=3)
    except AssertionError:
        raise AssertionError(
            f"the connections {sorted(served & server.sessions())} that met the read-only"
            " server are still open (kept in the pool)"
        ) from None


# -- error 1290: the server runs with --read-only ------------------------------------------


@pytest.mark.mysql
@pytest.mark.slow
@DRIVERS
def test_i25_2_c25_mariadb_read_only_server_is_an_outage_and_its_connections_leave_the_pool(
    writable: PrivateMariaDB,
    make_app: Any,
    pg_table: str,
    driver: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pooled connection whose server turned read-only (1290): 503 + Retry-After as
    problem+json, never 500 or a view run without its claim; the connection that met it is
    closed, not kept for the next request; writable again, the server serves the next
    request."""
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    app, ran = protected_app(make_app, writable.url(driver), pg_table)
    store = app.extensions["idempotency"].store
    store.engine.dispose()  # create_table's connection
    assert post(app, "k1").status_code == 201
    served = writable.sessions()  # the connections of the request path
    assert served
    writable.read_only(True)
    assert_store_unavailable(post(app, "k2"))
    assert ran == ["k1"]
    lines = store_unavailable_lines(caplog)
    assert any("read-only" in line for line in lines), caplog.text
    assert_left(writable, served)
    writable.read_only(False)
    assert post(app, "k2").status_code == 201
    assert post(app, "k3").status_code == 201
    assert ran == ["k1", "k2", "k3"]
    store.table.drop(store.engine, checkfirst=True)


# -- error 1792: a read-only session -------------------------------------------------------


@pytest.mark.mysql
@pytest.mark.slow
@DRIVERS
def test_i25_2_c55_mariadb_a_read_only_session_is_left_for_a_fresh_connection(
    writable: PrivateMariaDB,
    make_app: Any,
    pg_table: str,
    driver: str,
) -> None:
    """A pooled connection whose session is read-only (1792, SQLSTATE 25006: made so by a
    "connect" event here) leaves the pool, and the very request that met it is answered
    through a fresh connection: 201, not a 503 while the read-only session stays pooled.
    (PyMySQL 1.2 keeps the SQLSTATE the server sends; mysqlclient keeps none.)"""
    app, ran = protected_app(make_app, writable.url(driver), pg_table)
    store = app.extensions["idempotency"].store
    engine = store.engine
    engine.dispose()  # create_table's connection
    read_only_sessions = [1]  # how many connections are still born read-only

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_connection: Any, record: Any) -> None:
        if read_only_sessions[0]:
            read_only_sessions[0] -= 1
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("SET SESSION TRANSACTION READ ONLY")
            finally:
                cursor.close()

    with engine.connect() as conn:  # the read-only session, pooled
        conn.exec_driver_sql("SELECT 1")
    stale = writable.sessions()
    assert len(stale) == 1 and read_only_sessions == [0]
    answer = post(app, "k1")
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert ran == ["k1"]
    assert_left(writable, stale)
    assert post(app, "k2").status_code == 201
    store.table.drop(engine, checkfirst=True)


@pytest.mark.mysql
@pytest.mark.slow
@DRIVERS
def test_i25_2_c25_mariadb_read_only_sessions_are_an_outage_and_leave_the_pool(
    writable: PrivateMariaDB,
    make_app: Any,
    pg_table: str,
    driver: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every session read-only (1792): 503 + Retry-After, no view run; once connections
    are born writable again, the next request gets one (the read-only ones left the pool)."""
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    app, ran = protected_app(make_app, writable.url(driver), pg_table)
    store = app.extensions["idempotency"].store
    engine = store.engine
    engine.dispose()
    read_only = [True]

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_connection: Any, record: Any) -> None:
        if read_only[0]:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("SET SESSION TRANSACTION READ ONLY")
            finally:
                cursor.close()

    assert_store_unavailable(post(app, "k1"))
    assert ran == []
    assert any("READ ONLY" in line for line in store_unavailable_lines(caplog)), caplog.text
    stale = writable.sessions()
    read_only[0] = False
    assert post(app, "k1").status_code == 201
    assert ran == ["k1"]
    assert_left(writable, stale)
    store.table.drop(engine, checkfirst=True)
