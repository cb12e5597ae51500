"""MySQL/MariaDB as a durable store, against the real MariaDB (issue 16).

CONTRACT C8, C13, C14, C26, C28, C33, C42.

The store's own rules run on MariaDB in ``test_store_sqlite.py`` (parametrized over
every database); here: the concurrency proofs across processes, the request
lifecycle at both isolation levels, bodies of 1 MiB, lock waits and deadlocks
inside the bounded retry budget, and the operator commands.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
import time
import uuid
from typing import Any

import pytest
from flask import Flask, Response, jsonify
from sqlalchemy import insert, select, update
from sqlalchemy.engine import URL

from flask_idempotency import idempotent
from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import Claim, Identity, Record, StoredResponse
from flask_idempotency.store import DurableStore
from flask_idempotency.store.clock import db_now_ms
from flask_idempotency.store.connect import create_store_engine

from .test_lifecycle import KEY, REPLAYED

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(180)]

ISOLATIONS = ["REPEATABLE READ", "READ COMMITTED"]
TTL, LEASE = 3600.0, 60.0


def ident(key: str, fingerprint: str = "f" * 64) -> Identity:
    return Identity("anonymous", key_digest("anonymous", key), fingerprint, "POST", "/pay")


def _url(mysql_url: URL) -> str:
    return str(mysql_url.render_as_string(hide_password=False))


@pytest.fixture
def mysql_table(mysql_url: URL) -> Any:
    """A table of this test's own on this session's MariaDB database, dropped after."""
    engine = create_store_engine(_url(mysql_url))
    name = f"idem_{uuid.uuid4().hex[:12]}"
    store = DurableStore(lambda: engine, table_name=name)
    store.create_table()
    yield name
    store.table.drop(engine, checkfirst=True)
    engine.dispose()


# -- isolation ---------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_i16_store_runs_at_the_engines_isolation(mysql_url, mysql_table, isolation) -> None:
    """The parametrized suites really run at the level they name (no silent default)."""
    engine = create_store_engine(_url(mysql_url), isolation_level=isolation)
    store = DurableStore(lambda: engine, table_name=mysql_table)
    try:
        seen = store._run(lambda conn: conn.exec_driver_sql("SELECT @@tx_isolation").scalar())
        assert seen == isolation.replace(" ", "-")
    finally:
        engine.dispose()


# -- C8 / C13 across processes -----------------------------------------------------------


def _race_in_process(
    url: str, table: str, isolation: str, key: str, mode: str, start: Any, threads: int, out: Any
) -> None:
    """A child process: ``threads`` threads acquire one key at the same instant."""
    engine = create_store_engine(url, isolation_level=isolation)
    store = DurableStore(lambda: engine, table_name=table)
    barrier = threading.Barrier(threads)
    results: list[str] = []
    lock = threading.Lock()

    def race() -> None:
        barrier.wait()
        start.wait()
        outcome = store.acquire(ident(key), ttl=TTL, lease=LEASE)
        with lock:
            results.append(
                f"claim:{outcome.how}:{outcome.lock_token}"
                if isinstance(outcome, Claim)
                else f"record:{outcome.lock_token}"
            )

    workers = [threading.Thread(target=race) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    engine.dispose()
    out.put(results)


def _race_processes(url: str, table: str, isolation: str, key: str, mode: str) -> list[str]:
    context = multiprocessing.get_context("fork")
    start, out = context.Event(), context.Queue()
    processes, threads = 4, 8
    children = [
        context.Process(
            target=_race_in_process,
            args=(url, table, isolation, key, mode, start, threads, out),
        )
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    time.sleep(0.5)  # every child is up and waiting on its barrier
    start.set()
    results = [item for _ in children for item in out.get(timeout=120)]
    for child in children:
        child.join(timeout=30)
        assert child.exitcode == 0
    assert len(results) == processes * threads
    return results


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_i16_c8_processes_and_threads_racing_on_one_key_one_claim(
    mysql_url, mysql_table, isolation
) -> None:
    """C8: 4 processes x 8 threads claim one key on MariaDB at once: exactly one claim,
    and every other caller sees that claim's row (its token)."""
    results = _race_processes(_url(mysql_url), mysql_table, isolation, "race", "claim")
    claims = [r for r in results if r.startswith("claim:")]
    assert len(claims) == 1, claims
    token = claims[0].rsplit(":", 1)[1]
    assert all(r == f"record:{token}" for r in results if r not in claims)


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_i16_c13_processes_racing_to_take_over_a_lapsed_lease_one_wins(
    mysql_url, mysql_table, isolation
) -> None:
    """C13: a lapsed lease, 32 takers in 4 processes: one conditional UPDATE wins."""
    engine = create_store_engine(_url(mysql_url))
    store = DurableStore(lambda: engine, table_name=mysql_table)
    first = store.acquire(ident("stale"), ttl=TTL, lease=LEASE)
    assert isinstance(first, Claim)
    with store.autocommit.connect() as conn:
        conn.execute(update(store.table).values(lease_expires_at_ms=db_now_ms() - 1))
    results = _race_processes(_url(mysql_url), mysql_table, isolation, "stale", "takeover")
    claims = [r for r in results if r.startswith("claim:")]
    assert len(claims) == 1 and claims[0].startswith("claim:taken_over:"), claims
    record = store.get(ident("stale").key_digest)
    assert record is not None and record.lock_token == claims[0].rsplit(":", 1)[1]
    assert store.complete(first, StoredResponse(201, (), b"late")) is None  # fenced (C14)
    engine.dispose()


