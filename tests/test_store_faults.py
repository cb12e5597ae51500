"""The store against a real PostgreSQL or MariaDB whose COMMIT replies get lost (issue 9.4).

CONTRACT C8, C13, C14, C20.

A loopback proxy forwards the message that commits a write, lets the server
apply and answer it, then drops the answer and the connection: a COMMIT, or with
psycopg2 and psycopg 3, whose request-path statements each commit by themselves
(autocommit),
the statement itself. The store retries on a fresh connection
with the same lock token; each of its writes must recognise that it was already
applied: the claim is ours (no waiting for ourselves), the completion and the
release happened (no false ``lease_lost``, the waiters are woken).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import jsonify
from sqlalchemy import update
from sqlalchemy.engine import URL

from flask_idempotency import idempotent, signals
from flask_idempotency.records import COMPLETED, IN_PROGRESS, Claim, Record
from flask_idempotency.store.clock import db_now_ms
from tests.support.tcp_proxy import TcpProxy

from .conftest import driver_url
from .test_lifecycle import KEY, REPLAYED, rows
from .test_pg_rules import identity_of, record_signal

pytestmark = pytest.mark.postgres


class Proxied:
    """A server database behind a proxy that can lose one COMMIT reply, and apps on it."""

    def __init__(self, proxy: TcpProxy, url: str, make: Any, commit: bytes) -> None:
        self.proxy, self.url, self.make, self.commit = proxy, url, make, commit

    def marker(self, app: Any, statement: bytes) -> tuple[bytes, int]:
        """What to cut after, and how many earlier commits to let through, so that
        ``statement`` is applied with its answer lost: with psycopg2 the request
        path's statements each commit by themselves (autocommit; psycopg 3 too since
        issue 21, its first run on a connection in one round trip), so the statement
        itself and no earlier claim COMMIT; elsewhere its transaction's COMMIT, the
        claim's being the first."""
        store = app.extensions["idempotency"].store
        if store.engine.dialect.driver in ("psycopg2", "psycopg"):
            return statement, 0
        return self.commit, 1


