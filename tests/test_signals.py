"""Every decision sends its signal, and no log line names the raw key (C30).

One session of real requests against PostgreSQL goes through each decision:
execute and store, replay, 422, park then 409, release by the view and by a
500, a lapsed lease taken over (and the old owner finding it lost), and a
store that is down. Every log record at every level, from every logger, is
captured and searched for the raw key.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from flask import Flask, jsonify, request

from flask_idempotency import Idempotency, idempotent, release_claim, signals
from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest

from .conftest import REDIS_URL, service_missing
from .support.gunicorn import free_port

RAW_KEY = "RAW-key-c30-must-never-be-logged"
SECRET_BODY = "secret-body-c30"
ALL_SIGNALS = {
    name: getattr(signals, name)
    for name in (
        "request_executed",
        "request_replayed",
        "request_waited",
        "request_conflict",
        "key_mismatch",
        "lease_taken_over",
        "lease_lost",
        "claim_released",
        "response_stored",
        "store_error",
    )
}

pytestmark = pytest.mark.timeout(120)


class Recorder:
    """Every signal sent by one app, in order, with its keyword arguments."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    @contextmanager
    def listening(self, app: Flask) -> Iterator[None]:
        with ExitStack() as stack:
            for name, signal in ALL_SIGNALS.items():
                stack.enter_context(signal.connected_to(self._receiver(name), sender=app))
            yield

    def _receiver(self, name: str) -> Any:
        def receive(sender: Any, **extra: Any) -> None:
            with self._lock:
                self.events.append((name, extra))

        return receive

    def named(self, name: str) -> list[dict[str, Any]]:
        return [extra for event, extra in self.events if event == name]


def build_app(make_pg_app: Any, tier: str) -> tuple[Flask, dict[str, Any]]:
    # The heartbeat is off: "/short-lease" models an owner that overruns its lease (C44).
    config: dict[str, Any] = {"IDEMPOTENCY_WAIT": 0, "IDEMPOTENCY_HEARTBEAT": False}
    if tier == "redis":
        config["IDEMPOTENCY_REDIS_URL"] = REDIS_URL
        config["IDEMPOTENCY_REDIS_PREFIX"] = f"test-signals-{uuid.uuid4().hex[:8]}"
    app, _ = make_pg_app(config)
    gates: dict[str, Any] = {
        "entered": threading.Event(),
        "leave": threading.Event(),
    }

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(receipt=SECRET_BODY), 201

    @app.post("/slow")
    @idempotent(wait=0.2)
    def slow() -> Any:
        gates["entered"].set()
        gates["leave"].wait(30)
        return jsonify(receipt=SECRET_BODY), 201

    @app.post("/short-lease")
    @idempotent(lease=0.1, wait=0)
    def short_lease() -> Any:
        if request.headers.get("X-First") == "1":
            gates["entered"].set()
            gates["leave"].wait(30)
        return jsonify(receipt=SECRET_BODY), 201

    @app.post("/validate")
    @idempotent
    def validate() -> Any:
        release_claim()
        return jsonify(error=SECRET_BODY), 400

    @app.post("/boom")
    @idempotent
    def boom() -> Any:
        return jsonify(error=SECRET_BODY), 500

    return app, gates


def hold_original(
    app: Flask, gates: dict[str, Any], path: str, headers: dict[str, str]
) -> tuple[threading.Thread, list[Any]]:
    """Start the original request in a thread and return once its view is running."""
    gates["entered"].clear()
    gates["leave"].clear()
    answers: list[Any] = []

    def original() -> None:
        answers.append(app.test_client().post(path, json={"n": 1}, headers=headers))

    thread = threading.Thread(target=original)
    thread.start()
    assert gates["entered"].wait(30), "the original never reached its view"
    return thread, answers


def redis_reachable() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_missing("Redis", str(exc))
    finally:
        client.close()


