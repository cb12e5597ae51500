"""The deployment matrix: the extension under real gunicorn, as operators run it.

Each cell is black-box: ``tests/deploy/matrixapp.py`` under real gunicorn (the
records table auto-created), a storm of ``KEYS`` keys × ``DUPLICATES`` concurrent
duplicates, then one later retry per key. Every cell asserts (C8, C9, C11, C18,
C25): exactly one execution per key; every answer is the original, its replay
(same execution) or a documented problem+json 409 (``request-in-progress``) or
503 (``store-unavailable``, only where a cell breaks something); no other 5xx;
every retry replays; no record left ``in_progress``. Wake-up latency (original
finished → parked duplicate answered) is recorded per cell and written to
``build/deploy-matrix.json`` and ``build/deploy-matrix.md`` (or the directory
in ``DEPLOY_MATRIX_REPORT``).

Cells: worker class (sync, gthread, gevent) × driver (psycopg2, psycopg 3) ×
pooler (direct, PgBouncer in transaction mode); each worker class with
``--preload`` and a warm-up request in the master; gevent ``--preload`` with the
recommended wsgi module that patches first; two gunicorn hosts sharing
PostgreSQL and Redis; Redis restarted, and frozen (SIGSTOP) for 4 s, mid-load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import MetaData, func, select, text
from sqlalchemy.engine import URL, Engine

from flask_idempotency.store.connect import create_store_engine
from tests.conftest import driver_url
from tests.deploy.matrixapp import executions_table
from tests.support.gunicorn import REPO_ROOT, GunicornServer
from tests.support.pgbouncer import PgBouncer
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.redis, pytest.mark.heavy]


def shared_servers(item: pytest.Item) -> tuple[str, ...]:
    """Requested by name in each cell: one worker runs every cell (tests/support/parallel.py),
    so they share one PgBouncer and one Redis, and the report at the end gathers them all."""
    return ("pgbouncer", "matrix_redis")


KEYS = 6
DUPLICATES = 5
ORIGINAL_SLEEP = 0.5
WORKERS = 2
THREADS = 8
CLIENT_TIMEOUT = 15.0
PROBLEM = "application/problem+json"

APP = "tests.deploy.wsgi:application"
GEVENT_PATCHED_APP = "tests.deploy.gevent_wsgi:application"


@dataclasses.dataclass(frozen=True)
class Cell:
    worker: str
    driver: str = "psycopg2"
    pooler: str = "direct"
    preload: bool = False
    app: str = APP
    hosts: int = 1
    redis_fault: str | None = None

    @property
    def id(self) -> str:
        parts = [self.worker, "psycopg3" if self.driver == "psycopg" else self.driver, self.pooler]
        if self.preload:
            parts.append("preload")
        if self.app == GEVENT_PATCHED_APP:
            parts.append("patched-wsgi")
        if self.hosts > 1:
            parts.append(f"{self.hosts}hosts")
        if self.redis_fault:
            parts.append(f"redis-{self.redis_fault}")
        return "-".join(parts)

    @property
    def wait(self) -> float:
        # A sync worker holds its whole process while a duplicate waits: the documented
        # setting there is IDEMPOTENCY_WAIT = 0 (409 at once).
        if self.worker == "sync":
            return 0.0
        return 10.0 if self.redis_fault else 5.0


CELLS = [
    *(
        Cell(worker, driver, pooler)
        for worker in ("sync", "gthread", "gevent")
        for driver in ("psycopg2", "psycopg")
        for pooler in ("direct", "pgbouncer")
    ),
    Cell("sync", preload=True),
    Cell("gthread", preload=True),
    Cell("gthread", "psycopg", preload=True),
    Cell("gevent", "psycopg", preload=True),
    Cell("gevent", "psycopg", preload=True, app=GEVENT_PATCHED_APP),
    Cell("gthread", "psycopg", hosts=2),
    Cell("gthread", redis_fault="restart"),
    Cell("gthread", redis_fault="freeze"),
]

RESULTS: dict[str, dict[str, Any]] = {}


@dataclasses.dataclass
class Answer:
    key: str
    host: int
    sent: float
    received: float
    status: int
    content_type: str
    replayed: bool
    body: dict[str, Any]


def post(base: str, key: str, host: int, sleep: float) -> Answer:
    sent = time.time()
    try:
        response = requests.post(
            f"{base}/work/matrix",
            json={"key": key},
            headers={"Idempotency-Key": key, "X-Sleep": str(sleep)},
            timeout=CLIENT_TIMEOUT,
        )
    except requests.RequestException as exc:
        return Answer(key, host, sent, time.time(), 0, "", False, {"error": repr(exc)})
    try:
        body = response.json()
    except ValueError:
        body = {"raw": response.text[:300]}
    return Answer(
        key,
        host,
        sent,
        time.time(),
        response.status_code,
        response.headers.get("Content-Type", ""),
        response.headers.get("Idempotent-Replayed", "").lower() == "true",
        body,
    )


def storm(bases: list[str], keys: list[str], sleep: float) -> list[Answer]:
    """All keys × DUPLICATES requests at once (released by a barrier), spread over hosts."""
    jobs = [(key, n) for key in keys for n in range(DUPLICATES)]
    answers: list[Answer] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(jobs))

    def one(key: str, n: int) -> None:
        host = n % len(bases)
        barrier.wait(30)
        answer = post(bases[host], key, host, sleep)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=one, args=job, daemon=True) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT + 40)
    return answers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@pytest.fixture(scope="session")
def matrix_redis(redis_binary: str, session_tmp: Path) -> Iterator[RedisServer]:
    """One private redis-server shared by the cells that do not break Redis."""
    server = RedisServer(redis_binary, session_tmp / "redis-shared").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def admin_engine(pg_database: URL) -> Iterator[Engine]:
    engine = create_store_engine(pg_database.render_as_string(hide_password=False), pool_size=2)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="session", autouse=True)
def _write_report() -> Iterator[None]:
    started = time.monotonic()
    yield
    if not RESULTS:
        return
    directory = Path(os.environ.get("DEPLOY_MATRIX_REPORT", REPO_ROOT / "build"))
    directory.mkdir(parents=True, exist_ok=True)
    report = {
        "keys": KEYS,
        "duplicates": DUPLICATES,
        "workers_per_host": WORKERS,
        "original_sleep_s": ORIGINAL_SLEEP,
        "matrix_seconds": round(time.monotonic() - started, 1),
        "cells": RESULTS,
    }
    (directory / "deploy-matrix.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"Deployment matrix: {KEYS} keys × {DUPLICATES} concurrent duplicates per cell, "
        f"{WORKERS} workers per host; {report['matrix_seconds']} s in all.",
        "",
        "| cell | result | executions | replays | 409 | 503 | wake-up p50 ms | p99 ms | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, cell in sorted(RESULTS.items()):
        lines.append(
            f"| {name} | {cell['result']} | {cell.get('executions', '')} "
            f"| {cell.get('replays', '')} | {cell.get('409', '')} | {cell.get('503', '')} "
            f"| {cell.get('wakeup_p50_ms', '')} | {cell.get('wakeup_p99_ms', '')} "
            f"| {cell.get('seconds', '')} |"
        )
    (directory / "deploy-matrix.md").write_text("\n".join(lines) + "\n")


def database_url(cell: Cell, pg_database: URL, pgbouncer: Callable[[], PgBouncer]) -> URL:
    url = driver_url(pg_database, cell.driver)
    return pgbouncer().route(url) if cell.pooler == "pgbouncer" else url


@pytest.mark.parametrize("cell", CELLS, ids=[cell.id for cell in CELLS])
def test_i10_3_c8_c11_deployment_cell_runs_each_key_once(
    cell: Cell,
    request: pytest.FixtureRequest,
    pg_database: URL,
    admin_engine: Engine,
    redis_binary: str,
    session_tmp: Path,
) -> None:
    """C8, C9, C11, C25: one execution per key; replays or documented 409/503; none in progress."""
    started = time.monotonic()
    RESULTS[cell.id] = {"result": "failed"}
    table = f"idem_m_{uuid.uuid4().hex[:10]}"
    executions = executions_table(MetaData(), table)
    executions.create(admin_engine)
    own_redis: RedisServer | None = None
    servers: list[GunicornServer] = []
    try:
        if cell.redis_fault:
            own_redis = RedisServer(redis_binary, session_tmp / f"redis-{table}").start()
            redis = own_redis
        else:
            redis = request.getfixturevalue("matrix_redis")
        url = database_url(cell, pg_database, lambda: request.getfixturevalue("pgbouncer"))
        env = {
            "DATABASE_URL": url.render_as_string(hide_password=False),
            "IDEM_TABLE": table,
            "IDEM_WAIT": str(cell.wait),
            "REDIS_URL": redis.url,
            "DEPLOY_WARMUP": "1" if cell.preload else "0",
        }
        for _ in range(cell.hosts):
            servers.append(
                GunicornServer(
                    cell.app,
                    env=env,
                    workers=WORKERS,
                    threads=THREADS,
                    worker_class=cell.worker,
                    preload=cell.preload,
                    timeout=30,
                    extra_args=["--worker-connections", "200"] if cell.worker == "gevent" else [],
                ).start()
            )
        bases = [server.url for server in servers]
        keys = [f"{cell.id}-{n}-{uuid.uuid4().hex[:6]}" for n in range(KEYS)]
        sleep = 1.5 if cell.redis_fault else ORIGINAL_SLEEP

        fault: threading.Thread | None = None
        if own_redis is not None:
            fault = threading.Thread(target=break_redis, args=(own_redis, cell.redis_fault))
            fault.start()
        answers = storm(bases, keys, sleep)
        if fault is not None:
            fault.join(30)
        retries = [
            post(bases[n % len(bases)], key, n % len(bases), 0) for n, key in enumerate(keys)
        ]

        figures = check_cell(cell, keys, answers, retries, admin_engine, table, servers)
        RESULTS[cell.id] = {**figures, "result": "passed"}
    finally:
        RESULTS[cell.id]["seconds"] = round(time.monotonic() - started, 1)
        for server in servers:
            server.stop()
        if own_redis is not None:
            own_redis.stop()
        with admin_engine.begin() as conn:
            conn.execute(text(f'DROP TABLE IF EXISTS "{table}"'))
            conn.execute(text(f'DROP TABLE IF EXISTS "{table}_executions"'))


def break_redis(server: RedisServer, how: str | None) -> None:
    """Mid-load: while the originals run and their duplicates are parked."""
    time.sleep(0.5)
    if how == "restart":
        server.kill()
        time.sleep(0.5)
        server.start()
    elif how == "freeze":
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            time.sleep(4.0)
        finally:
            os.kill(server.pid, signal.SIGCONT)


def check_cell(
    cell: Cell,
    keys: list[str],
    answers: list[Answer],
    retries: list[Answer],
    engine: Engine,
    table: str,
    servers: list[GunicornServer],
) -> dict[str, Any]:
    full_logs = "\n".join(server.log() for server in servers)
    logs = full_logs[-6000:]
    if cell.app == GEVENT_PATCHED_APP:
        # The recommended gevent setup: patched before anything else was imported.
        assert "MonkeyPatchWarning" not in full_logs, logs
    elif cell.worker == "gevent" and cell.preload:
        # What docs/deployment.md says: -k gevent patches after a preloaded import.
        assert "MonkeyPatchWarning" in full_logs, logs
    assert len(answers) == KEYS * DUPLICATES, f"{len(answers)} answers came back\n{logs}"
    allowed = {201, 409, 503} if cell.redis_fault else {201, 409}
    wrong = [a for a in answers + retries if a.status not in allowed]
    assert not wrong, f"{len(wrong)} unexpected answers, e.g. {wrong[:3]}\n{logs}"
    problems = [a for a in answers if a.status != 201]
    assert all(a.content_type.startswith(PROBLEM) for a in problems), problems[:3]
    assert all(
        a.body.get("code") == ("request-in-progress" if a.status == 409 else "store-unavailable")
        for a in problems
    ), problems[:3]

    executions = executions_table(MetaData(), table)
    with engine.connect() as conn:
        counts = dict(
            conn.execute(
                select(executions.c.idem_key, func.count())
                .where(executions.c.idem_key.in_(keys))
                .group_by(executions.c.idem_key)
            ).all()
        )
        states = dict(
            conn.execute(text(f'SELECT state, count(*) FROM "{table}" GROUP BY state')).all()
        )
    assert counts == dict.fromkeys(keys, 1), f"executions per key: {counts}\n{logs}"

    originals: dict[str, Answer] = {}
    for answer in answers:
        if answer.status == 201 and not answer.replayed:
            assert answer.key not in originals, f"two originals for {answer.key}"
            originals[answer.key] = answer
    for answer in answers + retries:
        if answer.status == 201:
            assert answer.body["execution"] == originals_execution(originals, answer, retries)
    for retry in retries:
        assert retry.status == 201 and retry.replayed, f"retry not replayed: {retry}\n{logs}"
    assert set(states) == {"completed"}, f"records left behind: {states}"

    wakeups = [
        (a.received - a.body["finished_at"]) * 1000
        for a in answers
        if a.status == 201 and a.replayed and a.sent < a.body["finished_at"]
    ]
    figures: dict[str, Any] = {
        "executions": sum(counts.values()),
        "replays": sum(1 for a in answers if a.status == 201 and a.replayed),
        "409": sum(1 for a in answers if a.status == 409),
        "503": sum(1 for a in answers if a.status == 503),
        "parked_replays": len(wakeups),
    }
    if cell.worker == "gevent":
        figures["monkey_patch_warning"] = "MonkeyPatchWarning" in full_logs
    if wakeups:
        figures["wakeup_p50_ms"] = round(statistics.median(wakeups), 1)
        figures["wakeup_p99_ms"] = round(percentile(wakeups, 99), 1)
        figures["wakeup_max_ms"] = round(max(wakeups), 1)
    return figures


def originals_execution(originals: dict[str, Answer], answer: Answer, retries: list[Answer]) -> Any:
    """The execution every 201 for ``answer.key`` must carry: the original's."""
    original = originals.get(answer.key)
    if original is not None:
        return original.body["execution"]
    # The original's own answer may have been a 503 (Redis cell) - the retry's replay decides.
    return next(r.body["execution"] for r in retries if r.key == answer.key)
