"""Transactional mode (C40): the view's writes and the record's completion are one transaction.

The payments app (tests/apps/atomicapp.py) writes one business row per execution
into a table whose key column is deliberately not unique, so every duplicate
execution that committed is a row to count. The SIGKILL proofs run it under
gunicorn and kill its workers hundreds of times at chosen points of the view
(tests/support/kill_campaign.py); the in-process proofs hold a request at a
phase with an event, so their order never depends on timing.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import jsonify, request
from sqlalchemy import event, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import OperationalError

from flask_idempotency import idempotent, release_claim, signals
from flask_idempotency.completion import heartbeat
from flask_idempotency.completion.unit import ViewCommitted
from flask_idempotency.fingerprint import key_digest
from tests.apps.atomicapp import AtomicApp, build_app
from tests.support.kill_campaign import (
    AtomicHarness,
    CampaignResult,
    KillCampaign,
    audit,
    body_for,
    make_schedule,
    settle_all,
)
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

KEYS = 72  # four kill plans each: at most 288 kills, at least 200 expected to land
LEASE = 2.0
SEED = 40


@pytest.fixture
def harness(request: pytest.FixtureRequest, pg_url: URL, pg_table: str) -> Iterator[AtomicHarness]:
    if request.node.get_closest_marker("heavy"):  # a SIGKILL campaign: on the load server
        pg_url = request.getfixturevalue("load_pg_url")
    h = AtomicHarness(pg_url, pg_table)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def make_payments_app(harness: AtomicHarness) -> Iterator[Callable[..., AtomicApp]]:
    """In-process payments apps on the harness's tables (``TESTING`` unless told otherwise)."""
    built: list[AtomicApp] = []

    def factory(**options: Any) -> AtomicApp:
        config = {"TESTING": True, **options.pop("config", {})}
        handles = build_app(harness.url, harness.table, config=config, **options)
        built.append(handles)
        return handles

    yield factory
    for handles in built:
        handles.dispose()


def kill_and_settle(harness: AtomicHarness, *, atomic: bool) -> tuple[CampaignResult, list[str]]:
    """Run the shared kill schedule against a server in one mode, then settle every key with 201."""
    server = harness.server(atomic=atomic, lease=LEASE)
    keys = [f"c40-{'atomic' if atomic else 'plain'}-{i}" for i in range(KEYS)]
    bodies = {key: body_for(key, i) for i, key in enumerate(keys)}
    schedule = make_schedule(keys, SEED)
    result = KillCampaign(harness, server, schedule, bodies, lease=LEASE).run()
    server.wait_for_workers()

    assert len(result.kills) >= 200, f"only {len(result.kills)} kills landed"
    # The kills landed before the write, while it was pending, and after the view's work.
    for phase in ("started", "written", "finishing"):
        assert result.phases[phase] >= 1, result.phases

    answers = settle_all(server.url, bodies)
    statuses = collections.Counter(r.status_code for r in answers.values())
    assert statuses == {201: len(keys)}, statuses
    for key, answer in answers.items():
        record = harness.record(key)
        assert record is not None and record.state == "completed" and record.response is not None
        assert answer.content == record.response.body  # the client sees what was stored
    return result, keys


# -- SIGKILL at random points ------------------------------------------------------------


