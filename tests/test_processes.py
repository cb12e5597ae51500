"""Proofs with real processes: gunicorn workers, SIGKILL, a database that goes away.

Executions are counted in PostgreSQL by the view itself (tests/apps/procapp.py),
so the counts cover every worker process.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from flask import Flask, jsonify
from sqlalchemy import MetaData, func, select
from sqlalchemy.engine import URL

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.completion import deferred
from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import COMPLETED
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine
from tests.apps.procapp import executions_table
from tests.support.gunicorn import GunicornServer, pid_alive
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


class ProcHarness:
    """A records table, an executions table, and gunicorn servers that use them."""

    def __init__(self, url: URL, table: str) -> None:
        self.url = url.render_as_string(hide_password=False)
        self.table = table
        self.engine = create_store_engine(self.url)
        self.store = DurableStore(lambda: self.engine, table_name=table)
        self.store.create_table()
        self.executions = executions_table(MetaData(), table)
        self.executions.create(self.engine)
        self.servers: list[GunicornServer] = []

    def server(self, **settings: Any) -> GunicornServer:
        env = {"DATABASE_URL": self.url, "IDEM_TABLE": self.table}
        env.update({k: str(v) for k, v in settings.pop("env", {}).items()})
        server = GunicornServer("tests.apps.procapp:create_app()", env=env, **settings)
        self.servers.append(server)
        return server.start()

    def executions_of(self, key: str) -> list[Any]:
        t = self.executions
        with self.engine.connect() as conn:
            return list(conn.execute(select(t).where(t.c.idem_key == key).order_by(t.c.id)))

    def total_executions(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self.executions)).scalar_one())

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.executions.drop(self.engine, checkfirst=True)
        self.store.table.drop(self.engine, checkfirst=True)
        self.engine.dispose()


@pytest.fixture
def harness(pg_url: URL, pg_table: str) -> Iterator[ProcHarness]:
    h = ProcHarness(pg_url, pg_table)
    try:
        yield h
    finally:
        h.close()


def post(
    server: GunicornServer, key: str, body: dict[str, Any], **headers: str
) -> requests.Response:
    return requests.post(
        f"{server.url}/work/item",
        json=body,
        headers={"Idempotency-Key": key, **headers},
        timeout=60,
    )


@pytest.mark.parametrize("preload", [False, True], ids=["fork-then-load", "preload"])
def test_c8_one_execution_per_key_across_gunicorn_workers(
    harness: ProcHarness, preload: bool
) -> None:
    """C8/C10/X16: 12 keys × 12 concurrent duplicates over 4 worker processes.

    Every key's view runs exactly once; every other answer is the same replay or 409.
    """
    server = harness.server(workers=4, threads=8, preload=preload, env={"IDEM_WAIT": 10})
    keys = [f"c8-{preload}-{i}" for i in range(12)]
    jobs = [key for key in keys for _ in range(12)]
    with ThreadPoolExecutor(max_workers=48) as pool:
        answers = list(pool.map(lambda k: (k, post(server, k, {"sleep": 0.3, "k": k})), jobs))

    by_key: dict[str, list[requests.Response]] = collections.defaultdict(list)
    for key, response in answers:
        by_key[key].append(response)
    served_by = set()
    for key in keys:
        executions = harness.executions_of(key)
        assert len(executions) == 1, f"{key} ran {len(executions)} times"
        served_by.add(executions[0].pid)
        statuses = collections.Counter(r.status_code for r in by_key[key])
        assert set(statuses) <= {201, 409}, statuses
        originals = [
            r
            for r in by_key[key]
            if r.status_code == 201 and "Idempotent-Replayed" not in r.headers
        ]
        replays = [r for r in by_key[key] if r.headers.get("Idempotent-Replayed") == "true"]
        assert len(originals) == 1
        assert all(r.content == originals[0].content for r in replays)
        assert len(originals) + len(replays) + statuses[409] == 12
    assert len(served_by) >= 2, "the executions should have been spread over several workers"
    assert harness.total_executions() == len(keys)


def test_c13_sigkilled_worker_lease_lapses_then_one_retry_runs(harness: ProcHarness) -> None:
    """C13/C15: kill -9 the worker in the middle of a request; after the lease, exactly one
    retry runs."""
    # The lease outlasts the kill and gunicorn's replacement of the worker (over 3 s on
    # a loaded CI machine), so the early retry still finds it held.
    server = harness.server(workers=2, threads=4, env={"IDEM_LEASE": 8, "IDEM_WAIT": 0})
    key, body = "c13-crash", {"amount": 42}
    outcome: dict[str, Any] = {}

    def doomed_request() -> None:
        try:
            outcome["response"] = post(server, key, body, **{"X-Sleep": "120"})
        except requests.RequestException as exc:
            outcome["error"] = exc

    client = threading.Thread(target=doomed_request)
    client.start()
    wait_until(lambda: len(harness.executions_of(key)) == 1, "the doomed view to start")
    victim = harness.executions_of(key)[0].pid
    os.kill(victim, signal.SIGKILL)
    client.join(timeout=60)
    assert "error" in outcome or outcome["response"].status_code >= 500
    wait_until(lambda: not pid_alive(victim), "the killed worker to die", within=10)
    server.wait_for_workers()

    digest = key_digest("anonymous", key)
    record = harness.store.get(digest)
    assert record is not None and record.state == "in_progress" and record.lease_live
    early = post(server, key, body)
    assert early.status_code == 409  # the lease still holds: in progress, not run again
    assert early.headers["Content-Type"] == "application/problem+json"
    assert int(early.headers["Retry-After"]) >= 1

    wait_until(lambda: not harness.store.get(digest).lease_live, "the lease to lapse")  # type: ignore[union-attr]
    with ThreadPoolExecutor(max_workers=10) as pool:
        retries = list(pool.map(lambda _: post(server, key, body), range(10)))
    statuses = collections.Counter(r.status_code for r in retries)
    assert set(statuses) <= {201, 409}, statuses
    assert len(harness.executions_of(key)) == 2  # the killed run, and exactly one retry
    final = post(server, key, body)
    assert final.status_code == 201 and final.headers["Idempotent-Replayed"] == "true"
    completed = harness.store.get(digest)
    assert completed is not None and completed.state == COMPLETED


class ProxiedDatabase:
    """This test's PostgreSQL behind a proxy the test can cut, and apps that use it."""

    def __init__(self, pg_url: URL, table: str) -> None:
        self.proxy = TcpProxy(pg_url.host or "127.0.0.1", pg_url.port or 5432).start()
        self.url = pg_url.set(host="127.0.0.1", port=self.proxy.port).render_as_string(
            hide_password=False
        )
        self.direct_url = pg_url.render_as_string(hide_password=False)
        self.table = table

    def app(self, **config: Any) -> Flask:
        """An app on the proxied database; the table is created through the proxy if it is up."""
        app = Flask("proxied_database_app")
        app.config.update(
            TESTING=True, IDEMPOTENCY_DATABASE_URI=self.url, IDEMPOTENCY_TABLE=self.table, **config
        )
        Idempotency(app)
        return app

    def close(self) -> None:
        self.proxy.stop()
        direct = create_store_engine(self.direct_url)
        try:
            DurableStore(lambda: direct, table_name=self.table).table.drop(direct, checkfirst=True)
        finally:
            direct.dispose()


