"""Cached values are authenticated by a secret only the store's database holds (C60).

Issue 34 item 5: a service that shared only the Redis found another service's keys by
``SCAN``, read its stored answers in clear, and rewrote status, ``Location`` and body
while keeping the origin line, fingerprint and expiry; the other service's retrying
client got ``303 Location: https://attacker.example/…`` with ``Idempotent-Replayed:
true``. Every value now carries an HMAC-SHA256 over its key name and content, under a
key derived from the store's secret (``<table>_store.secret``); a value that fails it is
a miss, answered from the database and logged once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import redis
from flask import jsonify, request

from flask_idempotency import idempotent, signals

KEY = {"Idempotency-Key": "order-7"}


def service_a(make_app: Any, redis_url: str, prefix: str) -> Any:
    app, _ = make_app({"IDEMPOTENCY_REDIS_URL": redis_url, "IDEMPOTENCY_REDIS_PREFIX": prefix})
    calls: list[int] = []

    @app.post("/orders")
    @idempotent
    def orders() -> Any:
        calls.append(1)
        return jsonify(order=7, amount=request.get_json()["amount"]), 201, {"Location": "/o/7"}

    return app, calls


def forge(value: bytes) -> bytes:
    """What service B did with nothing but its Redis connection: the answer rewritten,
    every other line (origin, fingerprint, expiry and whatever else) kept as it was.
    The last four lines are the status, the body-omitted flag, the headers and the body
    in every line form this cache has written."""
    import base64
    import json

    lines = value.split(b"\n")
    lines[-4] = b"303"
    lines[-2] = json.dumps(
        [["Location", "https://attacker.example/login"], ["Content-Type", "text/html"]],
        separators=(",", ":"),
    ).encode()
    lines[-1] = base64.b64encode(b"<a href=https://attacker.example/login>continue</a>")
    return b"\n".join(lines)


@pytest.mark.redis
def test_c60_a_service_sharing_only_the_redis_cannot_forge_a_cached_answer(
    make_pg_app: Any, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """C60 on real Redis and PostgreSQL: B rewrites A's cached answer (status 303, a
    ``Location`` of its choosing, a body) keeping origin, fingerprint, MAC line and
    expiry. Before the fix A's retry replayed the forged 303 from the cache; now the
    value fails its MAC, the retry is answered from the database with A's own 201, the
    warning is logged once, and the read-through puts A's own value back."""
    prefix = "idem-c60"
    app, calls = service_a(make_pg_app, redis_server.url, prefix)
    sources: list[str] = []
    signals.request_replayed.connect(lambda s, **e: sources.append(e["source"]), app, weak=False)
    client = app.test_client()
    first = client.post("/orders", json={"amount": 100}, headers=KEY)
    assert first.status_code == 201
    assert client.post("/orders", json={"amount": 100}, headers=KEY).status_code == 201
    assert sources == ["cache"]

    service_b = redis.Redis.from_url(redis_server.url)  # the Redis, and nothing else
    (name,) = list(service_b.scan_iter(match=f"{prefix}:*{{*}}"))
    original = service_b.get(name)
    service_b.set(name, forge(original), keepttl=True)
    caplog.set_level(logging.WARNING, logger="flask_idempotency")

    for _ in range(2):
        service_b.set(name, forge(original), keepttl=True)
        retry = app.test_client().post("/orders", json={"amount": 100}, headers=KEY)
        assert retry.status_code == 201, (retry.status_code, retry.headers, retry.data)
        assert retry.headers["Location"] == "/o/7" and retry.data == first.data
        assert retry.headers["Idempotent-Replayed"] == "true"
    assert sources == ["cache", "database", "database"]
    warned = [r.getMessage() for r in caplog.records if "is not this store's" in r.getMessage()]
    assert len(warned) == 1, warned  # logged once, not per read
    assert service_b.get(name) == original  # A's own value, written again by the read-through
    again = app.test_client().post("/orders", json={"amount": 100}, headers=KEY)
    assert again.status_code == 201 and sources[-1] == "cache"  # repaired by the read-through
    assert calls == [1]
    service_b.close()


