"""Store writes cut off by the statement deadline, on real servers (C58, C11).

CONTRACT C58, C11, C25.

Another session holds the records table locked (``LOCK TABLE … IN SHARE MODE`` on
PostgreSQL, ``LOCK TABLES … READ`` on MariaDB) for longer than the store's statement
deadline (shortened here). The claim waits for the lock; the request gets 503 at the
deadline. What must not happen next: the claim, still queued on the server, commits
once the lock goes, and every retry gets 409 ``request-in-progress`` for a whole lease
though no view ever ran (C11: 409 means the original is still running). The cut claim
is cancelled on the server, so the retry after the stall runs the view.

One cell per driver: psycopg2, psycopg 3, MariaDB (PyMySQL), and both PostgreSQL
drivers through a private PgBouncer in transaction mode.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import jsonify
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from flask_idempotency import idempotent, signals
from flask_idempotency.records import COMPLETED
from tests.conftest import driver_url, service_missing
from tests.support.pgbouncer import PgBouncer, pgbouncer_binary
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until
from tests.test_lifecycle import KEY, rows
from tests.test_pg_rules import record_signal

pytestmark = pytest.mark.postgres

#: The store's statement deadline in these tests (5 s in production).
DEADLINE = 0.5
#: The longest the lock is held if a request never answers while it is (the defect).
HOLD_AT_MOST = 4.0

CELLS = ["psycopg2", "psycopg3", "mariadb", "psycopg2-pgbouncer", "psycopg3-pgbouncer"]


class Cell:
    """One database and driver: the store's URL and a direct URL for the lock holder."""

    def __init__(self, name: str, url: URL, direct: URL, make: Any) -> None:
        self.name, self.url, self.direct, self.make = name, url, direct, make

    @property
    def mariadb(self) -> bool:
        return self.name == "mariadb"


@pytest.fixture(params=CELLS)
def cell(request: Any) -> Iterator[Cell]:
    name: str = request.param
    bouncer: PgBouncer | None = None
    if name == "mariadb":
        direct: URL = request.getfixturevalue("mysql_url")
        url = direct
    else:
        driver = "psycopg" if name.startswith("psycopg3") else "psycopg2"
        direct = driver_url(request.getfixturevalue("pg_database"), driver)
        url = direct
        if name.endswith("pgbouncer"):
            binary = pgbouncer_binary()
            if binary is None:
                service_missing(
                    "pgbouncer", "the binary is not installed (apt-get install pgbouncer)"
                )
            bouncer = PgBouncer(
                str(binary), str(direct.host or "127.0.0.1"), int(direct.port or 5432), pool_size=4
            ).start()
            url = bouncer.route(direct)
    stores: list[Any] = []
    factory = _app_factory(request.getfixturevalue("make_app"), url, stores)

    try:
        yield Cell(name, url, direct, factory)
    finally:
        for store in stores[:1]:
            for t in (store.table, store.identity_table):
                t.drop(store.engine, checkfirst=True)
        if bouncer is not None:
            bouncer.stop()


def _app_factory(make: Any, url: Any, stores: list[Any]) -> Callable[..., Any]:
    """Apps of one cell: one private table on ``url``, the short statement deadline; each
    app's store is added to ``stores`` so that the cell drops the table once."""
    table = f"idem_{uuid.uuid4().hex[:12]}"

    def factory(config: dict[str, Any] | None = None) -> Any:
        merged = {
            "IDEMPOTENCY_DATABASE_URI": url.render_as_string(hide_password=False),
            "IDEMPOTENCY_TABLE": table,
            **(config or {}),
        }
        app, _ = make(merged)
        store = app.extensions["idempotency"].store
        store.statement_deadline = DEADLINE
        stores.append(store)
        return app

    return factory