@pytest.mark.chaos
@pytest.mark.heavy
def test_c40_sigkill_at_random_points_leaves_exactly_one_row_per_key(
    harness: AtomicHarness, record_property: Callable[[str, Any], None]
) -> None:
    """C40: hundreds of SIGKILLs across the view and its commit; every key ends with one row.

    A killed worker's open transaction dies with its connection, taking the
    payment and the completion with it; the next request takes the lapsed lease
    over and runs the view again. Exactly one execution per key commits, and
    the stored response names the payment that exists.
    """
    started = time.monotonic()
    result, keys = kill_and_settle(harness, atomic=True)
    found = audit(harness, keys)

    for index, key in enumerate(keys):
        rows = found.rows_by_key.get(key, [])
        assert len(rows) == 1, f"{key} has {len(rows)} payment rows"
        stored = found.stored[key]
        assert stored is not None
        assert stored["payment_id"] == rows[0].id
        assert stored["amount"] == rows[0].amount == body_for(key, index)["amount"]
    assert set(found.rows_by_key) == set(keys)
    executions = harness.attempt_count()
    assert executions > len(keys)  # views did run and die: their writes are not in the table

    summary = {
        "keys": len(keys),
        "kills": len(result.kills),
        "phases": dict(result.phases),
        "view_executions": executions,
        "keys_with_duplicates": len(found.keys_with_duplicates),
        "total_rows": found.total_rows,
        "seconds": round(time.monotonic() - started, 1),
    }
    record_property("c40_atomic", summary)
    print("C40 atomic:", json.dumps(summary))


@pytest.mark.chaos
@pytest.mark.heavy
def test_c40_without_atomic_mode_the_same_kills_leave_duplicates(
    harness: AtomicHarness, record_property: Callable[[str, Any], None]
) -> None:
    """The control: the same kills against a view that commits its own writes.

    A kill after the view's commit and before the record completes leaves a
    payment and a lapsing claim; the retry pays again. How many keys that hits
    depends on where the kills land, so it is recorded, not asserted. What
    still holds: every key completes, has at least one row, and its stored
    response names one of its rows.
    """
    started = time.monotonic()
    result, keys = kill_and_settle(harness, atomic=False)
    found = audit(harness, keys)

    for index, key in enumerate(keys):
        rows = found.rows_by_key.get(key, [])
        assert len(rows) >= 1
        stored = found.stored[key]
        assert stored is not None
        assert stored["payment_id"] in {row.id for row in rows}
        assert stored["amount"] == body_for(key, index)["amount"]

    summary = {
        "keys": len(keys),
        "kills": len(result.kills),
        "phases": dict(result.phases),
        "view_executions": harness.attempt_count(),
        "keys_with_duplicates": len(found.keys_with_duplicates),
        "total_rows": found.total_rows,
        "seconds": round(time.monotonic() - started, 1),
    }
    record_property("c40_plain", summary)
    print("C40 without atomic mode:", json.dumps(summary))


# -- a lost lease -----------------------------------------------------------------------------


def test_c40_lost_lease_rolls_back_the_late_owners_writes(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp]
) -> None:
    """C40/X8: the original outlives its lease, a retry takes over and completes.

    The original's fenced completion then matches no row: its payment is rolled
    back and its client gets 409 problem+json; the taker's payment is the only
    row, and later retries replay the taker's response.
    """
    # The heartbeat is off: the original models an owner that overruns its lease (C44).
    payments = make_payments_app(lease=1.0, wait=0.0, config={"IDEMPOTENCY_HEARTBEAT": False})
    key, body = "c40-lost-lease", {"amount": 700}
    holding, release_original = threading.Event(), threading.Event()
    lost: list[dict[str, Any]] = []

    def hold_the_original(held_key: str, phase: str) -> None:
        if held_key == key and phase == "written" and not holding.is_set():
            holding.set()  # the original's payment is flushed, not committed
            assert release_original.wait(60)

    payments.on_phase = hold_the_original
    signals.lease_lost.connect(lambda sender, **extra: lost.append(extra), payments.app, weak=False)
    original: dict[str, Any] = {}

    def send_original() -> None:
        response = payments.app.test_client().post(
            "/payments", json=body, headers={"Idempotency-Key": key}
        )
        original["response"] = response

    thread = threading.Thread(target=send_original)
    thread.start()
    try:
        assert holding.wait(30)
        wait_until(lambda: not harness.record(key).lease_live, "the original's lease to lapse")  # type: ignore[union-attr]
        taker = payments.app.test_client().post(
            "/payments", json=body, headers={"Idempotency-Key": key}
        )
    finally:
        release_original.set()
        thread.join(timeout=60)

    assert taker.status_code == 201 and "Idempotent-Replayed" not in taker.headers
    late = original["response"]
    assert late.status_code == 409
    assert late.headers["Content-Type"] == "application/problem+json"
    assert late.get_json()["code"] == "request-in-progress"
    assert [extra["action"] for extra in lost] == ["complete"]

    rows = harness.payments_by_key()[key]
    assert [row.id for row in rows] == [taker.get_json()["payment_id"]]
    assert harness.attempt_count() == 2  # both ran; only the taker's write survived
    for _ in range(2):
        again = payments.app.test_client().post(
            "/payments", json=body, headers={"Idempotency-Key": key}
        )
        assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
        assert again.data == taker.data