@pytest.fixture
def database(pg_url: URL, pg_table: str) -> Iterator[ProxiedDatabase]:
    proxied = ProxiedDatabase(pg_url, pg_table)
    try:
        yield proxied
    finally:
        proxied.close()


def counting_view(app: Flask, before_return: Callable[[], None] | None = None) -> list[int]:
    """``POST /pay``, protected, counting its executions."""
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():  # type: ignore[no-untyped-def]
        calls.append(1)
        if before_return is not None:
            before_return()
        return jsonify(n=len(calls)), 201

    return calls


def test_c25_database_unreachable_gives_503_and_runs_nothing(database: ProxiedDatabase) -> None:
    """C25: with PostgreSQL cut off, protected requests get 503 problem+json and the view
    never runs."""
    app = database.app()
    app.extensions["idempotency"].store.create_table()
    calls = counting_view(app)
    client = app.test_client()
    first = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "before"})
    assert first.status_code == 201 and calls == [1]

    database.proxy.cut()
    for key in ("during-1", "during-2", "before"):
        down = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": key})
        assert down.status_code == 503
        assert down.headers["Content-Type"] == "application/problem+json"
        assert down.get_json()["code"] == "store-unavailable"
        assert int(down.headers["Retry-After"]) >= 1
    assert calls == [1]  # nothing ran without a claim

    unprotected = client.post("/pay", json={"a": 1})  # no key: not the layer's business
    assert unprotected.status_code == 201 and calls == [1, 1]

    database.proxy.restore()
    again = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "during-1"})
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    replay = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "before"})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == first.data
    assert len(calls) == 3


def test_c25_fail_open_runs_unprotected_and_says_so(database: ProxiedDatabase) -> None:
    """C25: IDEMPOTENCY_FAIL_OPEN runs the view without protection and marks the response."""
    database.proxy.cut()
    app = database.app(IDEMPOTENCY_FAIL_OPEN=True)
    calls = counting_view(app)
    response = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "k"})
    assert response.status_code == 201 and calls == [1]
    assert response.headers["Idempotency-Unprotected"] == "store-unavailable"


def test_c25_response_survives_a_short_database_blip_after_the_view(
    database: ProxiedDatabase,
) -> None:
    """C25/C15: the database drops right after the view ran and is back within a moment.

    The view's effects already happened, so the layer keeps its response and stores it
    once the database answers, rather than leaving the claim to lapse (which would run
    the view again later).
    """
    app = database.app()
    app.extensions["idempotency"].store.create_table()

    def drop_the_network_briefly() -> None:  # between the view and the completion
        database.proxy.cut()
        threading.Timer(0.3, database.proxy.restore).start()

    calls = counting_view(app, before_return=drop_the_network_briefly)
    client = app.test_client()
    first = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "blip"})
    assert first.status_code == 201
    # The client had its answer at once; the process stores it once the database is
    # back (C55), and the retry replays it instead of running the view again.
    wait_until(lambda: deferred.pending() == 0, "the kept completion to land", within=10)
    replay = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "blip"})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == first.data and calls == [1]


def test_c25_an_outage_is_logged_once_not_per_request(
    database: ProxiedDatabase, caplog: Any
) -> None:
    """C25: every request during the outage gets its 503; the log gets one line for them."""
    database.proxy.cut()
    app = database.app()
    counting_view(app)
    client = app.test_client()
    with caplog.at_level("WARNING", logger="flask_idempotency"):
        statuses = [
            client.post("/pay", json={}, headers={"Idempotency-Key": f"k{i}"}).status_code
            for i in range(20)
        ]
    assert statuses == [503] * 20
    lines = [r for r in caplog.records if "durable store unavailable" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
