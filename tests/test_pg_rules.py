"""Rules that need the real PostgreSQL: concurrency, leases, fencing, wake-ups.

CONTRACT C7, C13, C14, C20, C21.

Each test has a private table in this session's private database, on PostgreSQL and on
MariaDB in turn (``make_server_app``).
Originals are parked on Events and the tests learn that duplicates are parked
from the wake-up hub; expiry is awaited by polling the database clock.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from flask import Flask, jsonify, request

from flask_idempotency import idempotent, signals
from flask_idempotency.fingerprint import key_digest, request_fingerprint
from flask_idempotency.notify import hub as wakeup
from flask_idempotency.records import Claim, Identity, StoredResponse
from flask_idempotency.store.connect import create_store_engine

from .test_lifecycle import (
    KEY,
    PARK_LIMIT,
    REPLAYED,
    Background,
    assert_problem,
    parked,
    rows,
    states,
    wait_for_db_clock,
    wait_until,
)

pytestmark = pytest.mark.postgres


def identity_of(app: Flask, path: str, body: Any, key: str = "key-1") -> Identity:
    """The identity the layer computes for an anonymous POST of ``body`` to ``path``."""
    with app.test_request_context(path, method="POST", json=body, headers={"Idempotency-Key": key}):
        return Identity(
            "anonymous", key_digest("anonymous", key), request_fingerprint(request), "POST", path
        )


def record_signal(app: Flask, signal: Any) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    signal.connect(lambda sender, **extra: seen.append(extra), app, weak=False)
    return seen


class NoPolling:
    """A poll schedule that never ticks within a test: only a wake-up can end a wait."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def next(self) -> float:
        return 3600.0


def parking_view(app: Flask, calls: list[str], *, first_status: int = 201, **options: Any):
    """A view whose first call parks until ``release`` is set; later calls answer at once."""
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()

    @app.post("/pay")
    @idempotent(**options)
    def pay():
        with lock:
            calls.append("pay")
            n = len(calls)
        if n == 1:
            entered.set()
            assert release.wait(PARK_LIMIT)
            return jsonify(n=n), first_status
        return jsonify(n=n), 201

    return entered, release


def test_c7_pg_mismatch_while_in_flight_is_422_at_once(make_server_app) -> None:
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[str] = []
    entered, release = parking_view(app, calls)
    original = Background(app, "/pay", json={"amount": 1}, headers=KEY)
    try:
        assert entered.wait(PARK_LIMIT)
        mismatch = app.test_client().post("/pay", json={"amount": 2}, headers=KEY)
        # Answered while the original is still parked: it did not wait for it.
        assert states(app) == ["in_progress"]
        assert_problem(mismatch, 422, "key-reused")
        assert parked(app) == 0
    finally:
        release.set()
    assert original.result().status_code == 201
    assert calls == ["pay"]
    retry = app.test_client().post("/pay", json={"amount": 1}, headers=KEY)
    assert retry.headers.get(REPLAYED) == "true"


def test_c21_pg_short_ttl(make_server_app) -> None:
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[Any] = []

    @app.post("/short")
    @idempotent(ttl=1, lease=0.5)
    def short():
        calls.append(request.json)
        return jsonify(n=len(calls)), 201

    client = app.test_client()
    first = client.post("/short", json={"a": 1}, headers=KEY)
    assert first.status_code == 201
    (row,) = rows(app)
    # No replay or 422 check here: on a loaded machine a second may already have passed.
    wait_for_db_clock(app, row["expires_at_ms"])
    again = client.post("/short", json={"a": 1}, headers=KEY)
    assert again.status_code == 201 and REPLAYED not in again.headers
    wait_for_db_clock(app, rows(app)[0]["expires_at_ms"])
    other = client.post("/short", json={"a": 2}, headers=KEY)
    assert other.status_code == 201, "after expiry a different body runs as new, no 422"
    assert calls == [{"a": 1}, {"a": 1}, {"a": 2}]
    assert len(rows(app)) == 1


def test_c21_pg_replay_does_not_extend_life(make_server_app) -> None:
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": 0})

    @app.post("/pay")
    @idempotent(ttl=3600)
    def pay():
        return "paid", 201

    client = app.test_client()
    client.post("/pay", headers=KEY)
    (before,) = rows(app)
    for _ in range(3):
        assert client.post("/pay", headers=KEY).headers.get(REPLAYED) == "true"
    assert_problem(client.post("/pay", json={"x": 1}, headers=KEY), 422, "key-reused")
    (after,) = rows(app)
    assert after["expires_at_ms"] == before["expires_at_ms"]
    assert after["created_at_ms"] == before["created_at_ms"]


