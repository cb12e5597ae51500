"""What one store may take from a shared Redis: only its own records, within their life.

Real PostgreSQL and a private redis-server. Rules: C41 (a record is replayed only by
the store that wrote it), C24 (Redis never makes a request wait longer than its
socket timeout), C42 (no decision depends on the app host's clock agreeing with the
database's).
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from flask import Flask, jsonify, request
from sqlalchemy.engine import URL

from flask_idempotency import Idempotency, idempotent, signals
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.postgres]


class Service:
    """One app with its own table (or database) and a view that counts its executions."""

    def __init__(self, pg_url: URL, table: str, **config: Any) -> None:
        self.table = table
        self.calls: list[dict[str, Any]] = []
        self.replays: list[str] = []
        app = Flask(f"svc_{table}")
        app.config.update(
            IDEMPOTENCY_DATABASE_URI=pg_url.render_as_string(hide_password=False),
            IDEMPOTENCY_TABLE=table,
            IDEMPOTENCY_CREATE_TABLE=True,
            IDEMPOTENCY_WAIT=5,
        )
        app.config.update(config)
        self.ext = Idempotency(app)
        self.app = app

        @app.post("/charge")
        @idempotent
        def charge() -> Any:
            body = request.get_json()
            self.calls.append(body)
            return jsonify(service=table, card=body["card"], n=len(self.calls)), 201

        def replayed(sender: Any, **extra: Any) -> None:
            self.replays.append(extra["source"])

        signals.request_replayed.connect(replayed, app, weak=False)

    def post(self, key: str, body: dict[str, Any]) -> Any:
        return self.app.test_client().post("/charge", json=body, headers={"Idempotency-Key": key})

    def close(self) -> None:
        state = self.app.extensions["idempotency"]
        state.store.table.drop(state.store.engine, checkfirst=True)
        state.store.engine.dispose()


@pytest.fixture
def services(pg_url: URL, redis_server: RedisServer) -> Iterator[Any]:
    made: list[Service] = []

    def make(**config: Any) -> Service:
        config.setdefault("IDEMPOTENCY_REDIS_URL", redis_server.url)
        service = Service(pg_url, f"iso_{uuid.uuid4().hex[:10]}", **config)
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()


# -- 9.1 / C41 ------------------------------------------------------------------------


def test_i9_1_c41_shared_redis_never_replays_another_stores_record(services: Any) -> None:
    """Two services, two tables, one Redis and the default prefix: B never answers with A's
    stored body, and a different body at B is a new request there, not a 422 (C41)."""
    a, b = services(), services()
    key = "order-1001"
    first = a.post(key, {"card": "4111 1111 1111 1111"})
    assert first.status_code == 201
    assert a.post(key, {"card": "4111 1111 1111 1111"}).headers.get("Idempotent-Replayed")
    assert a.replays == ["cache"]  # A's record is in the shared Redis

    same_body = b.post(key, {"card": "4111 1111 1111 1111"})
    assert same_body.status_code == 201
    assert "Idempotent-Replayed" not in same_body.headers
    assert same_body.get_json()["service"] == b.table
    assert b.calls == [{"card": "4111 1111 1111 1111"}]

    other = services()
    other_body = other.post(key, {"card": "5500 0000 0000 0004"})
    assert other_body.status_code == 201  # not A's 422
    assert other_body.get_json()["service"] == other.table


def test_i9_1_c41_a_record_that_names_another_origin_is_a_miss_logged_once(
    services: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached copy is checked against the store that reads it: planted under B's name with
    A's origin (a shared prefix, a copied key), it is a miss, and said once (C41)."""
    a, b = services(), services()
    a.post("k-planted", {"card": "4111"})
    tier_a = a.app.extensions["idempotency"].cache
    tier_b = b.app.extensions["idempotency"].cache
    client = redis.Redis.from_url(a.app.config["IDEMPOTENCY_REDIS_URL"])
    with a.app.app_context():
        from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest

        digest = key_digest(ANONYMOUS_SCOPE, "k-planted")
        raw = client.get(tier_a.record_name(digest))
    assert raw is not None
    with b.app.app_context():
        client.set(tier_b.record_name(digest), raw)
    with caplog.at_level("WARNING", logger="flask_idempotency"):
        for _ in range(3):
            answer = b.post("k-planted", {"card": "4111"})
            assert "Idempotent-Replayed" not in answer.headers or b.calls
    assert len(b.calls) == 1
    mismatches = [r for r in caplog.records if "another store" in r.getMessage()]
    assert len(mismatches) == 1
    client.close()


