"""Per-process resources: engines after fork, listeners of short-lived apps, gevent.

Rules: C47 (what belongs to a process is reset in a forked child and released when
its last app is gone), C8 (one execution per key), C24/C25 (never a hang). Real
PostgreSQL, a private redis-server and real gunicorn.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import requests
from flask import Flask, jsonify, request
from sqlalchemy import MetaData, Table, create_engine
from sqlalchemy.engine import URL

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.notify import listener
from tests.support.gunicorn import GunicornServer
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.postgres]


def echo_app(config: dict[str, Any], **kwargs: Any) -> Flask:
    app = Flask(f"echo_{uuid.uuid4().hex[:6]}")
    app.config.update(config)
    Idempotency(app, **kwargs)

    @app.post("/echo")
    @idempotent
    def echo() -> Any:
        return jsonify(key=request.headers["Idempotency-Key"], body=request.get_json()), 201

    return app


def run_requests(app: Flask, tag: str, threads: int, per_thread: int) -> list[str]:
    """Unique keys, each sent twice; every answer must be its own (no crossed results)."""
    problems: list[str] = []

    def worker(n: int) -> None:
        client = app.test_client()
        for i in range(per_thread):
            key = f"{tag}-{n}-{i}"
            for attempt in range(2):
                answer = client.post("/echo", json={"n": i}, headers={"Idempotency-Key": key})
                data = answer.get_json(silent=True) or {}
                if answer.status_code != 201 or data.get("key") != key:
                    problems.append(f"{key}#{attempt}: {answer.status_code} {data}")

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    return problems


@pytest.fixture
def records_table(pg_url: URL) -> Iterator[str]:
    name = f"proc_{uuid.uuid4().hex[:10]}"
    yield name
    engine = create_engine(pg_url)
    Table(name, MetaData()).drop(engine, checkfirst=True)
    engine.dispose()


# -- 9.3: engines after fork ------------------------------------------------------------


def test_i9_3_c47_forked_children_never_share_the_parents_database_connections(
    pg_url: URL, records_table: str
) -> None:
    """The parent used the store (its pool holds sockets), then forks workers that each run
    many requests at once: every answer is the request's own, none an error (C47, C8)."""
    app = echo_app(
        {
            "IDEMPOTENCY_DATABASE_URI": pg_url.render_as_string(hide_password=False),
            "IDEMPOTENCY_TABLE": records_table,
            "IDEMPOTENCY_CREATE_TABLE": True,
        }
    )
    assert run_requests(app, "parent", threads=8, per_thread=3) == []  # several pooled sockets
    children: list[tuple[int, int]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads (3.12+)
        for c in range(3):
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - reports through the pipe
                os.close(read_end)
                try:
                    found = run_requests(app, f"child{c}", threads=8, per_thread=25)
                except BaseException as exc:
                    found = [f"child crashed: {exc!r}"]
                os.write(write_end, json.dumps([*found[:20], len(found)]).encode())
                os._exit(0)
            os.close(write_end)
            children.append((pid, read_end))
    reports = []
    for pid, read_end in children:
        with os.fdopen(read_end, "rb") as pipe:
            reports.append(json.loads(pipe.read() or b"[-1]"))
        os.waitpid(pid, 0)
    assert [report[-1] for report in reports] == [0, 0, 0], reports
    assert run_requests(app, "parent-after", threads=4, per_thread=5) == []  # untouched


def _storm(server: GunicornServer, keys: int, duplicates: int, within: float) -> list[str]:
    """``keys`` × ``duplicates`` concurrent requests; what went wrong, if anything."""
    problems: list[str] = []

    def send(key: str) -> None:
        try:
            answer = requests.post(
                f"{server.url}/echo/x",
                json={"k": key},
                headers={"Idempotency-Key": key},
                timeout=within,
            )
        except requests.RequestException as exc:
            problems.append(f"{key}: {type(exc).__name__}")
            return
        data = answer.json() if answer.headers.get("content-type", "").endswith("json") else {}
        if answer.status_code != 201 or data.get("key") != key:
            problems.append(f"{key}: {answer.status_code} {answer.text[:200]}")

    names = [f"storm-{uuid.uuid4().hex[:8]}" for _ in range(keys)]
    with ThreadPoolExecutor(max_workers=keys * duplicates) as pool:
        list(pool.map(send, [name for name in names for _ in range(duplicates)]))
    return problems


@pytest.mark.slow
def test_i9_3_c47_gunicorn_preload_with_a_warm_up_request_in_the_master(
    pg_url: URL, records_table: str
) -> None:
    """``gunicorn --preload`` whose master sent a request (and created the table) before
    forking: the workers answer a duplicate storm with no crossed or failed answer (C47)."""
    env = {
        "DATABASE_URL": pg_url.render_as_string(hide_password=False),
        "IDEM_TABLE": records_table,
        "WARMUP": "1",
    }
    server = GunicornServer(
        "tests.apps.forkapp:create_app()", env=env, workers=3, threads=4, preload=True
    )
    with server:
        problems = _storm(server, keys=16, duplicates=4, within=60)
        problems += _storm(server, keys=16, duplicates=4, within=60)
    assert problems == [], server.final_log


@pytest.mark.slow
def test_i10_1_c47_gevent_preload_create_table_never_deadlocks(
    pg_url: URL, records_table: str
) -> None:
    """``gunicorn -k gevent --preload`` with the table auto-created and psycogreen: the
    first requests of each worker race to set the store up; none may stall the worker
    (no lock made before gevent patched ``threading`` is held across I/O; C47, C25)."""
    pytest.importorskip("gevent")
    pytest.importorskip("psycogreen")
    env = {
        "DATABASE_URL": pg_url.render_as_string(hide_password=False),
        "IDEM_TABLE": records_table,
        "PSYCOGREEN": "1",
    }
    server = GunicornServer(
        "tests.apps.forkapp:create_app()",
        env=env,
        workers=2,
        threads=1,
        worker_class="gevent",
        preload=True,
        timeout=15,
    )
    with server:
        problems = _storm(server, keys=12, duplicates=6, within=40)
        log = server.log()
    assert problems == [], log
    assert "WORKER TIMEOUT" not in log


# -- 9.8: no leak per short-lived app ---------------------------------------------------


def _listener_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "flask-idempotency-wakeups")