# -- the request lifecycle on MariaDB ------------------------------------------------------


def _counting_app(make_mysql_app: Any, mysql_url: URL, isolation: str, **config: Any) -> Any:
    engine = create_store_engine(_url(mysql_url), isolation_level=isolation)
    app, _ = make_mysql_app(config, engine=engine)
    calls: list[int] = []
    lock = threading.Lock()

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        with lock:
            calls.append(1)
        time.sleep(0.2)  # the duplicates arrive while it runs
        return jsonify(n=len(calls)), 201

    return app, calls


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_i16_c8_c10_threads_on_one_key_one_execution_the_rest_replay(
    make_mysql_app, mysql_url, isolation
) -> None:
    """C8/C9/C10 through Flask on MariaDB: 16 concurrent requests, one execution; the
    duplicates wait for it and replay its body byte for byte."""
    app, calls = _counting_app(make_mysql_app, mysql_url, isolation)
    barrier = threading.Barrier(16)
    answers: list[Any] = []
    lock = threading.Lock()

    def send() -> None:
        client = app.test_client()
        barrier.wait()
        response = client.post("/pay", json={"a": 1}, headers=KEY)
        with lock:
            answers.append(response)

    workers = [threading.Thread(target=send) for _ in range(16)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert calls == [1]
    assert {r.status_code for r in answers} == {201}
    assert sum(r.headers.get(REPLAYED) == "true" for r in answers) == 15
    assert len({r.data for r in answers}) == 1


def test_i16_c33_a_one_mib_body_is_stored_and_replayed_whole(make_mysql_app) -> None:
    """C9/C33: the default limit (1 MiB) fits the MariaDB column (LONGBLOB, not BLOB's 64 KiB)."""
    app, _ = make_mysql_app()
    body = bytes(range(256)) * 4096  # exactly 1 MiB
    calls: list[int] = []

    @app.post("/blob")
    @idempotent
    def blob() -> Any:
        calls.append(1)
        return Response(body, status=201, mimetype="application/octet-stream")

    client = app.test_client()
    first = client.post("/blob", json={}, headers=KEY)
    again = client.post("/blob", json={}, headers=KEY)
    assert first.status_code == again.status_code == 201
    assert again.headers.get(REPLAYED) == "true" and again.headers.get("Idempotency-Replay") is None
    assert again.data == body and calls == [1]


# -- C26: lock waits and deadlocks ------------------------------------------------------------


def test_i16_c26_guarded_claim_does_not_queue_behind_a_held_row_lock(
    mysql_url, mysql_table
) -> None:
    """R38 on MariaDB: an atomic owner holds its record's row lock until its commit; a
    guarded claim gives up after innodb_lock_wait_timeout=1 s and reads the record,
    instead of waiting the server's default 50 s. The session value is put back."""
    engine = create_store_engine(_url(mysql_url))
    store = DurableStore(lambda: engine, table_name=mysql_table)
    claim = store.acquire(ident("held"), ttl=TTL, lease=LEASE)
    assert isinstance(claim, Claim)
    holder = engine.connect()
    holder.begin()
    holder.execute(
        select(store.table.c.id).where(store.table.c.id == claim.record_id).with_for_update()
    )
    try:
        started = time.monotonic()
        outcome = store.acquire(ident("held"), ttl=TTL, lease=LEASE, guard_locks=True)
        elapsed = time.monotonic() - started
        assert isinstance(outcome, Record) and outcome.lock_token == claim.lock_token
        assert elapsed < 10, elapsed
    finally:
        holder.rollback()
        holder.close()
    with engine.connect() as conn:
        timeouts = {
            conn.exec_driver_sql("SELECT @@session.innodb_lock_wait_timeout").scalar()
            for _ in range(3)
        }
    assert timeouts == {
        engine.connect().exec_driver_sql("SELECT @@global.innodb_lock_wait_timeout").scalar()
    }
    engine.dispose()


def test_i16_c26_a_real_deadlock_is_retried_within_the_budget(mysql_url, mysql_table) -> None:
    """C26: InnoDB picks the store's transaction as the deadlock victim (error 1213); the
    store runs it again in a fresh transaction instead of answering 503."""
    engine = create_store_engine(_url(mysql_url))
    store = DurableStore(lambda: engine, table_name=mysql_table)
    t = store.table
    a = store.acquire(ident("a"), ttl=TTL, lease=LEASE)
    b = store.acquire(ident("b"), ttl=TTL, lease=LEASE)
    assert isinstance(a, Claim) and isinstance(b, Claim)
    ballast = [
        {
            "key_digest": uuid.uuid4().hex * 2,
            "scope": "s",
            "fingerprint": "f",
            "method": "POST",
            "path": "/",
            "state": "completed",
            "created_at_ms": 0,
            "expires_at_ms": 0,
        }
        for _ in range(50)
    ]
    a_locked, helper_waiting = threading.Event(), threading.Event()
    attempts: list[int] = []

    def helper() -> None:
        """Heavier transaction (many rows written), so InnoDB rolls the store's back."""
        with engine.begin() as conn:
            conn.execute(insert(t), ballast)
            conn.execute(update(t).where(t.c.id == b.record_id).values(path="/helper"))
            assert a_locked.wait(30)
            helper_waiting.set()
            conn.execute(update(t).where(t.c.id == a.record_id).values(path="/helper"))

    def work(conn: Any) -> str:
        attempts.append(1)
        conn.execute(update(t).where(t.c.id == a.record_id).values(path="/store"))
        if len(attempts) == 1:
            a_locked.set()
            assert helper_waiting.wait(30)
            time.sleep(0.3)  # the helper is now queued on row a
        conn.execute(update(t).where(t.c.id == b.record_id).values(path="/store"))
        return "done"

    thread = threading.Thread(target=helper)
    thread.start()
    assert store._run(work) == "done"
    thread.join(30)
    assert len(attempts) == 2, "the deadlock was not met, or not retried"
    engine.dispose()


# -- C28: the operator commands on MariaDB -----------------------------------------------------


def test_i16_c28_cli_create_check_prune_stats_show_forget(mysql_url, pg_table) -> None:
    """create-table, check, prune (batched, live leases spared), stats, show, forget."""
    from flask_idempotency import Idempotency

    app = Flask("mysql_cli_app")
    app.config.update(IDEMPOTENCY_DATABASE_URI=_url(mysql_url), IDEMPOTENCY_TABLE=pg_table)
    Idempotency(app)
    runner = app.test_cli_runner()
    store = app.extensions["idempotency"].store
    try:
        created = runner.invoke(args=["idempotency", "create-table"])
        assert created.exit_code == 0 and "Created" in created.output, created.output
        checked = runner.invoke(args=["idempotency", "check"])
        assert checked.exit_code == 0 and checked.output.startswith("OK: "), checked.output

        with store.autocommit.connect() as conn:
            now = conn.execute(select(db_now_ms())).scalar_one()
            rows = [
                {
                    "key_digest": f"{n:064d}",
                    "scope": "anonymous",
                    "fingerprint": "f" * 64,
                    "method": "POST",
                    "path": "/pay",
                    "state": "completed",
                    "created_at_ms": now - 9000,
                    "expires_at_ms": now - 1000 - n,
                    "completed_at_ms": now - 8000,
                    "response_status": 201,
                    "response_headers": "[]",
                    "response_body": b"{}",
                }
                for n in range(250)
            ]
            live = {
                "key_digest": "a" * 64,
                "scope": "anonymous",
                "fingerprint": "f" * 64,
                "method": "POST",
                "path": "/pay",
                "state": "in_progress",
                "lock_token": "t" * 32,
                "created_at_ms": now - 9000,
                "expires_at_ms": now - 1000,
                "lease_expires_at_ms": now + 600_000,
            }
            conn.execute(insert(store.table), rows)
            conn.execute(insert(store.table), [live])

        stats = runner.invoke(args=["idempotency", "stats", "--json"])
        assert stats.exit_code == 0, stats.output
        numbers = json.loads(stats.output)
        assert (numbers["total"], numbers["prunable"], numbers["in_progress"]) == (251, 250, 1)

        pruned = runner.invoke(args=["idempotency", "prune", "--batch-size", "100"])
        assert pruned.exit_code == 0, pruned.output
        match = re.search(r"Deleted (\d+) expired records? in (\d+) batch(?:es)?\.", pruned.output)
        assert match is not None and match.groups() == ("250", "3"), pruned.output

        shown = runner.invoke(args=["idempotency", "show", "a" * 64, "--digest"])
        assert shown.exit_code == 0 and "in_progress" in shown.output, shown.output
        forgot = runner.invoke(args=["idempotency", "forget", "a" * 64, "--digest", "--yes"])
        assert forgot.exit_code == 0, forgot.output
        with store.autocommit.connect() as conn:
            assert conn.execute(select(store.table.c.id)).first() is None
    finally:
        store.table.drop(store.engine, checkfirst=True)
        store.engine.dispose()