#: How long a duplicate may take to answer while the owner sits inside its commit. It needs
#: at most a few lock timeouts (500 ms each); the owner is held until it answers, or this long.
DUPLICATE_ANSWER_WITHIN = 12.0


@pytest.mark.parametrize("lease_state", ["live", "lapsed"])
def test_c40_duplicate_does_not_queue_behind_an_owner_inside_its_commit(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp], lease_state: str
) -> None:
    """C40/X8 with C11: after the owner's completion UPDATE the record's row is locked until
    its commit. A duplicate (wait=0) that arrives then must answer 409 at once, not queue in
    the database behind that commit (which an app's before_commit hook, a slow flush or a
    synchronous replica can stretch), and must not run the view again; the owner's commit
    then stands and replays.

    Held in before_commit (the only commit of an atomic request is the extension's) until the
    duplicate has answered, or DUPLICATE_ANSWER_WITHIN at most.
    """
    lease = 60.0 if lease_state == "live" else 1.0
    payments = make_payments_app(lease=lease, wait=0.0)
    key, body = f"c40-commit-lock-{lease_state}", {"amount": 800}
    in_commit, finish_commit, duplicate_answered = (
        threading.Event(),
        threading.Event(),
        threading.Event(),
    )

    def hold_the_commit(session: Any) -> None:
        if not in_commit.is_set():
            in_commit.set()
            finish_commit.wait(DUPLICATE_ANSWER_WITHIN + 30)

    event.listen(payments.db.session, "before_commit", hold_the_commit)
    answers: dict[str, Any] = {}

    def send(name: str, done: threading.Event | None = None) -> None:
        client = payments.app.test_client()
        answers[name] = client.post("/payments", json=body, headers={"Idempotency-Key": key})
        if done is not None:
            done.set()

    owner_thread = threading.Thread(target=send, args=("owner",))
    owner_thread.start()
    duplicate_thread = threading.Thread(target=send, args=("duplicate", duplicate_answered))
    try:
        assert in_commit.wait(30)
        if lease_state == "lapsed":
            wait_until(lambda: not harness.record(key).lease_live, "the owner's lease to lapse")  # type: ignore[union-attr]
        duplicate_thread.start()
        answered_during_commit = duplicate_answered.wait(DUPLICATE_ANSWER_WITHIN)
    finally:
        finish_commit.set()
        owner_thread.join(timeout=60)
        if duplicate_thread.ident is not None:  # it was started
            duplicate_thread.join(timeout=60)

    owner = answers["owner"]
    assert owner.status_code == 201
    assert answered_during_commit, "the duplicate queued behind the owner's commit"
    assert answers["duplicate"].status_code == 409
    assert answers["duplicate"].get_json()["code"] == "request-in-progress"
    assert harness.attempt_count() == 1  # the view did not run a second time
    assert [row.id for row in harness.payments_by_key()[key]] == [owner.get_json()["payment_id"]]
    replay = payments.app.test_client().post(
        "/payments", json=body, headers={"Idempotency-Key": key}
    )
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == owner.data


