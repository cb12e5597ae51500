"""A kept write recognises, on every try, that an earlier try of its own landed (C58).

CONTRACT C58, C55, C14, C20.

A kept completion or release (C55) follows a try whose reply never came: cut by the
statement deadline while the statement still waited on the server, or lost with the
connection. That try may commit afterwards. The kept try's fenced write then matches
nothing, and before C58 it read that as a lost lease: a false ``lease_lost`` signal and
log line, no promotion to Redis, no wake-up (for a release: no ``claim_released``, no
"released" wake-up).

The matrix, as a table (write x fault x database -> outcome):

=========  ============================  =========================  =====================
write      fault                         database                   outcome
=========  ============================  =========================  =====================
complete   earlier try landed, no reply  psycopg2, psycopg 3,       kept try: its expiry
                                         MariaDB, SQLite            (not ``None``)
release    earlier try landed, no reply  same                       kept try: ``True``
complete   another owner's record        same                       ``None`` (fenced)
complete   committed after the deadline  psycopg2, psycopg 3        ``landed``, promoted,
           (lock past the deadline,                                 no ``lease_lost``
           network silent at the cut)
release    committed after the deadline  psycopg2, psycopg 3        ``landed``,
           (same)                                                   ``claim_released``, no
                                                                    ``lease_lost``
=========  ============================  =========================  =====================

psycopg 3 sends its statements with the extended protocol: a statement cut off this way
never commits afterwards, so its end-to-end cells pass without the fix too; the store
cells show its kept tries recognise a landing all the same.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import jsonify

from flask_idempotency import idempotent, signals
from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import COMPLETED, Claim, Identity, StoredResponse
from tests.fault_matrix.test_cut_statements import (
    Cell,
    TableLock,
    _waiting_on,
    proxied_cell,  # noqa: F401  (the fixture)
)
from tests.support.waiting import wait_until
from tests.test_lifecycle import KEY, rows
from tests.test_pg_rules import record_signal

DATABASES = ["psycopg2", "psycopg3", "mariadb", "sqlite"]


@pytest.fixture(params=DATABASES)
def store(request: Any, make_app: Any) -> Iterator[Any]:
    """The store of an app on one database and driver, on a table of its own."""
    name: str = request.param
    config: dict[str, Any] = {"IDEMPOTENCY_TABLE": f"idem_{uuid.uuid4().hex[:12]}"}
    if name == "mariadb":
        url = request.getfixturevalue("mysql_url")
    elif name.startswith("psycopg"):
        from tests.conftest import driver_url

        driver = "psycopg" if name == "psycopg3" else "psycopg2"
        url = driver_url(request.getfixturevalue("pg_database"), driver)
    else:
        url = None
    if url is not None:
        config["IDEMPOTENCY_DATABASE_URI"] = url.render_as_string(hide_password=False)
    app, _ = make_app(config)
    store = app.extensions["idempotency"].store
    yield store
    if url is not None:
        for t in (store.table, store.identity_table):
            t.drop(store.engine, checkfirst=True)


def _claim(store: Any) -> tuple[Identity, Claim]:
    me = Identity("anonymous", key_digest("anonymous", uuid.uuid4().hex), "f" * 64, "POST", "/p")
    claim = store.acquire(me, ttl=3600, lease=60)
    assert isinstance(claim, Claim), claim
    return me, claim


ANSWER = StoredResponse(201, (("Content-Type", "application/json"),), b'{"n": 1}')


@pytest.mark.postgres
def test_c58_a_kept_completion_recognises_its_own_earlier_landing(store: Any) -> None:
    """C58: the earlier try landed and its reply was lost; the kept try's first attempt
    (not only a call's second) finds the record this claim completed: its expiry."""
    _, claim = _claim(store)
    landed = store.complete(claim, ANSWER)
    assert landed is not None
    assert store.complete(claim, ANSWER, kept=True) == landed


@pytest.mark.postgres
def test_c58_a_kept_release_recognises_its_own_earlier_landing(store: Any) -> None:
    """C58: the earlier try deleted the record; the kept try counts it as released."""
    _, claim = _claim(store)
    assert store.release(claim) is True
    assert store.release(claim, kept=True) is True


@pytest.mark.postgres
def test_c58_a_kept_completion_is_fenced_by_another_owners_record(store: Any) -> None:
    """C58/C14: a record another owner completed under its token stands: ``None``."""
    me, claim = _claim(store)
    assert store.complete(claim, ANSWER) is not None  # the owner's record stands
    stranger = dataclasses.replace(claim, lock_token=uuid.uuid4().hex)
    assert store.complete(stranger, ANSWER, kept=True) is None
    record = store.get(me.key_digest)
    assert record is not None and record.state == COMPLETED


# -- end to end: a completion that commits after its deadline (PostgreSQL) -------------


def _settled_late(
    cell: Cell, proxy: Any, status: int, signal: Any
) -> tuple[Any, list[int], list[str], list[Any], list[Any]]:
    """The view answers ``status`` with its claim in; its settlement (a completion, or a
    release for a 503) waits on a table lock; the network goes silent (not even the
    cancel arrives), so the client gets its answer and the settlement is kept. The lock
    goes and the queued settlement commits on the server (psycopg2); the network comes
    back and the kept try settles. Returns the app, the view's runs, the outcomes of
    ``settlement_deferred``, and what ``lease_lost`` and ``signal`` sent."""
    app = cell.make({"IDEMPOTENCY_WAIT": 0.3, "IDEMPOTENCY_LEASE": 20})
    store = app.extensions["idempotency"].store
    calls: list[int] = []
    lock = TableLock(cell, store.table.name)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        lock.start()  # the claim is in; the settlement will wait on the lock
        assert lock.locked.wait(10) and lock.error is None, lock.error
        return jsonify(n=len(calls)), status

    deferrals = record_signal(app, signals.settlement_deferred)
    lost = record_signal(app, signals.lease_lost)
    seen = record_signal(app, signal)
    answers: list[Any] = []
    request = threading.Thread(
        target=lambda: answers.append(app.test_client().post("/pay", json={"a": 1}, headers=KEY))
    )
    request.start()
    wait_until(lambda: _waiting_on(cell.direct, store.table.name), "the settlement queued")
    proxy.stall()  # the settlement and its cancel get no reply
    request.join(30)
    assert answers and answers[0].status_code == status, answers
    lock.release.set()  # the queued settlement commits now
    lock.join(10)
    proxy.restore()
    wait_until(
        lambda: any(d["outcome"] in ("landed", "fenced") for d in deferrals),
        "the kept settlement settled",
        within=20,
    )
    return app, calls, [d["outcome"] for d in deferrals], lost, seen


@pytest.mark.postgres
def test_c58_a_completion_committed_after_its_deadline_is_landed_not_lease_lost(
    proxied_cell: tuple[Cell, Any],  # noqa: F811
) -> None:
    """C58: the view ran and its completion waits on a table lock; the network goes
    silent (not even the cancel arrives), the client gets its 201 and the completion is
    kept. The lock goes and the queued completion commits on the server; the network
    comes back and the kept try finds the record completed under its own token:
    ``settlement_deferred`` says ``landed``, no ``lease_lost``, the answer is stored
    and replayed, the view ran once."""
    app, calls, outcomes, lost, stored = _settled_late(*proxied_cell, 201, signals.response_stored)
    assert "landed" in outcomes and "fenced" not in outcomes, outcomes
    assert lost == [], lost
    assert [s["status"] for s in stored] == [201]
    assert [r["state"] for r in rows(app)] == [COMPLETED]
    replay = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert replay.status_code == 201 and replay.get_json() == {"n": 1}
    assert calls == [1]


@pytest.mark.postgres
def test_c58_a_release_committed_after_its_deadline_is_released_not_lease_lost(
    proxied_cell: tuple[Cell, Any],  # noqa: F811
) -> None:
    """C58/C20: the view answers 503 (its claim is given back); the release waits on a
    table lock, the network goes silent, the release is kept, and commits on the server
    once the lock goes. The kept try finds the record gone: ``landed``,
    ``claim_released`` (with the "released" wake-up), no ``lease_lost``."""
    app, calls, outcomes, lost, released = _settled_late(*proxied_cell, 503, signals.claim_released)
    assert "landed" in outcomes and "fenced" not in outcomes, outcomes
    assert lost == [], lost
    assert [r["reason"] for r in released] == ["server-error"]
    assert rows(app) == []
    assert calls == [1]