@pytest.mark.parametrize("tier", ["database-only", "redis"])
def test_c30_every_decision_signals_and_no_log_names_the_raw_key(
    make_pg_app: Any, caplog: pytest.LogCaptureFixture, tier: str
) -> None:
    if tier == "redis":
        redis_reachable()
    caplog.set_level(logging.DEBUG)
    app, gates = build_app(make_pg_app, tier)
    try:
        check_session(app, gates, caplog, tier)
    finally:
        prefix = app.config.get("IDEMPOTENCY_REDIS_PREFIX")
        if tier == "redis" and prefix:
            drop_redis_keys(prefix)


def drop_redis_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1)
    try:
        for name in client.scan_iter(match=f"{prefix}*"):
            client.delete(name)
    finally:
        client.close()


def check_session(
    app: Flask, gates: dict[str, Any], caplog: pytest.LogCaptureFixture, tier: str
) -> None:
    recorder = Recorder()
    client = app.test_client()
    key = {"Idempotency-Key": RAW_KEY}
    digest = key_digest(ANONYMOUS_SCOPE, RAW_KEY)

    with recorder.listening(app):
        # executed + stored, then replayed
        assert client.post("/pay", json={"n": 1}, headers=key).status_code == 201
        replay = client.post("/pay", json={"n": 1}, headers=key)
        assert replay.headers.get("Idempotent-Replayed") == "true"
        # 422: the same key with another body
        assert client.post("/pay", json={"n": 2}, headers=key).status_code == 422

        # parked, then 409: the original holds its view until the duplicate has its answer
        slow_key = {"Idempotency-Key": RAW_KEY + "-slow"}
        thread, answers = hold_original(app, gates, "/slow", slow_key)
        assert client.post("/slow", json={"n": 1}, headers=slow_key).status_code == 409
        gates["leave"].set()
        thread.join()
        assert answers[0].status_code == 201

        # released: by the view (C19) and by a 500 (C17)
        assert (
            client.post(
                "/validate", json={"n": 1}, headers={"Idempotency-Key": RAW_KEY + "-v"}
            ).status_code
            == 400
        )
        assert (
            client.post(
                "/boom", json={"n": 1}, headers={"Idempotency-Key": RAW_KEY + "-b"}
            ).status_code
            == 500
        )

        # taken over: the first owner overruns its 0.1 s lease; it then finds the lease lost
        lease_key = {"Idempotency-Key": RAW_KEY + "-lease"}
        thread, answers = hold_original(app, gates, "/short-lease", {**lease_key, "X-First": "1"})
        time.sleep(0.3)  # the lease (database clock) is now surely past
        taker = client.post("/short-lease", json={"n": 1}, headers=lease_key)
        assert taker.status_code == 201 and "Idempotent-Replayed" not in taker.headers
        gates["leave"].set()
        thread.join()
        assert answers[0].status_code == 201  # the old owner's client still gets its answer

    # the store down: 503 and a store_error signal
    down = Flask("store_down")
    down.config["IDEMPOTENCY_DATABASE_URI"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    )
    Idempotency(down)

    @down.post("/pay")
    @idempotent
    def pay_down() -> Any:
        return jsonify(receipt=SECRET_BODY), 201

    with recorder.listening(down):
        assert down.test_client().post("/pay", json={"n": 1}, headers=key).status_code == 503

    fired = {name for name, _ in recorder.events}
    assert fired == set(ALL_SIGNALS), f"never fired: {set(ALL_SIGNALS) - fired}"

    for name, extra in recorder.events:
        assert len(extra["key_digest"]) == 64 and extra["key_digest"] != RAW_KEY, name
        assert extra["scope"] == ANONYMOUS_SCOPE, name
        assert isinstance(extra["route"], str) and extra["route"], name
        assert isinstance(extra["duration"], float) and extra["duration"] >= 0, name
        assert RAW_KEY not in repr(extra), f"{name} carries the raw key: {extra}"

    assert {e["key_digest"] for e in recorder.named("request_replayed")} == {digest}
    assert recorder.named("request_replayed")[0]["route"] == "pay"
    expected_source = "cache" if tier == "redis" else "database"
    assert recorder.named("request_replayed")[0]["source"] == expected_source
    assert {e["how"] for e in recorder.named("request_executed")} >= {"new", "taken_over"}
    assert {e["reason"] for e in recorder.named("claim_released")} >= {"view", "server-error"}
    assert [e["action"] for e in recorder.named("lease_lost")] == ["complete"]
    assert recorder.named("request_waited")[0]["waited"] > 0
    assert recorder.named("store_error")[0]["tier"] == "database"

    # C30: logs name digests. Something was logged (lease lost, store down) ...
    ours = [r for r in caplog.records if r.name.startswith("flask_idempotency")]
    assert ours, "expected the layer to log the lost lease and the store outage"
    assert any(key_digest(ANONYMOUS_SCOPE, RAW_KEY + "-lease")[:16] in r.getMessage() for r in ours)
    # ... and no record of any logger, at any level, names the raw key; ours carry no body.
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "") + repr(record.args)
        assert RAW_KEY not in text, f"{record.name}:{record.levelname} logged the raw key: {text}"
    for record in ours:
        assert SECRET_BODY not in record.getMessage() + repr(record.args)


