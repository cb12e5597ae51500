"""A kept settlement holds its lease, and one that lands at exit is finished (CONTRACT C59).

The durable store (the real PostgreSQL) sits behind a loopback proxy the view cuts,
as in tests/test_deferred.py: the claim is committed, the view runs, and storing
its answer fails as during a primary failover. These cells check what follows:
the kept completion's lease in the database is renewed whenever the store answers,
a retry on the same process never takes over the key it keeps, and an exit flush
returns only once the landed completion's signals have run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from flask import jsonify
from sqlalchemy import func, select

from flask_idempotency import idempotent, signals
from flask_idempotency.completion import deferred, heartbeat
from flask_idempotency.records import COMPLETED
from flask_idempotency.store import StoreError
from tests import test_deferred
from tests.support.waiting import wait_until
from tests.test_deferred import CutStore
from tests.test_lifecycle import KEY, REPLAYED

pytestmark = pytest.mark.postgres

#: The store behind a proxy the view cuts, for both PostgreSQL drivers.
cut_store = test_deferred.cut_store


def _lease_expiry(db: CutStore) -> int | None:
    table = db.store_table
    with db.direct.connect() as conn:
        return conn.execute(select(table.c.lease_expires_at_ms)).scalar_one()


def _lapsed(db: CutStore) -> bool:
    table = db.store_table
    now_ms = func.floor(func.extract("epoch", func.clock_timestamp()) * 1000)
    with db.direct.connect() as conn:
        return bool(conn.execute(select(table.c.lease_expires_at_ms < now_ms)).scalar_one())


def test_c59_a_kept_completion_has_its_lease_renewed_while_the_store_answers(
    cut_store: CutStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store answers (renewals land) but keeps refusing the completion for a while:
    the record's lease must be renewed all along, not left to lapse."""
    app = cut_store.app(IDEMPOTENCY_LEASE=1)
    store = app.extensions["idempotency"].store
    cut_store.store_table = store.table
    refusing = threading.Event()
    refusing.set()
    complete = store.complete

    def refused_complete(*args: Any, **kwargs: Any) -> Any:
        if refusing.is_set():
            raise StoreError("refused for now")
        return complete(*args, **kwargs)

    monkeypatch.setattr(store, "complete", refused_complete)

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(ok=True), 201

    assert app.test_client().post("/pay", json={}, headers=KEY).status_code == 201
    assert deferred.pending() == 1
    first = _lease_expiry(cut_store)
    assert first is not None
    # Two renewals past the lease the view ended with: the record never lapsed.
    wait_until(
        lambda: (_lease_expiry(cut_store) or 0) > first + 1000,
        "the kept completion's lease renewed",
        within=5,
    )
    refusing.clear()
    wait_until(lambda: cut_store.states() == [COMPLETED], "the completion landed", within=5)
    wait_until(lambda: deferred.pending() == 0, "no settlement left", within=5)


def test_c59_a_retry_on_the_keeping_process_never_takes_over_its_kept_key(
    cut_store: CutStore,
) -> None:
    """An outage longer than the lease: when the store is back, a retry on the process
    that keeps the completion must not take the lapsed lease over and run the view again."""
    app = cut_store.app(IDEMPOTENCY_LEASE=1)
    cut_store.store_table = app.extensions["idempotency"].store.table
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        cut_store.proxy.cut()
        return jsonify(run=len(calls)), 201

    client = app.test_client()
    first = client.post("/pay", json={}, headers=KEY)
    assert first.get_json() == {"run": 1}
    # The outage outlasts what was left of the lease: in the database it has lapsed.
    wait_until(lambda: _lapsed(cut_store), "the kept completion's lease lapsed", within=10)
    cut_store.proxy.restore()
    again = client.post("/pay", json={}, headers=KEY)
    assert calls == [1], f"the view ran again: {again.status_code} {again.get_data()!r}"
    wait_until(lambda: cut_store.states() == [COMPLETED], "the completion landed", within=5)
    wait_until(lambda: deferred.pending() == 0, "no settlement left", within=5)
    replay = client.post("/pay", json={}, headers=KEY)
    assert replay.headers.get(REPLAYED) == "true" and replay.get_json() == {"run": 1}
    assert calls == [1]