@pytest.mark.redis
def test_c60_a_sealed_value_moved_to_another_key_is_a_miss(
    make_app: Any, redis_server: Any
) -> None:
    """C60: the MAC covers the key name, so B cannot hand one client's stored answer to
    another by copying a value from one key to another (same body, two users)."""
    prefix = "idem-c60-moved"
    app, calls = service_a(make_app, redis_server.url, prefix)
    client = app.test_client()
    for key in ("user-1-order", "user-2-order"):
        assert client.post("/orders", json={"amount": 1}, headers={"Idempotency-Key": key})
    assert calls == [1, 1]
    service_b = redis.Redis.from_url(redis_server.url)
    first, second = sorted(service_b.scan_iter(match=f"{prefix}:*{{*}}"))
    service_b.set(second, service_b.get(first), keepttl=True)
    cache = app.extensions["idempotency"].cache
    digest = second.decode().rsplit("{", 1)[1].rstrip("}")
    assert cache.get(digest) is None
    service_b.close()


@pytest.mark.parametrize("race", [1, 8])
def test_c60_a_row_without_a_secret_gets_one_once_race_safely(
    make_server_app: Any, race: int
) -> None:
    """A row written before the ``secret`` column existed (the column added by the
    migration, its value NULL) gets one from the first process that reads it; however
    many race, on PostgreSQL (both drivers) and MariaDB, they agree on one secret."""
    from sqlalchemy import update

    from flask_idempotency.store import DurableStore

    app, _ = make_server_app()
    store = app.extensions["idempotency"].store
    table = store.identity_table
    with store.engine.begin() as conn:
        conn.execute(update(table).values(secret=None))
    stores = [DurableStore(lambda: store.engine, table_name=store.table.name) for _ in range(race)]
    secrets: list[bytes] = []
    start = threading.Barrier(race)

    def first_read(racer: DurableStore) -> None:
        start.wait()
        secrets.append(racer.identity().secret)

    threads = [threading.Thread(target=first_read, args=(racer,)) for racer in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(secrets) == race and len(set(secrets)) == 1 and len(secrets[0]) == 64, secrets
    assert store.identity().secret == secrets[0]


def _old_identity_table(url: str, name: str) -> None:
    """``<table>_store`` as a release before issue 34 created it: no ``secret`` column."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {name} (singleton INTEGER PRIMARY KEY, id VARCHAR(32) NOT NULL,"
                " created_at_ms BIGINT NOT NULL)"
            )
        )
        conn.execute(text(f"INSERT INTO {name} VALUES (1, '{'a' * 32}', 1)"))
    engine.dispose()


@pytest.mark.parametrize("how", ["create_table setting", "create-table command"])
def test_c60_an_identity_table_from_before_the_secret_gets_the_column(
    tmp_path: Any, how: str
) -> None:
    """A ``<table>_store`` made before the secret existed: ``IDEMPOTENCY_CREATE_TABLE``
    (the first process) or ``flask idempotency create-table`` adds the column; the first
    reader fills it, and the identity's id is kept."""
    from flask import Flask

    from flask_idempotency import Idempotency

    url = f"sqlite:///{tmp_path}/old.sqlite3"
    _old_identity_table(url, "idempotency_keys_store")
    app = Flask("old", instance_path=str(tmp_path))
    app.config["IDEMPOTENCY_DATABASE_URI"] = url
    if how == "create_table setting":
        app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    Idempotency(app)
    store = app.extensions["idempotency"].store
    try:
        if how == "create-table command":
            done = app.test_cli_runner().invoke(args=["idempotency", "create-table"])
            assert done.exit_code == 0, done.output
            assert "secret" in done.output
        else:
            assert store.engine is not None  # the first use sets the tables up
        identity = store.identity()
        assert identity.id == "a" * 32 and len(identity.secret) == 64
        assert identity.secret.decode() not in repr(identity)
    finally:
        store.engine.dispose()