@pytest.fixture(params=["psycopg2", "psycopg", "mariadb"], ids=["psycopg2", "psycopg3", "mariadb"])
def proxied(request: Any) -> Iterator[Proxied]:
    """PostgreSQL through both drivers, and MariaDB, each behind a proxy.

    The marker is the COMMIT as the client sends it: a PostgreSQL simple query
    (``COMMIT`` and its NUL), a MySQL ``COM_QUERY`` (command byte 3, then the text).
    """
    if request.param == "mariadb":
        base: URL = request.getfixturevalue("mysql_url")
        commit, port = b"\x03COMMIT", 3306
    else:
        base = driver_url(request.getfixturevalue("pg_database"), request.param)
        commit, port = b"COMMIT\x00", 5432
    make = request.getfixturevalue("make_app")
    proxy = TcpProxy(base.host or "127.0.0.1", base.port or port).start()
    url = base.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    stores: list[Any] = []

    def factory(config: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        merged = {"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_TABLE": table, **(config or {})}
        app, ext = make(merged, **kwargs)
        stores.append(app.extensions["idempotency"].store)
        return app, ext

    table = f"idem_{uuid.uuid4().hex[:12]}"
    yield Proxied(proxy, url, factory, commit)
    for store in stores[:1]:
        store.table.drop(store.engine, checkfirst=True)
    proxy.stop()


def counting_app(db: Proxied, status: int = 201, **config: Any) -> tuple[Any, list]:
    app, _ = db.make({"IDEMPOTENCY_WAIT": 1.0, **config})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return jsonify(n=len(calls)), status

    return app, calls


@pytest.mark.parametrize(
    "config", [{}, {"IDEMPOTENCY_ASYNC_CLAIM": True}], ids=["durable-claim", "async-claim"]
)
def test_i9_4_c8_lost_commit_reply_of_the_claim_is_recognised_as_our_claim(proxied, config) -> None:
    """C8/C13: the claim's reply is lost after it committed; the retry finds its own row
    and runs the view once, instead of parking behind itself and answering 409."""
    proxy = proxied.proxy
    app, calls = counting_app(proxied, **config)
    lost = record_signal(app, signals.lease_lost)
    marker, _ = proxied.marker(app, b"WITH ins AS")
    proxy.cut_after_reply_to(marker)
    first = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert proxy.cuts_after_reply == 1, "the proxy never cut the claim's reply"
    assert first.status_code == 201, first.get_data(as_text=True)
    assert calls == [1]
    assert lost == []
    again = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
    assert calls == [1]


def test_i9_4_c14_lost_commit_reply_of_the_completion_is_not_a_lost_lease(
    proxied,
) -> None:
    """C14/C23: the completion committed but its reply was lost; the retry recognises it
    (same token), so no ``lease_lost``, the record is completed and replays."""
    proxy = proxied.proxy
    app, calls = counting_app(proxied)
    lost = record_signal(app, signals.lease_lost)
    stored = record_signal(app, signals.response_stored)
    marker, skip = proxied.marker(app, b"UPDATE ")
    proxy.cut_after_reply_to(marker, skip=skip)  # the completion's, not the claim's
    first = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert proxy.cuts_after_reply == 1
    assert first.status_code == 201
    assert lost == [] and len(stored) == 1
    assert [r["state"] for r in rows(app)] == [COMPLETED]
    again = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
    assert calls == [1]


def test_i9_4_c20_lost_commit_reply_of_the_release_still_wakes_the_waiters(
    proxied,
) -> None:
    """C20/C12: the release's DELETE committed but its reply was lost: no false
    ``lease_lost``, the release is announced (waiters woken) and a retry runs anew."""
    proxy = proxied.proxy
    app, calls = counting_app(proxied, status=500)
    lost = record_signal(app, signals.lease_lost)
    released = record_signal(app, signals.claim_released)
    announced: list[str] = []
    wakeups = app.extensions["idempotency"].wakeups
    original_announce = wakeups.announce
    wakeups.announce = lambda digest, *a: (announced.append(digest), original_announce(digest, *a))
    marker, skip = proxied.marker(app, b"DELETE ")
    proxy.cut_after_reply_to(marker, skip=skip)  # the release's, not the claim's
    first = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert proxy.cuts_after_reply == 1
    assert first.status_code == 500
    assert lost == [] and len(released) == 1 and len(announced) == 1
    assert rows(app) == []
    second = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert second.status_code == 500 and calls == [1, 1]


def test_i9_4_c13_lost_commit_reply_of_a_takeover_is_recognised(proxied) -> None:
    """C13: a takeover UPDATE that committed with its reply lost is our claim, not a
    live foreign lease to wait for."""
    proxy = proxied.proxy
    app, _ = proxied.make()
    store = app.extensions["idempotency"].store
    ident = identity_of(app, "/pay", {"a": 1})
    first = store.acquire(ident, ttl=3600, lease=60)
    assert isinstance(first, Claim)
    t = store.table
    with store.autocommit.connect() as conn:  # the first owner's lease lapses now
        conn.execute(update(t).values(lease_expires_at_ms=db_now_ms() - 1))
    # COMMITs: [claim-or-read] (none with psycopg2: it commits by itself), [takeover] <- cut
    _, skip = proxied.marker(app, b"")
    proxy.cut_after_reply_to(proxied.commit, skip=skip)
    second = store.acquire(ident, ttl=3600, lease=60)
    assert proxy.cuts_after_reply == 1
    assert isinstance(second, Claim), second
    assert second.lock_token != first.lock_token
    record = store.get(ident.key_digest)
    assert isinstance(record, Record) and record.state == IN_PROGRESS
    assert record.lock_token == second.lock_token
    assert store.complete(second, _response()) is not None
    assert store.complete(first, _response()) is None  # the lapsed owner stays fenced out


def _response() -> Any:
    from flask_idempotency.records import StoredResponse

    return StoredResponse(201, (), b"{}")


# -- 9.12: a missing or mismatched table is a deployment error (C45) -----------------------


@pytest.mark.parametrize("damage", ["drop-table", "drop-column"])
def test_i9_12_c45_missing_or_mismatched_table_never_fails_open(
    make_pg_app, caplog, damage
) -> None:
    """C45/C25: with IDEMPOTENCY_FAIL_OPEN a missing table (or column) must not run the view
    unprotected: 503, never the view, and an ERROR line naming the commands that fix it."""
    app, _ = make_pg_app({"IDEMPOTENCY_FAIL_OPEN": True})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return jsonify(n=1), 201

    store = app.extensions["idempotency"].store
    if damage == "drop-table":
        store.table.drop(store.engine)
    else:
        with store.autocommit.connect() as conn:
            conn.exec_driver_sql(f'ALTER TABLE "{store.table.name}" DROP COLUMN body_omitted')
    with caplog.at_level("ERROR", logger="flask_idempotency"):
        response = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.json["code"] == "store-unavailable"
    assert "Idempotency-Unprotected" not in response.headers
    assert calls == []
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors, "no ERROR line for a deployment error"
    assert all(fix in errors[0] for fix in ("flask db upgrade", "create-table", "create_all"))
    if damage == "drop-table":
        store.create_table()  # for the fixture's teardown


def test_i9_12_c45_missing_table_on_sqlite_is_a_deployment_error(make_app, caplog) -> None:
    """C45 on SQLite too: 'no such table' is classified as a deployment error, not an outage."""
    app, _ = make_app({"IDEMPOTENCY_FAIL_OPEN": True})

    @app.post("/pay")
    @idempotent
    def pay():
        raise AssertionError("the view must not run unprotected")

    store = app.extensions["idempotency"].store
    store.table.drop(store.engine)
    with caplog.at_level("ERROR", logger="flask_idempotency"):
        response = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert response.status_code == 503
    assert any("create-table" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


# -- 9.13: the claim is durable unless the app opts in (C8, C25) -----------------------------


def _record_synchronous_commit(store: Any) -> None:
    """A server-side witness: a trigger notes ``synchronous_commit`` of each claim INSERT."""
    name = store.table.name
    with store.autocommit.connect() as conn:
        conn.exec_driver_sql(f'CREATE TABLE "{name}_witness" (setting text)')
        conn.exec_driver_sql(
            f'CREATE FUNCTION "{name}_note"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN'
            f" INSERT INTO \"{name}_witness\" VALUES (current_setting('synchronous_commit'));"
            " RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f'CREATE TRIGGER "{name}_note" AFTER INSERT ON "{name}"'
            f' FOR EACH ROW EXECUTE FUNCTION "{name}_note"()'
        )


def _witnessed(store: Any) -> list[str]:
    with store.autocommit.connect() as conn:
        return [
            r[0] for r in conn.exec_driver_sql(f'SELECT setting FROM "{store.table.name}_witness"')
        ]


@pytest.mark.parametrize(
    ("config", "expected"), [({}, "on"), ({"IDEMPOTENCY_ASYNC_CLAIM": True}, "off")]
)
def test_i9_13_c8_claim_commits_synchronously_unless_async_claim_is_set(
    make_pg_app, config, expected
) -> None:
    """C8: by default the claim's transaction runs with synchronous_commit on (a crash cannot
    lose a claim its client was told about); IDEMPOTENCY_ASYNC_CLAIM turns it off, as documented."""
    app, _ = make_pg_app(config)

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(n=1), 201

    store = app.extensions["idempotency"].store
    _record_synchronous_commit(store)
    for n in range(3):
        assert (
            app.test_client()
            .post("/pay", json={}, headers={"Idempotency-Key": f"k{n}"})
            .status_code
            == 201
        )
    assert _witnessed(store) == [expected] * 3


def test_i16_3_c25_connection_lost_right_after_a_commit_logs_no_traceback(proxied, caplog) -> None:
    """C25/C14: the network drops right after a store transaction committed (found by the
    chaos suite's database cut on MariaDB).

    The request succeeds and nothing is logged with a traceback. On MySQL the pool's
    rollback-on-return is a real round trip (PyMySQL sends ``ROLLBACK`` even with no
    transaction open), so a cut landing between COMMIT and that ROLLBACK made the pool
    log "Exception during reset or similar" with a traceback; every store transaction
    is already ended by its own COMMIT or ROLLBACK, so the store's engine sends none.
    """
    proxy = proxied.proxy
    app, calls = counting_app(proxied)
    # A warm-up first: each pool's first connection initialises its dialect, which ends
    # in a ROLLBACK of its own before any store transaction ran.
    warm = app.test_client().post("/pay", json={"a": 0}, headers={"Idempotency-Key": "warm-up"})
    assert warm.status_code == 201 and calls == [1]
    calls.clear()
    proxy.cut_after_reply_to(b"ROLLBACK")  # whatever commits the writes (a COMMIT, or the
    # statement itself on the psycopg2 autocommit path), no ROLLBACK may follow it
    with caplog.at_level(logging.WARNING):
        first = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert first.status_code == 201 and calls == [1]
    tracebacks = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info]
    assert tracebacks == []
    assert proxy.cuts_after_reply == 0, "a ROLLBACK followed a committed store transaction"