def test_c59_a_completion_landing_in_the_exit_flush_gets_its_signals_first(
    cut_store: CutStore,
) -> None:
    """``flush()`` (the process ends right after it) returns only once the landed
    completion's promotion, wake-up and signals have run."""
    app = cut_store.app()
    cut_store.store_table = app.extensions["idempotency"].store.table
    stored: list[int] = []

    def slow_receiver(sender: Any, **extra: Any) -> None:
        time.sleep(0.3)  # a receiver that takes a moment: the process must wait for it
        stored.append(extra["status"])

    signals.response_stored.connect(slow_receiver, app, weak=False)

    @app.post("/pay")
    @idempotent
    def pay():
        cut_store.proxy.cut()
        return jsonify(ok=True), 201

    assert app.test_client().post("/pay", json={}, headers=KEY).status_code == 201
    assert deferred.pending() == 1
    cut_store.proxy.restore()
    assert deferred.flush(timeout=10) == 0
    assert stored == [201], "flush() returned before the landed completion's signals ran"
    assert cut_store.states() == [COMPLETED]


def test_c59_a_slow_settlement_never_delays_the_renewal_of_a_running_view(
    cut_store: CutStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept completion whose attempt hangs (up to the statement deadline on a real
    outage) must not hold up the renewals of views still running."""
    app = cut_store.app(IDEMPOTENCY_LEASE=1)
    store = app.extensions["idempotency"].store
    cut_store.store_table = store.table
    complete = store.complete
    refused: list[bool] = []
    hanging, go = threading.Event(), threading.Event()

    def slow_complete(*args: Any, **kwargs: Any) -> Any:
        if not refused:
            refused.append(True)
            raise StoreError("refused for now")  # the first view's completion is kept
        if threading.current_thread() is not threading.main_thread():
            hanging.set()  # the kept completion's retry hangs until the test lets it go
            go.wait(10)
        return complete(*args, **kwargs)

    monkeypatch.setattr(store, "complete", slow_complete)

    @app.post("/kept")
    @idempotent
    def kept():
        return jsonify(ok=True), 201

    @app.post("/running")
    @idempotent
    def running():
        table = cut_store.store_table
        newest = select(table.c.lease_expires_at_ms).order_by(table.c.id.desc()).limit(1)
        with cut_store.direct.connect() as conn:
            first = conn.execute(newest).scalar_one()

        def renewed() -> bool:
            with cut_store.direct.connect() as conn:
                return conn.execute(newest).scalar_one() > first + 1000

        wait_until(renewed, "the running view's lease renewed twice", within=5)
        return jsonify(ok=True), 201

    client = app.test_client()
    try:
        assert client.post("/kept", json={}, headers=KEY).status_code == 201
        assert hanging.wait(5), "the kept completion was never retried"
        other = client.post("/running", json={}, headers={"Idempotency-Key": "running-1"})
        assert other.status_code == 201, other.get_data()
    finally:
        go.set()
    wait_until(lambda: deferred.pending() == 0, "no settlement left", within=5)
    assert cut_store.states() == [COMPLETED, COMPLETED]


def test_c59_the_exit_flush_settles_by_itself_when_no_thread_may_start(
    cut_store: CutStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At interpreter exit a new thread may be refused (Python 3.12+): the flush then
    lands the kept completion on its own thread, signals included."""
    app = cut_store.app()
    cut_store.store_table = app.extensions["idempotency"].store.table
    stored: list[int] = []
    signals.response_stored.connect(
        lambda sender, **extra: stored.append(extra["status"]), app, weak=False
    )
    monkeypatch.setattr(heartbeat.Renewer, "_start_settler", lambda self: None)

    @app.post("/pay")
    @idempotent
    def pay():
        cut_store.proxy.cut()
        return jsonify(ok=True), 201

    assert app.test_client().post("/pay", json={}, headers=KEY).status_code == 201
    cut_store.proxy.restore()
    assert deferred.flush(timeout=10) == 0
    assert stored == [201]
    assert cut_store.states() == [COMPLETED]