@pytest.mark.parametrize("autoflush", [True, False], ids=["autoflush", "no-autoflush"])
def test_c40_record_row_is_not_locked_while_the_views_writes_wait_to_flush(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp], autoflush: bool
) -> None:
    """C40 with C11: the completion UPDATE locks the record's row until the commit, so it
    must come after the view's pending writes are flushed, also in apps that turn the
    session's autoflush off. A flush that waits (here on a table lock another transaction
    holds) must not keep the record locked meanwhile, or every duplicate of the key waits
    with it."""
    payments = make_payments_app(session_options={"autoflush": autoflush})
    db, payment_model = payments.db, payments.payment_model
    key = f"c40-slow-flush-{autoflush}"

    @payments.app.post("/unflushed")
    @idempotent(atomic=True)
    def unflushed():  # type: ignore[no-untyped-def]
        db.session.add(payment_model(idem_key=key, amount=3, pid=0))  # flushed at the end
        return jsonify(ok=True), 201

    answers: dict[str, Any] = {}
    with harness.engine.connect() as blocker:
        blocker.execute(text(f'LOCK TABLE "{harness.payments.name}" IN SHARE MODE'))
        thread = threading.Thread(
            target=lambda: answers.update(
                response=payments.app.test_client().post(
                    "/unflushed", json={}, headers={"Idempotency-Key": key}
                )
            )
        )
        thread.start()
        try:
            wait_until(
                lambda: _waiting_insert(harness), "the view's INSERT to wait for the table lock"
            )
            with harness.engine.connect() as probe:
                locked = probe.execute(
                    text(
                        f'SELECT state FROM "{harness.table}" WHERE key_digest = :digest'
                        " FOR UPDATE SKIP LOCKED"
                    ),
                    {"digest": key_digest("anonymous", key)},
                ).all()
                probe.rollback()
        finally:
            blocker.rollback()  # the flush goes ahead
            thread.join(timeout=60)
    assert answers["response"].status_code == 201
    assert locked == [("in_progress",)], "the record's row was locked while the flush waited"


def _waiting_insert(harness: AtomicHarness) -> bool:
    with harness.engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE :insert"
                ),
                {"insert": f"INSERT INTO {harness.payments.name}%"},
            ).scalar_one()
        )


# -- exits that store nothing ---------------------------------------------------------------


def add_failing_views(payments: AtomicApp) -> None:
    """Views that write a payment and then fail in one of three ways, unless ``X-Succeed``."""
    app, db, payment_model = payments.app, payments.db, payments.payment_model

    def write(key: str) -> Any:
        payment = payment_model(idem_key=key, amount=int(request.json["amount"]), pid=0)
        db.session.add(payment)
        db.session.flush()
        payments.start_attempt(key)
        return payment

    def succeeded(payment: Any) -> Any:
        return jsonify(payment_id=payment.id), 201

    @app.post("/raises")
    @idempotent(atomic=True)
    def raises():  # type: ignore[no-untyped-def]
        payment = write(request.headers["Idempotency-Key"])
        if request.headers.get("X-Succeed"):
            return succeeded(payment)
        raise RuntimeError("the gateway rejected the payment after the row was written")

    @app.post("/fails")
    @idempotent(atomic=True)
    def fails():  # type: ignore[no-untyped-def]
        payment = write(request.headers["Idempotency-Key"])
        if request.headers.get("X-Succeed"):
            return succeeded(payment)
        return jsonify(error="downstream unavailable"), 500

    @app.post("/declines")
    @idempotent(atomic=True)
    def declines():  # type: ignore[no-untyped-def]
        payment = write(request.headers["Idempotency-Key"])
        if request.headers.get("X-Succeed"):
            return succeeded(payment)
        assert release_claim()
        return jsonify(error="card declined, fix it and retry"), 422