def test_c21_pg_in_progress_with_live_lease_is_never_expired(make_server_app) -> None:
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return "paid"

    store = app.extensions["idempotency"].store
    claim = store.acquire(identity_of(app, "/pay", {"a": 1}), ttl=0.05, lease=60)
    assert isinstance(claim, Claim)
    wait_for_db_clock(app, claim.expires_at_ms)
    assert_problem(
        app.test_client().post("/pay", json={"a": 1}, headers=KEY), 409, "request-in-progress"
    )
    assert_problem(app.test_client().post("/pay", json={"a": 2}, headers=KEY), 422, "key-reused")
    assert calls == []
    assert rows(app)[0]["lock_token"] == claim.lock_token


def test_c13_pg_one_of_many_racing_threads_takes_over_a_lapsed_lease(make_server_app) -> None:
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[str] = []
    lock = threading.Lock()
    takeovers = record_signal(app, signals.lease_taken_over)

    @app.post("/pay")
    @idempotent
    def pay():
        with lock:
            calls.append("pay")
        return jsonify(n=len(calls)), 201

    store = app.extensions["idempotency"].store
    crashed = store.acquire(identity_of(app, "/pay", {"a": 1}), ttl=3600, lease=0.05)
    assert isinstance(crashed, Claim)
    wait_for_db_clock(app, rows(app)[0]["lease_expires_at_ms"])

    racers = 20
    barrier = threading.Barrier(racers)
    responses: list[Any] = []
    errors: list[BaseException] = []

    def race() -> None:
        try:
            client = app.test_client()
            barrier.wait(PARK_LIMIT)
            responses.append(client.post("/pay", json={"a": 1}, headers=KEY))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race, daemon=True) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PARK_LIMIT * 2)
    assert not errors and len(responses) == racers
    assert calls == ["pay"], "exactly one racer executes"
    assert len(takeovers) == 1
    executed = [r for r in responses if REPLAYED not in r.headers]
    assert len(executed) == 1 and executed[0].status_code == 201
    assert all(r.status_code == 201 and r.data == executed[0].data for r in responses)
    assert states(app) == ["completed"]
    assert store.complete(crashed, store.get(rows(app)[0]["key_digest"]).response) is None


def test_c14_pg_slow_owner_cannot_overwrite_the_takers_record(make_server_app) -> None:
    app, _ = make_server_app(
        {"IDEMPOTENCY_WAIT": 0, "IDEMPOTENCY_HEARTBEAT": False}
    )  # overruns its lease
    calls: list[str] = []
    lost = record_signal(app, signals.lease_lost)
    entered, release = parking_view(app, calls, lease=0.5, ttl=3600)
    slow = Background(app, "/pay", json={"a": 1}, headers=KEY)
    try:
        assert entered.wait(PARK_LIMIT)
        (row,) = rows(app)
        wait_for_db_clock(app, row["lease_expires_at_ms"])
        taker = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
        assert taker.status_code == 201 and taker.json == {"n": 2}
        assert REPLAYED not in taker.headers
        assert states(app) == ["completed"]
    finally:
        release.set()
    own_answer = slow.result()
    assert own_answer.status_code == 201 and own_answer.json == {"n": 1}, (
        "its client gets its answer"
    )
    assert REPLAYED not in own_answer.headers
    assert [e["action"] for e in lost] == ["complete"]
    stored = rows(app)
    assert len(stored) == 1 and stored[0]["state"] == "completed"
    retry = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert retry.headers.get(REPLAYED) == "true"
    assert retry.json == {"n": 2}, "the taker's record stands"
    assert calls == ["pay", "pay"]


def test_c14_pg_slow_owner_cannot_release_the_takers_claim(make_server_app) -> None:
    """The slow owner fails (5xx) after losing its lease: its fenced release deletes nothing."""
    app, _ = make_server_app(
        {"IDEMPOTENCY_WAIT": 0, "IDEMPOTENCY_HEARTBEAT": False}
    )  # overruns its lease
    calls: list[str] = []
    lost = record_signal(app, signals.lease_lost)
    entered, release = parking_view(app, calls, first_status=503, lease=0.5, ttl=3600)
    slow = Background(app, "/pay", json={"a": 1}, headers=KEY)
    try:
        assert entered.wait(PARK_LIMIT)
        wait_for_db_clock(app, rows(app)[0]["lease_expires_at_ms"])
        assert app.test_client().post("/pay", json={"a": 1}, headers=KEY).status_code == 201
    finally:
        release.set()
    assert slow.result().status_code == 503
    assert [e["action"] for e in lost] == ["release"]
    assert states(app) == ["completed"]


