"""The payments example (``example/``) end to end through its test client.

These prove the example does what the README's walkthrough claims, on the same
code path ``make run`` uses: the embedded SQLite default in the instance folder.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import inspect
from sqlalchemy.engine import URL

import example.app as payments_app
from example.app import MIGRATIONS_DIR, create_app
from example.models import Payment, db
from example.serve import prepare_database
from flask_idempotency import signals
from flask_idempotency.records import IN_PROGRESS
from tests.conftest import REDIS_URL, service_missing

ENV_VARS = (
    "DATABASE_URL",
    "IDEMPOTENCY_DATABASE_URI",
    "REDIS_URL",
    "IDEMPOTENCY_REDIS_URL",
    "FLASK_IDEMPOTENCY_REDIS_URL",
    "FLASK_SQLALCHEMY_DATABASE_URI",
    "GATEWAY_LATENCY",
)
CHARGE = {"amount_cents": 1999, "currency": "EUR", "description": "Order 1001"}


def _headers(key: str | None = "order-1001", account: str = "acme") -> dict[str, str]:
    headers = {"X-Account": account}
    if key is not None:
        headers["Idempotency-Key"] = key
    return headers


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example reads the environment; a developer's shell must not leak into the test."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _build(config: dict[str, Any], instance: Path) -> Iterator[Flask]:
    app = create_app({"TESTING": True, **config}, instance_path=str(instance))
    with app.app_context():
        db.create_all()
    yield app
    with app.app_context():
        db.engine.dispose()


@pytest.fixture
def app(clean_env: None, tmp_path: Path) -> Iterator[Flask]:
    yield from _build({}, tmp_path / "instance")


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def _payment_count(app: Flask) -> int:
    with app.app_context():
        return len(db.session.scalars(db.select(Payment)).all())


def test_default_database_is_sqlite_in_the_instance_folder(app: Flask, tmp_path: Path) -> None:
    """``make run`` needs nothing installed: the embedded default is a file in instance/."""
    assert app.config["SQLALCHEMY_DATABASE_URI"] == (
        "sqlite:///" + str(tmp_path / "instance" / "payments.sqlite3")
    )
    assert (tmp_path / "instance" / "payments.sqlite3").exists()


def test_first_request_creates_the_payment_without_replay_header(
    app: Flask, client: FlaskClient
) -> None:
    """C9: a first execution answers 201 with a Location and never says it was replayed."""
    response = client.post("/payments", json=CHARGE, headers=_headers())
    assert response.status_code == 201
    body = response.get_json()
    assert body["amount_cents"] == 1999
    assert body["currency"] == "EUR"
    assert body["status"] == "succeeded"
    assert response.headers["Location"] == f"/payments/{body['id']}"
    assert "Idempotent-Replayed" not in response.headers
    assert _payment_count(app) == 1


def test_retry_with_same_key_replays_and_charges_once(app: Flask, client: FlaskClient) -> None:
    """C9: the retry gets the same status, bytes and Location, marked replayed; one row only."""
    first = client.post("/payments", json=CHARGE, headers=_headers())
    retry = client.post("/payments", json=CHARGE, headers=_headers())
    assert retry.status_code == 201
    assert retry.get_data() == first.get_data()
    assert retry.headers["Location"] == first.headers["Location"]
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert _payment_count(app) == 1


def test_same_key_with_another_body_is_422_key_reused(app: Flask, client: FlaskClient) -> None:
    """C7: reusing a key for a different charge is refused and charges nothing."""
    client.post("/payments", json=CHARGE, headers=_headers())
    other = client.post("/payments", json={**CHARGE, "amount_cents": 5000}, headers=_headers())
    assert other.status_code == 422
    assert other.mimetype == "application/problem+json"
    assert other.get_json()["code"] == "key-reused"
    assert _payment_count(app) == 1


def test_keys_of_two_accounts_never_meet(app: Flask, client: FlaskClient) -> None:
    """C5: the scope loader puts the same key from two accounts in two records."""
    acme = client.post("/payments", json=CHARGE, headers=_headers(account="acme"))
    globex = client.post("/payments", json=CHARGE, headers=_headers(account="globex"))
    assert acme.status_code == globex.status_code == 201
    assert "Idempotent-Replayed" not in globex.headers
    assert acme.get_json()["id"] != globex.get_json()["id"]
    assert _payment_count(app) == 2


@pytest.mark.parametrize(
    ("invalid", "field"),
    [
        ({"amount_cents": -5, "currency": "EUR"}, "amount_cents"),
        ({"amount_cents": 0, "currency": "EUR"}, "amount_cents"),
        ({"amount_cents": 10.5, "currency": "EUR"}, "amount_cents"),
        ({"amount_cents": True, "currency": "EUR"}, "amount_cents"),
        ({"amount_cents": 10**12, "currency": "EUR"}, "amount_cents"),
        ({"amount_cents": 100, "currency": "EURO"}, "currency"),
        ({"amount_cents": 100}, "currency"),
        ({"amount_cents": 100, "currency": "EUR", "description": 7}, "description"),
        ({"amount_cents": 100, "currency": "EUR", "description": "a\x00b"}, "description"),
        ({"amount_cents": 100, "currency": "EUR", "description": "a\ud800b"}, "description"),
        ([1, 2, 3], ""),
    ],
)
def test_invalid_body_releases_the_key_so_the_fix_can_reuse_it(
    app: Flask, client: FlaskClient, invalid: Any, field: str
) -> None:
    """C19: the view rejects the body and releases its claim; the corrected retry runs."""
    rejected = client.post("/payments", json=invalid, headers=_headers())
    assert rejected.status_code == 400
    assert rejected.mimetype == "application/problem+json"
    problem = rejected.get_json()
    assert problem["code"] == "invalid-payment"
    assert field in [error["field"] for error in problem["errors"]]

    fixed = client.post("/payments", json=CHARGE, headers=_headers())
    assert fixed.status_code == 201
    assert "Idempotent-Replayed" not in fixed.headers
    assert _payment_count(app) == 1


def test_a_body_that_is_not_json_is_a_400_problem(app: Flask, client: FlaskClient) -> None:
    """Bad input gets a 4xx problem, never a 500; the key stays usable (C19)."""
    rejected = client.post(
        "/payments", data=b"amount=1999", headers={**_headers(), "Content-Type": "text/plain"}
    )
    assert rejected.status_code == 400
    assert rejected.get_json()["code"] == "invalid-payment"
    assert client.post("/payments", json=CHARGE, headers=_headers()).status_code == 201


def test_a_body_over_the_limit_is_a_413_problem(app: Flask, client: FlaskClient) -> None:
    """C31: Flask's own size limit applies, and it answers as problem+json, not a 500."""
    response = client.post(
        "/payments",
        data=b'{"description": "' + b"x" * 70_000 + b'"}',
        headers={**_headers(), "Content-Type": "application/json"},
    )
    assert response.status_code == 413
    assert response.mimetype == "application/problem+json"
    assert _payment_count(app) == 0


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(
        st.text(max_size=12), children, max_size=4
    )


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    _json_containers,
    max_leaves=12,
)
CHARGE_LIKE = st.fixed_dictionaries(
    {},
    optional={
        "amount_cents": JSON_VALUES,
        "currency": JSON_VALUES | st.text(min_size=3, max_size=3),
        "description": JSON_VALUES,
    },
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=CHARGE_LIKE | JSON_VALUES)
def test_no_body_ever_gets_a_server_error(app: Flask, client: FlaskClient, body: Any) -> None:
    """Bad input gets a 4xx problem, never a 500; only a valid charge creates a payment."""
    key = uuid.uuid4().hex
    response = client.post("/payments", json=body, headers=_headers(key))
    assert response.status_code in (201, 400), response.get_data()
    if response.status_code == 400:
        assert response.mimetype == "application/problem+json"
        assert response.get_json()["code"] == "invalid-payment"