@pytest.mark.parametrize("route", ["/raises", "/fails", "/declines"])
def test_c40_exception_and_release_roll_back(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp], route: str
) -> None:
    """C40 with C17/C19: an exception, a 500 or release_claim() keeps neither the row nor
    the record.

    The key is free again: a retry runs the view, and when it succeeds its row
    and its record are committed together.
    """
    payments = make_payments_app()
    add_failing_views(payments)
    client = payments.app.test_client()
    key, body = f"c40-exit{route.replace('/', '-')}", {"amount": 31}

    if route == "/raises":
        with pytest.raises(RuntimeError, match="gateway rejected"):
            client.post(route, json=body, headers={"Idempotency-Key": key})
    else:
        failed = client.post(route, json=body, headers={"Idempotency-Key": key})
        assert failed.status_code == {"/fails": 500, "/declines": 422}[route]
    assert harness.payments_by_key().get(key, []) == []
    assert harness.record(key) is None
    assert harness.attempt_count() == 1

    retried = client.post(route, json=body, headers={"Idempotency-Key": key, "X-Succeed": "1"})
    assert retried.status_code == 201 and "Idempotent-Replayed" not in retried.headers
    assert harness.attempt_count() == 2  # the view ran again
    rows = harness.payments_by_key()[key]
    assert [row.id for row in rows] == [retried.get_json()["payment_id"]]
    record = harness.record(key)
    assert record is not None and record.state == "completed"


def test_c40_unflushed_writes_commit_with_the_record(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp]
) -> None:
    """C40: a view that only adds (never flushes) still has its row committed with the record."""
    payments = make_payments_app()
    db, payment_model = payments.db, payments.payment_model

    @payments.app.post("/lazy")
    @idempotent(atomic=True)
    def lazy():  # type: ignore[no-untyped-def]
        db.session.add(payment_model(idem_key="c40-lazy", amount=5, pid=0))
        return jsonify(ok=True), 201

    response = payments.app.test_client().post(
        "/lazy", json={}, headers={"Idempotency-Key": "c40-lazy"}
    )
    assert response.status_code == 201
    assert len(harness.payments_by_key()["c40-lazy"]) == 1
    record = harness.record("c40-lazy")
    assert record is not None and record.state == "completed"


def test_c40_c44_a_settled_transactional_owner_leaves_no_lease_behind(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp]
) -> None:
    """C44: the heartbeat stops renewing an atomic owner once it answered, stored or
    released, as for any owner (the renewer would otherwise keep it until max runtime)."""
    payments = make_payments_app()
    db, payment_model = payments.db, payments.payment_model

    @payments.app.post("/kept")
    @idempotent(atomic=True)
    def kept():  # type: ignore[no-untyped-def]
        db.session.add(payment_model(idem_key="c44-kept", amount=5, pid=0))
        return jsonify(ok=True), 201

    @payments.app.post("/released")
    @idempotent(atomic=True)
    def released():  # type: ignore[no-untyped-def]
        release_claim()
        return jsonify(ok=False), 400

    client = payments.app.test_client()
    leases = heartbeat.renewer().registered()
    assert client.post("/kept", json={}, headers={"Idempotency-Key": "c44-kept"}).status_code == 201
    assert (
        client.post("/released", json={}, headers={"Idempotency-Key": "c44-rel"}).status_code == 400
    )
    assert heartbeat.renewer().registered() == leases


def test_c40_constraint_failure_at_the_final_flush_is_the_views_error(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp]
) -> None:
    """C40 with C17: the view's pending write breaks a NOT NULL constraint only when the
    extension flushes it. That is the view's own error: nothing survives, the claim is
    released and the client gets a plain 500, so a corrected retry can run (a 503 would
    send it back to the same failure forever)."""
    payments = make_payments_app(config={"TESTING": False})
    db, payment_model = payments.db, payments.payment_model

    @payments.app.post("/broken")
    @idempotent(atomic=True)
    def broken():  # type: ignore[no-untyped-def]
        amount = request.json.get("amount")
        db.session.add(payment_model(idem_key="c40-broken", amount=amount, pid=0))
        return jsonify(ok=True), 201

    client = payments.app.test_client()
    failed = client.post(
        "/broken", json={"amount": None}, headers={"Idempotency-Key": "c40-broken"}
    )
    assert failed.status_code == 500
    assert harness.payments_by_key().get("c40-broken", []) == []
    assert harness.record("c40-broken") is None  # released: the key is free