def test_c20_pg_release_wakes_a_parked_waiter_which_claims(make_server_app, monkeypatch) -> None:
    """With polling switched off, only the release's wake-up can let the waiter claim."""
    monkeypatch.setattr(wakeup, "PollSchedule", NoPolling)
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[str] = []
    released = record_signal(app, signals.claim_released)
    entered, release = parking_view(app, calls, first_status=500)
    original = Background(app, "/pay", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    waiter = Background(app, "/pay", json={"a": 1}, headers=KEY)
    wait_until(lambda: parked(app) == 1, "the waiter to park")
    release.set()
    assert original.result().status_code == 500
    woken = waiter.result()
    assert woken.status_code == 201, woken.data
    assert REPLAYED not in woken.headers, "the waiter claimed the released key and ran the view"
    assert woken.json == {"n": 2}
    assert [e["reason"] for e in released] == ["server-error"]
    assert states(app) == ["completed"]


def test_c10_pg_completion_wakes_a_parked_waiter_which_replays(
    make_server_app, monkeypatch
) -> None:
    monkeypatch.setattr(wakeup, "PollSchedule", NoPolling)
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[str] = []
    entered, release = parking_view(app, calls)
    original = Background(app, "/pay", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    waiters = [Background(app, "/pay", json={"a": 1}, headers=KEY) for _ in range(3)]
    wait_until(lambda: parked(app) == 3, "three waiters to park")
    release.set()
    first = original.result()
    for waiter in waiters:
        response = waiter.result()
        assert response.status_code == 201
        assert response.headers.get(REPLAYED) == "true"
        assert response.data == first.data
    assert calls == ["pay"]


def test_c8_pg_parallel_first_requests_with_different_bodies(make_server_app) -> None:
    """R41: same key, pairwise different bodies: one executes, every other answer is 422."""
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[int] = []
    lock = threading.Lock()

    @app.post("/pay")
    @idempotent
    def pay():
        with lock:
            calls.append(request.json["i"])
        return jsonify(i=request.json["i"]), 201

    racers = 12
    barrier = threading.Barrier(racers)
    statuses: list[int] = []

    def race(i: int) -> None:
        client = app.test_client()
        barrier.wait(PARK_LIMIT)
        statuses.append(client.post("/pay", json={"i": i}, headers=KEY).status_code)

    threads = [threading.Thread(target=race, args=(i,), daemon=True) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PARK_LIMIT * 2)
    assert len(calls) == 1
    assert sorted(statuses) == [201] + [422] * (racers - 1)


HOSTILE_PATHS = [
    "/files/a%00b",  # NUL: PostgreSQL text cannot hold it
    "/files/%ff%fe",
    "/files/%ed%a0%80",  # an encoded surrogate
    "/files/%C0%80",  # overlong UTF-8 NUL
    "/files/" + "x" * 100_000,
]


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_pg_hostile_paths_never_500(make_server_app, path: str) -> None:
    """The request path is stored as an informational column; any path must be storable."""
    app, _ = make_server_app({"TESTING": False})
    calls: list[str] = []

    @app.post("/files/<path:name>")
    @idempotent
    def files(name: str):
        calls.append(name)
        return jsonify(length=len(name)), 201

    client = app.test_client()
    first = client.post(path, headers=KEY)
    again = client.post(path, headers=KEY)
    assert first.status_code == 201, first.data[:200]
    assert again.headers.get(REPLAYED) == "true"
    assert len(calls) == 1


def test_pg_scope_with_nul_never_500(make_server_app) -> None:
    app, ext = make_server_app({"TESTING": False})
    ext.scope_loader(lambda: request.headers.get("X-Tenant", "") + "\x00suffix")

    @app.post("/pay")
    @idempotent
    def pay():
        return "paid", 201

    client = app.test_client()
    assert client.post("/pay", headers={**KEY, "X-Tenant": "a"}).status_code == 201
    assert client.post("/pay", headers={**KEY, "X-Tenant": "a"}).headers.get(REPLAYED) == "true"
    assert client.post("/pay", headers={**KEY, "X-Tenant": "b"}).headers.get(REPLAYED) is None


def test_c12_pg_release_while_waiters_park_lets_exactly_one_rerun(make_server_app) -> None:
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[str] = []
    entered, release = parking_view(app, calls, first_status=500)
    original = Background(app, "/pay", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    waiters = [Background(app, "/pay", json={"a": 1}, headers=KEY) for _ in range(4)]
    wait_until(lambda: parked(app) == 4, "four duplicates to park")
    release.set()
    assert original.result().status_code == 500
    results = [w.result() for w in waiters]
    executed = [r for r in results if REPLAYED not in r.headers]
    assert len(calls) == 2
    assert len(executed) == 1 and executed[0].status_code == 201
    assert all(r.status_code == 201 and r.data == executed[0].data for r in results)
    assert states(app) == ["completed"]


def race(app: Flask, bodies: list[Any]) -> list[Any]:
    """POST each body at once from its own thread; return the responses."""
    barrier = threading.Barrier(len(bodies))
    responses: list[Any] = []
    errors: list[BaseException] = []

    def one(body: Any) -> None:
        try:
            client = app.test_client()
            barrier.wait(PARK_LIMIT)
            responses.append(client.post("/pay", json=body, headers=KEY))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(b,), daemon=True) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PARK_LIMIT * 2)
    assert not errors and len(responses) == len(bodies)
    return responses


def expired_record_app(make_server_app) -> tuple[Flask, list[Any]]:
    """An app whose key-1 record is completed and already expired."""
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[Any] = []
    lock = threading.Lock()

    @app.post("/pay")
    @idempotent
    def pay():
        with lock:
            calls.append(request.json)
        return jsonify(body=request.json), 201

    store = app.extensions["idempotency"].store
    old = store.acquire(identity_of(app, "/pay", {"old": True}), ttl=0.1, lease=0.05)
    assert isinstance(old, Claim)
    store.complete(old, StoredResponse(201, (), b'{"body":{"old":true}}'))
    wait_for_db_clock(app, old.expires_at_ms)
    return app, calls


def test_c21_pg_racers_replace_an_expired_record_once(make_server_app) -> None:
    app, calls = expired_record_app(make_server_app)
    responses = race(app, [{"new": 1}] * 15)
    assert calls == [{"new": 1}]
    assert all(r.status_code == 201 and r.json == {"body": {"new": 1}} for r in responses)
    assert sum(REPLAYED not in r.headers for r in responses) == 1
    assert states(app) == ["completed"]


def test_c21_pg_racers_with_different_bodies_after_expiry(make_server_app) -> None:
    app, calls = expired_record_app(make_server_app)
    responses = race(app, [{"new": i} for i in range(10)])
    assert len(calls) == 1
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201] + [422] * 9
    winner = next(r for r in responses if r.status_code == 201)
    assert winner.json == {"body": calls[0]}