def test_missing_key_is_400_missing_key(app: Flask, client: FlaskClient) -> None:
    """C4: ``required=True`` refuses a POST without a key before the view runs."""
    response = client.post("/payments", json=CHARGE, headers=_headers(key=None))
    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["code"] == "missing-key"
    assert _payment_count(app) == 0


def test_malformed_key_is_400_invalid_key(app: Flask, client: FlaskClient) -> None:
    """C3: a key with a control character is refused; nothing is charged."""
    response = client.post("/payments", json=CHARGE, headers=_headers(key="bad\tkey"))
    assert response.status_code == 400
    assert response.get_json()["code"] == "invalid-key"
    assert _payment_count(app) == 0


def test_malformed_account_header_is_a_400_problem(app: Flask, client: FlaskClient) -> None:
    """The demo scope loader rejects a bad X-Account with a problem, not a 500."""
    response = client.post("/payments", json=CHARGE, headers=_headers(account="a b/c"))
    assert response.status_code == 400
    assert response.mimetype == "application/problem+json"
    assert _payment_count(app) == 0


def test_list_and_show_payments(app: Flask, client: FlaskClient) -> None:
    """GET routes list newest first and show one; an unknown id is a 404 problem."""
    first = client.post("/payments", json=CHARGE, headers=_headers("k-1")).get_json()
    second = client.post(
        "/payments", json={**CHARGE, "currency": "usd"}, headers=_headers("k-2")
    ).get_json()
    listing = client.get("/payments")
    assert listing.status_code == 200
    assert [p["id"] for p in listing.get_json()["payments"]] == [second["id"], first["id"]]
    assert second["currency"] == "USD"
    assert client.get(f"/payments/{first['id']}").get_json() == first
    missing = client.get("/payments/999999")
    assert missing.status_code == 404
    assert missing.mimetype == "application/problem+json"


