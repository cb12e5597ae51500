"""The Redis tier of an app started before its table: back within one back-off step (C54).

CONTRACT C54, C41.

A migration job that runs after the pods start (``flask db upgrade``, ``create-table``)
leaves every process serving from the database alone until the store's identity (which
names its records in Redis) can be read. Once the table appears, the tier's next probe
must find it: no identity failure remembered from before the table existed may keep the
tier off for one more probe (it kept it off 5 s, and longer under load).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from flask import Flask, jsonify

from flask_idempotency import Idempotency, idempotent, signals

from .conftest import close_stores, driver_url, drop_store_tables

pytestmark = pytest.mark.postgres

KEY = {"Idempotency-Key": "resume-1"}
THREADS = 6


def test_c54_tier_resumes_within_one_back_off_step_after_the_table_appears(
    pg_database, redis_server, tmp_path
) -> None:
    """Started before its table, under load: once the table (and its identity) exist,
    no probe of the tier fails any more, and replays come from Redis within about a
    back-off step (the figure is printed)."""
    url = driver_url(pg_database, "psycopg2").render_as_string(hide_password=False)
    app = Flask("tier_resume", instance_path=str(tmp_path / "instance"))
    app.config.update(
        TESTING=True,
        IDEMPOTENCY_DATABASE_URI=url,
        IDEMPOTENCY_TABLE=f"idem_{uuid.uuid4().hex[:12]}",
        IDEMPOTENCY_REDIS_URL=redis_server.url,
        IDEMPOTENCY_WAIT=0.2,
    )
    Idempotency(app)
    state = app.extensions["idempotency"]
    store = state.store

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(ok=True), 201

    outage = state.cache.outage
    appeared: list[float] = []
    failures_after: list[float] = []
    original_failed = outage.failed

    def failed(*args: Any, **kwargs: Any) -> bool:
        if appeared:
            failures_after.append(time.monotonic())
        return original_failed(*args, **kwargs)

    outage.failed = failed  # type: ignore[method-assign]
    from_cache: list[float] = []
    from_database: list[float] = []

    @signals.request_replayed.connect_via(app)
    def replayed(sender: Any, **extra: Any) -> None:
        (from_cache if extra["source"] == "cache" else from_database).append(time.monotonic())

    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        client = app.test_client()
        while not stop.is_set():
            statuses.append(client.post("/pay", json={"a": 1}, headers=KEY).status_code)
            time.sleep(0.005)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(THREADS)]
    try:
        for thread in threads:
            thread.start()
        # The tier has tried, failed and backed off: the table is not there yet.
        deadline = time.monotonic() + 20
        while not outage.down and time.monotonic() < deadline:
            time.sleep(0.01)
        assert outage.down, "the tier never noticed the missing table"
        time.sleep(1.5)  # a few probes fail while the table is missing (the old cache: 5 s)
        store.create_table()  # the migration job: the table and its identity appear
        appeared.append(time.monotonic())
        deadline = appeared[0] + 40
        while not from_cache and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert from_cache, "replays never came from Redis after the table appeared"
    figure = from_cache[0] - appeared[0]
    print(
        f"\ntable appears -> first replay from Redis: {figure:.3f} s"
        f" ({len(from_database)} replays from the database, {len(statuses)} requests,"
        f" {THREADS} threads; probes failed after the table appeared: {len(failures_after)})"
    )
    # A probe already under way when the table appeared may still fail; no later one.
    assert len(failures_after) <= 1, failures_after
    drop_store_tables(store)
    close_stores([store])


def test_c41_the_identity_is_read_once_per_process_under_sixteen_racing_threads(
    make_pg_app,
) -> None:
    """docs/redis.md: the identity is read once per process. Sixteen first requests at
    once wait for one read instead of each sending their own SELECT (8-16 were seen)."""
    from sqlalchemy import event

    app, _ = make_pg_app()
    store = app.extensions["idempotency"].store
    store._identity = None  # as in a fresh process (make_pg_app created the table)
    name = store.identity_table.name
    reads: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and name in statement:
            reads.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    barrier = threading.Barrier(16)
    seen: list[str] = []

    def first_request() -> None:
        barrier.wait()
        seen.append(store.identity().id)

    threads = [threading.Thread(target=first_request) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    event.remove(store.engine, "before_cursor_execute", count)
    assert len(seen) == 16 and len(set(seen)) == 1
    assert len(reads) == 1, f"{len(reads)} SELECTs of {name!r} for one identity"