class TableLock(threading.Thread):
    """Another database session that holds the records table locked until told (or
    :data:`HOLD_AT_MOST` seconds), on a connection of its own."""

    def __init__(self, cell: Cell, table: str) -> None:
        super().__init__(daemon=True)
        self.cell, self.table = cell, table
        self.locked = threading.Event()
        self.release = threading.Event()
        self.released = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        engine = create_engine(self.cell.direct, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                if self.cell.mariadb:
                    conn.exec_driver_sql(f"LOCK TABLES `{self.table}` READ")
                else:
                    conn.execute(text(f'LOCK TABLE "{self.table}" IN SHARE MODE'))
                self.locked.set()
                self.release.wait(HOLD_AT_MOST)
                self.released.set()
                if self.cell.mariadb:
                    conn.exec_driver_sql("UNLOCK TABLES")
                conn.rollback()
        except BaseException as exc:  # shown by the test
            self.error = exc
            self.locked.set()
        finally:
            self.released.set()
            engine.dispose()


def counting_app(cell: Cell) -> tuple[Any, list[int]]:
    app = cell.make({"IDEMPOTENCY_WAIT": 0.3, "IDEMPOTENCY_LEASE": 20})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        return jsonify(n=len(calls)), 201

    return app, calls


def test_c58_c11_a_claim_cut_by_the_deadline_never_blocks_its_key(cell: Cell) -> None:
    """C58/C11: the claim waits on a table lock past the deadline; the request answers
    503 while the lock is still held, and once the lock is gone the retry runs the view
    (no 409 for a view that never ran: the cut claim was cancelled on the server)."""
    app, calls = counting_app(cell)
    client = app.test_client()
    store = app.extensions["idempotency"].store
    lock = TableLock(cell, store.table.name)
    lock.start()
    assert lock.locked.wait(10) and lock.error is None, lock.error
    first = client.post("/pay", json={"a": 1}, headers=KEY)
    answered_while_locked = not lock.released.is_set()
    # Cancelled on the server, not only given up by the client: while the lock is still
    # held, nothing of the store queues for it any longer (PostgreSQL's pg_locks).
    still_queued = not cell.mariadb and _queued_for(cell.direct, store.table.name, within=2.0)
    lock.release.set()
    lock.join(10)
    assert lock.error is None, lock.error
    assert answered_while_locked, (
        f"the request waited for the lock ({first.status_code}) past its {DEADLINE} s deadline"
    )
    assert not still_queued, "the cut claim still waited on the server: no cancel reached it"
    assert first.status_code == 503, first.get_data(as_text=True)
    assert first.headers.get("Retry-After")
    assert calls == []
    second = client.post("/pay", json={"a": 1}, headers=KEY)
    assert second.status_code == 201, (second.status_code, second.get_data(as_text=True))
    assert calls == [1]
    assert [r["state"] for r in rows(app)] == [COMPLETED]


# -- no reply at all: the claim may commit later, and is undone by a kept release ---------


@pytest.fixture(params=["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
def proxied_cell(request: Any) -> Iterator[tuple[Cell, TcpProxy]]:
    """PostgreSQL through a loopback proxy that can stop forwarding (a dead network)."""
    direct = driver_url(request.getfixturevalue("pg_database"), request.param)
    proxy = TcpProxy(direct.host or "127.0.0.1", direct.port or 5432).start()
    routed = direct.set(host="127.0.0.1", port=proxy.port)
    stores: list[Any] = []
    factory = _app_factory(request.getfixturevalue("make_app"), routed, stores)

    try:
        yield Cell(str(request.param), routed, direct, factory), proxy
    finally:
        proxy.restore()
        for store in stores[:1]:
            with create_engine(direct, poolclass=NullPool).connect() as conn:
                for t in (store.table, store.identity_table):
                    conn.execute(text(f'DROP TABLE IF EXISTS "{t.name}"'))
                conn.commit()
        proxy.stop()


def _waiting_on(direct: URL, table: str) -> bool:
    """Whether a statement waits for a lock on ``table`` (the claim, queued)."""
    engine = create_engine(direct, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            sql = (
                "SELECT count(*) FROM pg_locks"
                " WHERE relation = CAST(:t AS regclass) AND NOT granted"
            )
            return bool(conn.execute(text(sql), {"t": table}).scalar())
    finally:
        engine.dispose()


def _queued_for(direct: URL, table: str, *, within: float) -> bool:
    """Whether a statement still waits for a lock on ``table`` after ``within`` seconds."""
    try:
        wait_until(lambda: not _waiting_on(direct, table), "no lock wait", within=within)
    except AssertionError:
        return True
    return False


def test_c58_a_claim_with_no_reply_that_commits_later_is_released_by_a_kept_release(
    proxied_cell: tuple[Cell, TcpProxy],
) -> None:
    """C58/C11: the claim waits on a table lock, then the network goes silent: not even
    the cancel reaches the server, the request answers 503, and the claim commits on
    the server once the lock goes, under a token nobody holds. The fenced release kept
    for it (by key and that token) lands when the network is back, and the retry runs
    the view instead of getting 409 for a lease."""
    cell, proxy = proxied_cell
    app, calls = counting_app(cell)
    store = app.extensions["idempotency"].store
    landed = record_signal(app, signals.settlement_deferred)
    lock = TableLock(cell, store.table.name)
    lock.start()
    assert lock.locked.wait(10) and lock.error is None, lock.error
    answers: list[Any] = []
    request = threading.Thread(
        target=lambda: answers.append(app.test_client().post("/pay", json={"a": 1}, headers=KEY))
    )
    request.start()
    wait_until(lambda: _waiting_on(cell.direct, store.table.name), "the claim queued on the lock")
    proxy.stall()  # the network goes silent: the claim, and any cancel of it, get no reply
    request.join(30)
    assert answers and answers[0].status_code == 503, answers
    lock.release.set()  # the queued claim commits now, on the server
    lock.join(10)
    try:  # psycopg2's cut claim commits; psycopg 3's (extended protocol) never does
        wait_until(lambda: _claimed(cell.direct, store.table.name), "committed", within=3)
        committed = True
    except AssertionError:
        committed = False
    proxy.restore()
    if committed:
        wait_until(
            lambda: any(s.get("outcome") == "landed" for s in landed),
            "the kept release landed",
            within=20,
        )
    second = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert second.status_code == 201, (second.status_code, second.get_data(as_text=True))
    assert calls == [1]


def _claimed(direct: URL, table: str) -> bool:
    engine = create_engine(direct, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return bool(conn.execute(text(f'SELECT count(*) FROM "{table}"')).scalar())
    finally:
        engine.dispose()