def test_wrong_method_is_a_405_problem_with_allow(client: FlaskClient) -> None:
    response = client.delete("/payments")
    assert response.status_code == 405
    assert response.mimetype == "application/problem+json"
    assert "POST" in response.headers["Allow"]


def test_concurrent_duplicate_waits_for_the_charge_and_gets_the_replay(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C8, C10: a duplicate sent while the gateway call runs parks, then replays; one charge.

    The gateway blocks until the duplicate has seen the in-flight record, so the
    duplicate really arrives mid-charge; no sleeps decide the interleaving.
    """
    app = next(_build({"IDEMPOTENCY_WAIT": 60}, tmp_path / "instance"))
    store = app.extensions["idempotency"].store
    in_gateway = threading.Event()
    duplicate_saw_in_flight = threading.Event()
    real_acquire = store.acquire

    def observed_acquire(*args: Any, **kwargs: Any) -> Any:
        outcome = real_acquire(*args, **kwargs)
        if in_gateway.is_set() and getattr(outcome, "state", None) == IN_PROGRESS:
            duplicate_saw_in_flight.set()
        return outcome

    def slow_gateway(amount_cents: int, currency: str) -> None:
        in_gateway.set()
        assert duplicate_saw_in_flight.wait(60), "the duplicate never reached the store"

    monkeypatch.setattr(store, "acquire", observed_acquire)
    monkeypatch.setattr(payments_app, "charge_gateway", slow_gateway)

    responses: dict[str, Any] = {}
    waits: list[str] = []

    def on_waited(sender: Any, **extra: Any) -> None:
        waits.append(extra["outcome"])

    signals.request_waited.connect(on_waited, app)

    def send(name: str) -> None:
        responses[name] = app.test_client().post("/payments", json=CHARGE, headers=_headers())

    try:
        original = threading.Thread(target=send, args=("original",))
        original.start()
        assert in_gateway.wait(60)
        duplicate = threading.Thread(target=send, args=("duplicate",))
        duplicate.start()
        original.join(60)
        duplicate.join(60)

        assert responses["original"].status_code == 201
        assert "Idempotent-Replayed" not in responses["original"].headers
        assert responses["duplicate"].status_code == 201
        assert responses["duplicate"].headers["Idempotent-Replayed"] == "true"
        assert responses["duplicate"].get_data() == responses["original"].get_data()
        assert _payment_count(app) == 1
        assert waits == ["completed"]  # the duplicate parked and woke to the stored answer
    finally:
        signals.request_waited.disconnect(on_waited, app)
        duplicate_saw_in_flight.set()  # never leave the original blocked
        with app.app_context():
            db.engine.dispose()


def test_overrun_charge_is_rolled_back_and_the_taker_s_payment_stands(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C13, C14, C40: a charge that outlives its lease loses it; its payment row is rolled back.

    The first request stalls in the gateway past its (tiny) lease; a retry takes
    the key over and completes. When the first one resumes, its fenced completion
    matches nothing, so its own payment row is rolled back with it (atomic mode)
    and its client gets 409: exactly one payment, and retries replay the taker's.
    """
    # The heartbeat is off: this models an owner that overruns its lease (C44 would renew
    # it; with a 50 ms lease, whether a renewal lands in time is a race).
    config = {"IDEMPOTENCY_LEASE": 0.05, "IDEMPOTENCY_WAIT": 60, "IDEMPOTENCY_HEARTBEAT": False}
    app = next(_build(config, tmp_path / "inst"))
    stalled = threading.Event()
    taker_finished = threading.Event()
    gateway_calls: list[str] = []

    def gateway(amount_cents: int, currency: str) -> None:
        gateway_calls.append(threading.current_thread().name)
        if len(gateway_calls) == 1:  # the first charge hangs until the taker is done
            stalled.set()
            assert taker_finished.wait(60), "the taker never finished"

    monkeypatch.setattr(payments_app, "charge_gateway", gateway)
    responses: dict[str, Any] = {}

    def send_original() -> None:
        responses["original"] = app.test_client().post("/payments", json=CHARGE, headers=_headers())

    original = threading.Thread(target=send_original, name="original")
    try:
        original.start()
        assert stalled.wait(60)
        taker = app.test_client().post("/payments", json=CHARGE, headers=_headers())
        taker_finished.set()
        original.join(60)

        assert taker.status_code == 201
        assert "Idempotent-Replayed" not in taker.headers
        assert responses["original"].status_code == 409
        assert responses["original"].get_json()["code"] == "request-in-progress"
        assert len(gateway_calls) == 2
        assert _payment_count(app) == 1  # the overrun's row was rolled back with its completion
        retry = app.test_client().post("/payments", json=CHARGE, headers=_headers())
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.get_data() == taker.get_data()
    finally:
        taker_finished.set()
        original.join(60)
        with app.app_context():
            db.engine.dispose()


def test_environment_selects_database_redis_and_latency(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DATABASE_URL (Heroku spelling too), REDIS_URL and GATEWAY_LATENCY reach the config."""
    monkeypatch.setenv("DATABASE_URL", "postgres://user@db.invalid:5432/pay")
    monkeypatch.setenv("REDIS_URL", "redis://cache.invalid:6379/0")
    monkeypatch.setenv("GATEWAY_LATENCY", "1.5")
    config = payments_app._env_config()
    assert config["SQLALCHEMY_DATABASE_URI"] == "postgresql+psycopg2://user@db.invalid:5432/pay"
    assert config["IDEMPOTENCY_REDIS_URL"] == "redis://cache.invalid:6379/0"
    assert payments_app._gateway_latency(config["GATEWAY_LATENCY"]) == 1.5


@pytest.mark.parametrize("latency", ["soon", "-1", "600"])
def test_bad_gateway_latency_fails_at_start_up(
    clean_env: None, tmp_path: Path, latency: str
) -> None:
    with pytest.raises(ValueError, match="GATEWAY_LATENCY"):
        create_app({"GATEWAY_LATENCY": latency}, instance_path=str(tmp_path))


# Flask-Migrate's stock env.py still calls the deprecated ``db.get_engine()`` first.
@pytest.mark.filterwarnings("ignore:'get_engine' is deprecated:DeprecationWarning")
def test_serve_prepares_the_schema_from_nothing(
    clean_env: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``make run`` does first: the repository's migrations (else create_all), then a charge.

    Alembic's env.py reconfigures logging; afterwards the extension's logger must
    still be heard (C30's log checks and every operator depend on it).
    """
    app = create_app({"TESTING": True}, instance_path=str(tmp_path / "fresh"))
    how = prepare_database(app)
    extension_log = logging.getLogger("flask_idempotency")
    assert not extension_log.disabled
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        extension_log.warning("still heard after the migrations")
    assert "still heard after the migrations" in caplog.text
    has_migrations = (Path(MIGRATIONS_DIR) / "env.py").exists()
    assert how == ("migrations" if has_migrations else "create_all")
    with app.app_context():
        tables = set(inspect(db.engine).get_table_names())
    assert {"payments", "idempotency_keys"} <= tables
    response = app.test_client().post("/payments", json=CHARGE, headers=_headers())
    assert response.status_code == 201
    with app.app_context():
        db.engine.dispose()


def test_example_on_postgresql(clean_env: None, tmp_path: Path, pg_url: URL) -> None:
    """The same walkthrough on the real PostgreSQL: one charge, a replay, a 422 (C7, C9)."""
    uri = pg_url.render_as_string(hide_password=False)
    app = next(_build({"SQLALCHEMY_DATABASE_URI": uri}, tmp_path / "instance"))
    try:
        client = app.test_client()
        first = client.post("/payments", json=CHARGE, headers=_headers())
        retry = client.post("/payments", json=CHARGE, headers=_headers())
        other = client.post("/payments", json={**CHARGE, "currency": "GBP"}, headers=_headers())
        assert first.status_code == 201
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.get_data() == first.get_data()
        assert other.status_code == 422
        assert _payment_count(app) == 1
    finally:
        with app.app_context():
            db.drop_all()
            db.engine.dispose()


@pytest.fixture
def real_redis_url() -> Iterator[str]:
    """The Redis server of ``IDEMPOTENCY_TEST_REDIS_URL``; skipped locally, failed in CI."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        service_missing("Redis", f"{REDIS_URL}: {exc}")
    yield REDIS_URL
    client.close()


@pytest.mark.redis
def test_example_on_postgresql_with_redis(
    clean_env: None, tmp_path: Path, pg_url: URL, real_redis_url: str
) -> None:
    """C9, C23: with REDIS_URL set the retry is replayed from the Redis copy; one charge."""
    import redis

    prefix = f"example-test-{uuid.uuid4().hex[:8]}"
    config = {
        "SQLALCHEMY_DATABASE_URI": pg_url.render_as_string(hide_password=False),
        "IDEMPOTENCY_REDIS_URL": real_redis_url,
        "IDEMPOTENCY_REDIS_PREFIX": prefix,
    }
    app = next(_build(config, tmp_path / "instance"))
    sources: list[str] = []

    def on_replayed(sender: Any, **extra: Any) -> None:
        sources.append(extra["source"])

    signals.request_replayed.connect(on_replayed, app)
    client = redis.Redis.from_url(real_redis_url)
    try:
        test_client = app.test_client()
        first = test_client.post("/payments", json=CHARGE, headers=_headers())
        retry = test_client.post("/payments", json=CHARGE, headers=_headers())
        assert first.status_code == 201
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.get_data() == first.get_data()
        assert sources == ["cache"]
        assert _payment_count(app) == 1
        assert list(client.scan_iter(match=f"{prefix}:*")), "no completed record reached Redis"
    finally:
        signals.request_replayed.disconnect(on_replayed, app)
        for name in client.scan_iter(match=f"{prefix}:*"):
            client.delete(name)
        client.close()
        with app.app_context():
            db.drop_all()
            db.engine.dispose()