@pytest.mark.redis
@pytest.mark.parametrize("how", ["url", "client"])
def test_i9_8_c47_short_lived_apps_leak_no_listener_or_connection(
    pg_url: URL, records_table: str, redis_server: RedisServer, how: str
) -> None:
    """30 apps, each listening for wake-ups, then dropped: their listener threads stop and
    their Redis connections close (C47). ``url``: IDEMPOTENCY_REDIS_URL; ``client``: a new
    ``redis=`` client per app."""
    inspector = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    baseline_clients = len(inspector.client_list())
    baseline_threads = _listener_threads()
    config = {
        "IDEMPOTENCY_DATABASE_URI": pg_url.render_as_string(hide_password=False),
        "IDEMPOTENCY_TABLE": records_table,
        "IDEMPOTENCY_CREATE_TABLE": True,
    }
    for n in range(30):
        if how == "url":
            app = echo_app({**config, "IDEMPOTENCY_REDIS_URL": redis_server.url})
        else:
            app = echo_app(config, redis=redis.Redis.from_url(redis_server.url))
        assert run_requests(app, f"app{n}", threads=1, per_thread=1) == []
        state = app.extensions["idempotency"]
        hub = state.wakeups
        assert hub.channel.ensure_listening(hub) or hub.channel.listener.wait_until_live(10)
        state.store.engine.dispose()
        del app, state, hub
    gc.collect()
    wait_until(
        lambda: _listener_threads() <= baseline_threads,
        "the listeners of dropped apps to stop",
        within=15,
    )

    def connections() -> int:
        gc.collect()
        return len(inspector.client_list()) - baseline_clients

    wait_until(lambda: connections() <= 2, "the dropped apps' connections to close", within=15)
    assert listener.running_listeners() == []
    inspector.close()