def test_c10_pg_parked_requests_hold_no_connection(make_pg_app, pg_url) -> None:
    """Ten waiters park on a pool of two connections: if parking held a connection, the
    third waiter could not even read the record and would end in a 503 (C10, R78)."""
    engine = create_store_engine(
        pg_url.render_as_string(hide_password=False), pool_size=2, max_overflow=0, pool_timeout=15
    )
    try:
        app, _ = make_pg_app({"IDEMPOTENCY_WAIT": PARK_LIMIT}, engine=engine)
        calls: list[str] = []
        entered, release = parking_view(app, calls)
        original = Background(app, "/pay", json={"a": 1}, headers=KEY)
        try:
            assert entered.wait(PARK_LIMIT)
            waiters = [Background(app, "/pay", json={"a": 1}, headers=KEY) for _ in range(10)]
            wait_until(lambda: parked(app) == 10, "ten waiters to park")
        finally:
            release.set()
        first = original.result()
        for waiter in waiters:
            response = waiter.result()
            assert response.status_code == 201 and response.data == first.data
            assert response.headers.get(REPLAYED) == "true"
        assert calls == ["pay"]
    finally:
        engine.dispose()


def test_c13_pg_a_lease_renewed_between_the_read_and_the_takeover_is_not_taken(
    make_server_app, monkeypatch
) -> None:
    """The takeover's UPDATE checks the lease itself, not only the read before it: an owner
    whose renewal lands between a duplicate's read (lease lapsed) and its UPDATE keeps its
    key, though its token is unchanged (X-catalogue: the renewal race of C13/C44)."""
    app, _ = make_server_app({"IDEMPOTENCY_WAIT": 0})
    store = app.extensions["idempotency"].store
    ident = identity_of(app, "/pay", {"a": 1})
    owner = store.acquire(ident, ttl=3600, lease=0.05)
    assert isinstance(owner, Claim)
    wait_for_db_clock(app, rows(app)[0]["lease_expires_at_ms"])
    read = store._claim_or_read
    renewed: list[set[int]] = []

    def read_then_the_owner_renews(*args: Any, **kwargs: Any) -> Any:
        outcome = read(*args, **kwargs)
        if not renewed and not isinstance(outcome, Claim):
            assert outcome is not None and not outcome.lease_live  # the read saw it lapsed
            renewed.append(store.renew([owner], 60))
        return outcome

    monkeypatch.setattr(store, "_claim_or_read", read_then_the_owner_renews)
    duplicate = store.acquire(ident, ttl=3600, lease=60)
    assert renewed == [{owner.record_id}], "the owner's renewal landed"
    assert not isinstance(duplicate, Claim), f"a renewed lease was taken over: {duplicate}"
    (row,) = rows(app)
    assert row["lock_token"] == owner.lock_token and row["state"] == "in_progress"