# -- the recipes of docs/observability.md run as written -------------------------------


def doc_recipes() -> dict[str, dict[str, Any]]:
    """Execute each Python block of docs/observability.md; return their namespaces by function."""
    import re
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    recipes: dict[str, dict[str, Any]] = {}
    for block in re.findall(r"```python\n(.*?)```", source, flags=re.DOTALL):
        if "def install_" not in block:
            continue  # a fragment of an app (the built-in instrumentation's calls)
        namespace: dict[str, Any] = {}
        exec(compile(block, "docs/observability.md", "exec"), namespace)
        for name in ("install_counters",):
            if name in namespace:
                recipes[name] = namespace
    return recipes


def drive_three_decisions(app: Flask) -> None:
    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(ok=True), 201

    client = app.test_client()
    key = {"Idempotency-Key": "doc-recipe"}
    assert client.post("/pay", json={"n": 1}, headers=key).status_code == 201
    assert client.post("/pay", json={"n": 1}, headers=key).status_code == 201
    assert client.post("/pay", json={"n": 2}, headers=key).status_code == 422


def test_c30_docs_plain_dict_recipe_counts_decisions(make_app: Any) -> None:
    app, _ = make_app()
    counts = doc_recipes()["install_counters"]["install_counters"](app)
    drive_three_decisions(app)
    assert counts[("idempotency-request-executed", "pay")] == 1
    assert counts[("idempotency-response-stored", "pay")] == 1
    assert counts[("idempotency-request-replayed", "pay")] == 1
    assert counts[("idempotency-key-mismatch", "pay")] == 1
    assert sum(counts.values()) == 4


def test_c30_a_failing_receiver_never_breaks_the_request(make_app, caplog) -> None:
    """A broken metrics hook is logged; the replay it reports still reaches the client."""
    from flask_idempotency import idempotent, signals

    app, _ = make_app()
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return {"paid": True}, 201

    def broken_counter(sender, **extra):  # type: ignore[no-untyped-def]
        raise RuntimeError("metrics backend down")

    signals.request_executed.connect(broken_counter, app)
    signals.request_replayed.connect(broken_counter, app)
    signals.response_stored.connect(broken_counter, app)
    try:
        client = app.test_client()
        first = client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        again = client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
    finally:
        for signal in (signals.request_executed, signals.request_replayed, signals.response_stored):
            signal.disconnect(broken_counter, app)
    assert first.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert calls == [1]
    assert sum("receiver of the" in r.getMessage() for r in caplog.records) == 3