def test_c40_failed_commit_keeps_nothing_and_answers_503(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp]
) -> None:
    """C40: when the one commit fails in the database (the connection drops inside it),
    neither the row nor the completion survives, the claim is released and the client gets
    503 problem+json with Retry-After; the key is free for a retry."""
    payments = make_payments_app()
    db, payment_model = payments.db, payments.payment_model
    drop_connection = threading.Event()

    def lose_the_connection(session: Any) -> None:
        if drop_connection.is_set():
            drop_connection.clear()
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection"))

    event.listen(db.session, "before_commit", lose_the_connection)

    @payments.app.post("/flaky")
    @idempotent(atomic=True)
    def flaky():  # type: ignore[no-untyped-def]
        db.session.add(payment_model(idem_key="c40-flaky", amount=5, pid=0))
        return jsonify(ok=True), 201

    client = payments.app.test_client()
    drop_connection.set()
    failed = client.post("/flaky", json={}, headers={"Idempotency-Key": "c40-flaky"})
    assert failed.status_code == 503
    assert failed.headers["Content-Type"] == "application/problem+json"
    assert failed.get_json()["code"] == "store-unavailable"
    assert int(failed.headers["Retry-After"]) >= 1
    assert harness.payments_by_key().get("c40-flaky", []) == []
    assert harness.record("c40-flaky") is None
    retry = client.post("/flaky", json={}, headers={"Idempotency-Key": "c40-flaky"})
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry.headers
    assert len(harness.payments_by_key()["c40-flaky"]) == 1


# -- a view that commits by itself -----------------------------------------------------------


def add_committing_view(payments: AtomicApp) -> None:
    db, payment_model = payments.db, payments.payment_model

    @payments.app.post("/commits")
    @idempotent(atomic=True)
    def commits():  # type: ignore[no-untyped-def]
        payments.start_attempt("c40-commits")
        payment = payment_model(idem_key="c40-commits", amount=9, pid=0)
        db.session.add(payment)
        db.session.flush()
        db.session.commit()  # wrong in atomic mode: the extension owns the commit
        return jsonify(payment_id=payment.id), 201


def test_c40_view_commit_is_refused_in_testing(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp]
) -> None:
    """C40: under TESTING (or DEBUG) db.session.commit() in an atomic view raises ViewCommitted.

    The commit never happens: the exception leaves the view, the flushed row is
    rolled back, the claim is released (C17), so nothing is stored and a retry
    runs the view again, and fails the same way until the view is fixed.
    """
    payments = make_payments_app()
    add_committing_view(payments)
    client = payments.app.test_client()
    for attempt in (1, 2):
        with pytest.raises(ViewCommitted, match="flush instead of committing"):
            client.post("/commits", json={}, headers={"Idempotency-Key": "c40-commits"})
        assert harness.payments_by_key().get("c40-commits", []) == []
        assert harness.record("c40-commits") is None
        assert harness.attempt_count() == attempt


def test_c40_view_commit_in_production_warns_and_loses_the_guarantee(
    harness: AtomicHarness,
    make_payments_app: Callable[..., AtomicApp],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """C40, documented limit: outside TESTING/DEBUG the view's own commit goes ahead with a warning.

    The row is committed by the view, the record by the extension afterwards in
    a transaction of its own: the request still succeeds and replays, but a
    crash between the two commits could now duplicate the payment.
    """
    payments = make_payments_app(config={"TESTING": False, "DEBUG": False})
    add_committing_view(payments)
    client = payments.app.test_client()
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        first = client.post("/commits", json={}, headers={"Idempotency-Key": "c40-commits"})
    assert first.status_code == 201
    assert any("called db.session.commit()" in r.getMessage() for r in caplog.records)
    rows = harness.payments_by_key()["c40-commits"]
    assert [row.id for row in rows] == [first.get_json()["payment_id"]]
    replay = client.post("/commits", json={}, headers={"Idempotency-Key": "c40-commits"})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == first.data