def test_i9_1_c41_wakeup_channels_are_per_store(services: Any) -> None:
    """A's completions are published where only A's processes listen (C41, C10)."""
    a, b = services(), services()
    a.post("k", {"card": "1"})
    b.post("k", {"card": "1"})
    with a.app.app_context():
        channel_a = a.app.extensions["idempotency"].wakeups.channel.channel
    with b.app.app_context():
        channel_b = b.app.extensions["idempotency"].wakeups.channel.channel
    assert channel_a != channel_b


# -- 9.2 / C24 ------------------------------------------------------------------------


class SilentServer:
    """Accepts TCP connections and never answers: a frozen Redis."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_i9_2_c24_a_given_client_without_timeouts_never_makes_a_request_wait(
    pg_url: URL, pg_table: str
) -> None:
    """``redis=Redis(...)`` with no socket timeout, on a Redis that accepts and never answers:
    every protected request still answers within the configured timeout's reach (C24)."""
    silent = SilentServer()
    given = redis.Redis(host="127.0.0.1", port=silent.port)  # no timeouts at all
    app = Flask("silent")
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=pg_url.render_as_string(hide_password=False),
        IDEMPOTENCY_TABLE=pg_table,
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_REDIS_SOCKET_TIMEOUT=0.2,
    )
    Idempotency(app, redis=given)

    @app.post("/x")
    @idempotent
    def x() -> Any:
        return jsonify(ok=True), 201

    answers: list[tuple[int, float]] = []

    def call(i: int) -> None:
        started = time.monotonic()
        status = (
            app.test_client()
            .post("/x", json={"i": i}, headers={"Idempotency-Key": f"k{i}"})
            .status_code
        )
        answers.append((status, time.monotonic() - started))

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert len(answers) == 4, "requests hung on a Redis that never answers"
        assert all(status == 201 for status, _ in answers)
        assert max(seconds for _, seconds in answers) < 5.0
    finally:
        silent.close()
        state = app.extensions["idempotency"]
        state.store.table.drop(state.store.engine, checkfirst=True)
        state.store.engine.dispose()


# -- 9.10 / C42 -----------------------------------------------------------------------


@pytest.mark.parametrize("skew", [3600.0, -3600.0], ids=["host+1h", "host-1h"])
def test_i9_10_c42_host_clock_skew_changes_no_decision(
    services: Any, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """The app host's clock an hour off the database's: replays still come from the cache
    while the record lives, nothing replays after it expired, and a replaced record's new
    request is not answered 422 from the old copy (C42, C22, C21)."""
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    # A TTL of a few seconds: a copy is cached only for what is left of it by the database's
    # clock, less the trip's uncertainty, which on a loaded machine ate a 2 s TTL whole.
    svc = services(IDEMPOTENCY_TTL=4.0, IDEMPOTENCY_LEASE=1.0)
    assert svc.post("clock", {"card": "1"}).status_code == 201
    replay = svc.post("clock", {"card": "1"})
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert svc.replays == ["cache"], "a live record must replay from the cache"

    time.sleep(4.5)  # past the record's expiry by the database's clock (and Redis's)
    again = svc.post("clock", {"card": "2"})  # another body under the expired key
    assert again.status_code == 201, again.get_data(as_text=True)
    assert len(svc.calls) == 2
    replayed = svc.post("clock", {"card": "2"})
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_json()["card"] == "2" and len(svc.calls) == 2
    assert svc.replays[-1] == "cache"
