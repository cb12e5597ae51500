# ruff: noqa: E501 - Markdown prose and table rows of the report read better unbroken
"""``make bench``: what Flask-Idempotency costs, as ratios to a bare Flask route.

    .venv/bin/python bench/run.py [--rounds 7] [--per-round 300] [--quick]

Everything is measured in one run against real PostgreSQL and a private
redis-server, on a noisy shared machine. That is why every figure is a ratio
to the bare route measured in the same run, the paths are interleaved (each
round runs every path once, in a shuffled order), each figure is the median of
several rounds, and the spread across rounds is reported next to it.

1. In-process latency: each request is a prepared WSGI environ handed to the
   app's ``wsgi_app``, the same harness for every path, ours and idemkit's.
   Plus the floor on this machine: one Redis GET, one PostgreSQL upsert+commit.
2. Wake-up latency under gunicorn: a slow original, duplicates parked in other
   workers, time from the original's response to each duplicate's response.
3. Throughput under gunicorn (``wrk`` on loopback): replay-heavy mix, all new keys.
4. The same paths for idemkit 1.0.2 (WSGI middleware around the same app).
5. Replay-from-PostgreSQL latency with 1,000 and 1,000,000 stored records.

Writes ``bench/results/RESULTS.md``, ``results.json`` and ``latency.png``.
Servers bind 127.0.0.1 on free ports and are stopped by pid, also on failure;
the private database is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import http.client
import io
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sqlalchemy import create_engine, select, text  # noqa: E402
from sqlalchemy.dialects import postgresql  # noqa: E402
from sqlalchemy.engine import URL, make_url  # noqa: E402
from werkzeug.test import EnvironBuilder  # noqa: E402

from bench.benchapp import asyncpg_url, create_app  # noqa: E402
from flask_idempotency.extension import create_store_engine  # noqa: E402
from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest  # noqa: E402
from flask_idempotency.records import IN_PROGRESS  # noqa: E402
from flask_idempotency.store import DurableStore  # noqa: E402
from flask_idempotency.table import db_now_ms  # noqa: E402
from tests.support.gunicorn import GunicornServer  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

RESULTS = REPO / "bench" / "results"
BODY = json.dumps({"amount_cents": 1999, "currency": "EUR", "customer": "cus_42"}).encode()
TARGET_REPLAY_REDIS = 1.3
TARGET_FIRST = 2.5
TARGET_WAKE_P50_MS = 5.0
TARGET_WAKE_P99_MS = 25.0
OURS, IDEMKIT = "Flask-Idempotency", "idemkit 1.0.2"


# -- services ------------------------------------------------------------------------


@contextmanager
def private_database(base_url: str) -> Iterator[str]:
    """A fresh database on the server, dropped afterwards (also after a failure)."""
    base: URL = make_url(base_url)
    admin = create_engine(base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    name = f"idem_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of our own: nobody else's FLUSHALL can touch the cached records."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench: redis-server is not on PATH")
    with tempfile.TemporaryDirectory(prefix="idem-bench-redis-") as directory:
        server = RedisServer(binary, Path(directory)).start()
        try:
            yield server
        finally:
            server.stop()


def versions(db_url: str, redis_url: str) -> dict[str, str]:
    import redis

    engine = create_engine(db_url)
    with engine.connect() as conn:
        pg = conn.execute(text("SHOW server_version")).scalar_one()
    engine.dispose()
    info = redis.Redis.from_url(redis_url).info("server")
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    from importlib.metadata import version

    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "postgresql": str(pg).split()[0],
        "redis": str(info["redis_version"]),
        "flask": version("flask"),
        "sqlalchemy": version("sqlalchemy"),
        "redis-py": version("redis"),
        "idemkit": version("idemkit"),
        "gunicorn": version("gunicorn"),
        "kernel": platform.release(),
    }


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# -- tables ----------------------------------------------------------------------------


def create_our_table(db_url: str, table: str) -> DurableStore:
    engine = create_store_engine(db_url)
    store = DurableStore(lambda: engine, table_name=table)
    store.create_table()
    return store


def create_idemkit_table(db_url: str, table: str) -> None:
    from idemkit.backends.postgres import init_pg

    asyncio.run(init_pg(asyncpg_url(db_url), table=table))


def fill_records(store: DurableStore, template_digest: str, rows: int) -> float:
    """Add ``rows`` completed records for keys ``lk-1 … lk-<rows>``, as the app would name them.

    The digest is computed in SQL exactly as ``key_digest(scope, key)`` does
    (length-prefixed SHA-256), and the fingerprint and response are copied from
    a record the app really stored, so every filler row replays like a real one.
    """
    t = store.table.name
    started = time.perf_counter()
    sql = f"""
        INSERT INTO {t} (key_digest, scope, fingerprint, method, path, state,
                         created_at_ms, expires_at_ms, completed_at_ms,
                         response_status, response_headers, response_body, body_omitted)
        SELECT encode(sha256(int8send(4) || 'key1'::bytea
                             || int8send(octet_length(:scope)) || convert_to(:scope, 'UTF8')
                             || int8send(octet_length(k)) || convert_to(k, 'UTF8')), 'hex'),
               r.scope, r.fingerprint, r.method, r.path, r.state,
               r.created_at_ms, r.expires_at_ms, r.completed_at_ms,
               r.response_status, r.response_headers, r.response_body, r.body_omitted
        FROM (SELECT 'lk-' || i AS k FROM generate_series(1, :rows) AS i) AS keys,
             (SELECT * FROM {t} WHERE key_digest = :template) AS r
    """
    with store.engine.begin() as conn:
        conn.execute(
            text(sql), {"scope": ANONYMOUS_SCOPE, "rows": rows, "template": template_digest}
        )
    with store.autocommit.connect() as conn:
        conn.execute(text(f"VACUUM ANALYZE {t}"))
        probe = key_digest(ANONYMOUS_SCOPE, f"lk-{rows}")
        found = conn.execute(text(f"SELECT count(*) FROM {t} WHERE key_digest = :d"), {"d": probe})
        assert found.scalar_one() == 1, "the SQL digest must match key_digest()"
    return time.perf_counter() - started


# -- the in-process harness ----------------------------------------------------------------


class WsgiCaller:
    """One prepared request; each call copies the environ, hands it to the app, drains the body."""

    def __init__(self, app: Any, path: str) -> None:
        self.app = app
        self.base = EnvironBuilder(
            path=path, method="POST", data=BODY, content_type="application/json"
        ).get_environ()
        self.status = ""
        self.headers: list[tuple[str, str]] = []

    def _start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Any:
        self.status, self.headers = status, headers
        return lambda data: None

    def __call__(self, key: str | None) -> int:
        environ = dict(self.base)
        environ["wsgi.input"] = io.BytesIO(BODY)
        if key is not None:
            environ["HTTP_IDEMPOTENCY_KEY"] = key
        started = time.perf_counter_ns()
        result = self.app(environ, self._start_response)
        try:
            for _ in result:
                pass
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        return time.perf_counter_ns() - started

    def replayed(self) -> bool:
        return any(
            name.lower() in ("idempotent-replayed", "idempotency-replayed") and value == "true"
            for name, value in self.headers
        )


@dataclass
class Path_:
    """One measured path: how to take one sample, and what a correct answer looks like."""

    name: str
    label: str
    library: str
    sample: Callable[[], int]
    check: Callable[[], None] = lambda: None
    samples: list[list[int]] = field(default_factory=list)  # ns, one list per round


def wsgi_path(
    name: str,
    label: str,
    library: str,
    caller: WsgiCaller,
    keys: Callable[[], str | None],
    replay: bool | None,
) -> Path_:
    def check() -> None:
        assert caller.status.startswith("201"), f"{name}: got {caller.status}"
        if replay is not None:
            assert caller.replayed() == replay, f"{name}: replayed={caller.replayed()}"

    return Path_(name, label, library, lambda: caller(keys()), check)


def counter_keys(prefix: str) -> Callable[[], str]:
    n = iter(range(10**9))
    run = uuid.uuid4().hex[:8]
    return lambda: f"{prefix}-{run}-{next(n)}"


def build_inprocess_paths(
    db_url: str, redis_url: str, big_rows: int
) -> tuple[list[Path_], dict[str, Any], list[Any]]:
    import redis

    notes: dict[str, Any] = {}
    for table in ("idem_redis", "idem_pg", "idem_small", "idem_big"):
        create_our_table(db_url, table)
    for table in ("ik_inproc",):
        create_idemkit_table(db_url, table)

    ours_redis = create_app("ours", database_url=db_url, redis_url=redis_url, table="idem_redis")
    ours_pg = create_app("ours", database_url=db_url, table="idem_pg")
    plain = create_app("plain")
    ik_redis = create_app("idemkit-redis", redis_url=redis_url, table="ik_inproc")
    ik_pg = create_app("idemkit-pg", database_url=db_url, table="ik_inproc")

    # The records the replay paths replay, stored by a first request each.
    fixed = {}
    for name, app in (
        ("ours_redis", ours_redis),
        ("ours_pg", ours_pg),
        ("ik_redis", ik_redis),
        ("ik_pg", ik_pg),
    ):
        fixed[name] = f"replay-{name}-{uuid.uuid4().hex[:8]}"
        caller = WsgiCaller(app, "/pay")
        caller(fixed[name])
        assert caller.status.startswith("201") and not caller.replayed(), (name, caller.status)

    # Lookup scale: 1,000 vs 1,000,000 records, replayed at random keys.
    scale_apps = {}
    for table, rows in (("idem_small", 1000), ("idem_big", big_rows)):
        app = create_app("ours", database_url=db_url, table=table)
        caller = WsgiCaller(app, "/pay")
        caller("lk-0")
        store = app.extensions["idempotency"].store
        seconds = fill_records(store, key_digest(ANONYMOUS_SCOPE, "lk-0"), rows)
        notes[f"fill_{table}"] = {"rows": rows + 1, "seconds": round(seconds, 1)}
        scale_apps[table] = (app, rows)

    rng = random.Random(1)
    paths = [
        wsgi_path(
            "bare",
            "bare route (same app, no key)",
            "Flask",
            WsgiCaller(ours_redis, "/bare"),
            lambda: None,
            False,
        ),
        wsgi_path(
            "bare-plain",
            "bare route, app without any idempotency",
            "Flask",
            WsgiCaller(plain, "/bare"),
            lambda: None,
            False,
        ),
        wsgi_path(
            "replay-redis",
            "replay from Redis",
            OURS,
            WsgiCaller(ours_redis, "/pay"),
            lambda: fixed["ours_redis"],
            True,
        ),
        wsgi_path(
            "replay-pg",
            "replay from PostgreSQL (no Redis)",
            OURS,
            WsgiCaller(ours_pg, "/pay"),
            lambda: fixed["ours_pg"],
            True,
        ),
        wsgi_path(
            "first-redis",
            "first execution, PostgreSQL + Redis",
            OURS,
            WsgiCaller(ours_redis, "/pay"),
            counter_keys("new-r"),
            False,
        ),
        wsgi_path(
            "first-pg",
            "first execution, PostgreSQL only",
            OURS,
            WsgiCaller(ours_pg, "/pay"),
            counter_keys("new-p"),
            False,
        ),
        wsgi_path(
            "ik-bare",
            "bare route through its middleware (no key)",
            IDEMKIT,
            WsgiCaller(ik_redis, "/bare"),
            lambda: None,
            False,
        ),
        wsgi_path(
            "ik-replay-redis",
            "replay, Redis backend",
            IDEMKIT,
            WsgiCaller(ik_redis, "/pay"),
            lambda: fixed["ik_redis"],
            True,
        ),
        wsgi_path(
            "ik-replay-pg",
            "replay, PostgreSQL backend",
            IDEMKIT,
            WsgiCaller(ik_pg, "/pay"),
            lambda: fixed["ik_pg"],
            True,
        ),
        wsgi_path(
            "ik-first-redis",
            "first execution, Redis backend",
            IDEMKIT,
            WsgiCaller(ik_redis, "/pay"),
            counter_keys("ikn-r"),
            False,
        ),
        wsgi_path(
            "ik-first-pg",
            "first execution, PostgreSQL backend",
            IDEMKIT,
            WsgiCaller(ik_pg, "/pay"),
            counter_keys("ikn-p"),
            False,
        ),
    ]
    for table, label in (("idem_small", "1k"), ("idem_big", "1M")):
        app, rows = scale_apps[table]
        paths.append(
            wsgi_path(
                f"replay-pg-{label}",
                f"replay from PostgreSQL, {rows + 1:,} records, random key",
                OURS,
                WsgiCaller(app, "/pay"),
                lambda rows=rows: f"lk-{rng.randint(1, rows)}",
                True,
            )
        )

    # The floor: one Redis GET of a cached record, one claim-shaped upsert + commit.
    client = redis.Redis.from_url(redis_url)
    cached_name = ours_redis.extensions["idempotency"].cache.record_name(
        key_digest(ANONYMOUS_SCOPE, fixed["ours_redis"])
    )
    assert client.get(cached_name) is not None, "the replayed record must be in Redis"

    def redis_get() -> int:
        started = time.perf_counter_ns()
        client.get(cached_name)
        return time.perf_counter_ns() - started

    floor_store = create_our_table(db_url, "idem_floor")
    floor_keys = counter_keys("floor")
    t = floor_store.table

    def pg_upsert() -> int:
        digest = key_digest(ANONYMOUS_SCOPE, floor_keys())
        now = db_now_ms()
        stmt = (
            postgresql.insert(t)
            .values(
                key_digest=digest,
                scope=ANONYMOUS_SCOPE,
                fingerprint="0" * 64,
                method="POST",
                path="/pay",
                state=IN_PROGRESS,
                lock_token=uuid.uuid4().hex,
                created_at_ms=now,
                expires_at_ms=now + 86_400_000,
                lease_expires_at_ms=now + 60_000,
            )
            .on_conflict_do_nothing(index_elements=[t.c.key_digest])
            .returning(t.c.id, t.c.expires_at_ms)
        )
        started = time.perf_counter_ns()
        with floor_store.autocommit.connect() as conn:
            conn.execute(stmt).first()
        return time.perf_counter_ns() - started

    def pg_select() -> int:
        stmt = select(t.c.id).where(t.c.key_digest == key_digest(ANONYMOUS_SCOPE, "nothing"))
        started = time.perf_counter_ns()
        with floor_store.autocommit.connect() as conn:
            conn.execute(stmt).first()
        return time.perf_counter_ns() - started

    paths += [
        Path_("floor-redis-get", "floor: one Redis GET (redis-py)", "floor", redis_get),
        Path_(
            "floor-pg-upsert",
            "floor: one PostgreSQL upsert + commit (SQLAlchemy)",
            "floor",
            pg_upsert,
        ),
        Path_(
            "floor-pg-select",
            "floor: one PostgreSQL SELECT by key (SQLAlchemy)",
            "floor",
            pg_select,
        ),
    ]
    backends = [ik_redis.wsgi_app.app.backend, ik_pg.wsgi_app.app.backend]
    return paths, notes, backends


def close_idemkit(backends: list[Any]) -> None:
    """Close idemkit's pools on its own loop now, before the private database is dropped."""
    from idemkit.core.sync_bridge import run_sync

    for backend in backends:
        run_sync(backend.aclose())


def run_inprocess(
    paths: list[Path_],
    rounds: int,
    per_round: int,
    warmup: int,
    block_seconds: float,
    what: str = "in-process",
) -> None:
    """Warm every path up (checking its answers), then ``rounds`` interleaved rounds."""
    for path in paths:
        for _ in range(warmup):
            path.sample()
            path.check()
    rng = random.Random(42)
    for r in range(rounds):
        order = list(paths)
        rng.shuffle(order)
        for path in order:
            gc.collect()
            block: list[int] = []
            deadline = time.monotonic() + block_seconds
            while len(block) < per_round and time.monotonic() < deadline:
                block.append(path.sample())
            path.check()
            path.samples.append(block)
        print(f"  {what} round {r + 1}/{rounds} done (load {loadavg()})", flush=True)


# -- statistics --------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: every figure is a measured one)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def summarise(path: Path_, baseline: Path_) -> dict[str, Any]:
    per_round_p50 = [statistics.median(block) / 1000 for block in path.samples]  # µs
    base_p50 = [statistics.median(block) / 1000 for block in baseline.samples]
    ratios = [p / b for p, b in zip(per_round_p50, base_p50, strict=False)]
    pooled = [v / 1000 for block in path.samples for v in block]
    p50 = statistics.median(per_round_p50)
    return {
        "name": path.name,
        "label": path.label,
        "library": path.library,
        "n": len(pooled),
        "p50_us": p50,
        "p99_us": percentile(pooled, 99),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "p50_spread_pct": 100 * (max(per_round_p50) - min(per_round_p50)) / p50,
        "round_p50_us": per_round_p50,
    }


# -- gunicorn: wake-up latency and throughput ---------------------------------------------


def post(
    port: int,
    key: str | None,
    *,
    path: str = "/pay",
    sleep: float | None = None,
    timeout: float = 20,
) -> tuple[float, int, dict[str, str]]:
    """One request on a fresh connection (so gunicorn may give it to any worker)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if sleep is not None:
        headers["X-Sleep"] = str(sleep)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=BODY, headers=headers)
        response = conn.getresponse()
        response.read()
        done = time.perf_counter()
        return done, response.status, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


class KeepAlive:
    """One persistent HTTP/1.1 connection: sequential requests, timed at the client."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        self.last_used = 0.0

    def __call__(self, path: str, key: str | None, expect_replay: bool | None) -> int:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        if time.monotonic() - self.last_used > 1.0:
            # gunicorn closes idle keep-alive connections after 2 s: connect afresh, untimed.
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
            self.conn.connect()
        started = time.perf_counter_ns()
        self.conn.request("POST", path, body=BODY, headers=headers)
        response = self.conn.getresponse()
        response.read()
        elapsed = time.perf_counter_ns() - started
        self.last_used = time.monotonic()
        assert response.status == 201, (path, response.status)
        if expect_replay is not None:
            replayed = (
                response.getheader("Idempotent-Replayed")
                or response.getheader("Idempotency-Replayed")
            ) == "true"
            assert replayed == expect_replay, (path, key, replayed)
        return elapsed

    def close(self) -> None:
        self.conn.close()


def build_http_paths(servers: list[Server]) -> tuple[list[Path_], list[KeepAlive]]:
    """Sequential requests over keep-alive connections: the latency one client sees."""
    by_key = {s.key: s for s in servers}
    clients: list[KeepAlive] = []
    paths: list[Path_] = []

    def add(
        name: str,
        label: str,
        library: str,
        server: str,
        path: str,
        keys: Callable[[], str | None],
        replay: bool | None,
    ) -> None:
        client = KeepAlive(by_key[server].gunicorn.port)
        clients.append(client)
        paths.append(Path_(name, label, library, lambda: client(path, keys(), replay)))

    fixed = {}
    for server in servers:
        fixed[server.key] = f"http-replay-{uuid.uuid4().hex[:8]}"
        post(server.gunicorn.port, fixed[server.key])
    add(
        "http-bare",
        "bare route (same server, no key)",
        "Flask",
        "ours",
        "/bare",
        lambda: None,
        False,
    )
    add("http-replay-redis", "replay from Redis", OURS, "ours", "/pay", lambda: fixed["ours"], True)
    add(
        "http-first-redis",
        "first execution, PostgreSQL + Redis",
        OURS,
        "ours",
        "/pay",
        counter_keys("hn"),
        False,
    )
    add(
        "http-ik-replay-redis",
        "replay, Redis backend",
        IDEMKIT,
        "ik-redis",
        "/pay",
        lambda: fixed["ik-redis"],
        True,
    )
    add(
        "http-ik-first-redis",
        "first execution, Redis backend",
        IDEMKIT,
        "ik-redis",
        "/pay",
        counter_keys("hkr"),
        False,
    )
    add(
        "http-ik-replay-pg",
        "replay, PostgreSQL backend",
        IDEMKIT,
        "ik-pg",
        "/pay",
        lambda: fixed["ik-pg"],
        True,
    )
    add(
        "http-ik-first-pg",
        "first execution, PostgreSQL backend",
        IDEMKIT,
        "ik-pg",
        "/pay",
        counter_keys("hkp"),
        False,
    )
    return paths, clients


@dataclass
class WakeSample:
    library: str
    ms: float
    cross_worker: bool
    ok: bool


def wake_trial(
    library: str, port: int, duplicates: int, original_sleep: float, head_start: float
) -> list[WakeSample]:
    """A slow original, then ``duplicates`` copies while it runs; each one's delay after it."""
    key = f"wake-{uuid.uuid4().hex}"
    original: dict[str, Any] = {}
    answers: list[tuple[float, int, dict[str, str]] | None] = [None] * duplicates

    def run_original() -> None:
        original["result"] = post(port, key, sleep=original_sleep)

    def run_duplicate(i: int, go: threading.Event) -> None:
        go.wait()
        answers[i] = post(port, key)

    go = threading.Event()
    threads = [threading.Thread(target=run_duplicate, args=(i, go)) for i in range(duplicates)]
    for thread in threads:
        thread.start()
    first = threading.Thread(target=run_original)
    first.start()
    time.sleep(head_start)
    go.set()
    first.join()
    for thread in threads:
        thread.join()
    done, status, headers = original["result"]
    assert status == 201, f"{library}: original got {status}"
    samples = []
    for answer in answers:
        assert answer is not None
        t, dup_status, dup_headers = answer
        replayed = (
            dup_headers.get("idempotent-replayed") == "true"
            or dup_headers.get("idempotency-replayed") == "true"
        )
        samples.append(
            WakeSample(
                library,
                (t - done) * 1000,
                dup_headers.get("x-worker-pid") != headers.get("x-worker-pid"),
                dup_status == 201 and replayed,
            )
        )
    return samples


WRK_SCRIPT = r"""
local counter = 0
local tid = 0
local threads = {}
setup = function(thread)
  thread:set("tid", tid)
  tid = tid + 1
  table.insert(threads, thread)
end
init = function(args)
  mode = args[1]
  prefix = args[2]
  replay_keys = tonumber(args[3])
  new_share = tonumber(args[4])
  body = args[5]
  math.randomseed(os.time() * 100 + tid)
end
request = function()
  local headers = {["Content-Type"] = "application/json"}
  local path = "/pay"
  if mode == "bare" then
    path = "/bare"
  elseif mode == "new" or math.random() < new_share then
    counter = counter + 1
    headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. counter
  else
    headers["Idempotency-Key"] = "mix-" .. math.random(1, replay_keys)
  end
  return wrk.format("POST", path, headers, body)
end
done = function(summary, latency, requests)
  io.write(string.format("WRKJSON {\"requests\":%d,\"duration_us\":%d,\"non2xx\":%d,\"errors\":%d,\"p50_us\":%d,\"p99_us\":%d}\n",
    summary.requests, summary.duration, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def wrk_run(
    script: Path,
    port: int,
    mode: str,
    seconds: float,
    connections: int,
    replay_keys: int,
    new_share: float,
) -> dict[str, Any]:
    command = [
        "wrk",
        "-t2",
        f"-c{connections}",
        f"-d{seconds:g}s",
        "--timeout",
        "10s",
        "-s",
        str(script),
        f"http://127.0.0.1:{port}",
        "--",
        mode,
        f"k{uuid.uuid4().hex[:8]}",
        str(replay_keys),
        str(new_share),
        BODY.decode(),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=seconds + 30, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("WRKJSON "):
            result: dict[str, Any] = json.loads(line[len("WRKJSON ") :])
            result["rps"] = result["requests"] / (result["duration_us"] / 1e6)
            return result
    raise RuntimeError(f"wrk gave no result: {done.stdout}\n{done.stderr}")


@dataclass
class Server:
    key: str
    library: str
    mode: str
    gunicorn: GunicornServer


def start_servers(db_url: str, redis_url: str, workers: int, threads: int) -> list[Server]:
    create_our_table(db_url, "idem_gunicorn")
    create_idemkit_table(db_url, "ik_gunicorn")
    specs = [
        ("ours", OURS, "ours", {"BENCH_TABLE": "idem_gunicorn", "REDIS_URL": redis_url}),
        (
            "ik-redis",
            IDEMKIT,
            "idemkit-redis",
            {"BENCH_TABLE": "ik_gunicorn", "REDIS_URL": redis_url},
        ),
        ("ik-pg", IDEMKIT, "idemkit-pg", {"BENCH_TABLE": "ik_gunicorn"}),
    ]
    servers: list[Server] = []
    try:
        for key, library, mode, env in specs:
            gunicorn = GunicornServer(
                "bench.benchapp:from_env()",
                env={"BENCH_MODE": mode, "DATABASE_URL": db_url, "BENCH_WAIT": "5", **env},
                workers=workers,
                threads=threads,
            )
            servers.append(Server(key, library, mode, gunicorn))
            gunicorn.start()
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: list[Server]) -> None:
    for server in servers:
        server.gunicorn.stop()


def run_wake(servers: list[Server], trials: int, duplicates: int) -> dict[str, list[WakeSample]]:
    out: dict[str, list[WakeSample]] = {s.key: [] for s in servers}
    rng = random.Random(7)
    for server in servers:  # warm-up: start each worker's subscriber, open its pools
        for _ in range(2):
            wake_trial(server.key, server.gunicorn.port, duplicates, 0.3, 0.1)
    for trial in range(trials):
        order = list(servers)
        rng.shuffle(order)
        for server in order:
            out[server.key] += wake_trial(server.key, server.gunicorn.port, duplicates, 0.3, 0.1)
        if (trial + 1) % 10 == 0:
            print(f"  wake-up trial {trial + 1}/{trials} done (load {loadavg()})", flush=True)
    return out


def summarise_wake(samples: list[WakeSample]) -> dict[str, Any]:
    good = [s for s in samples if s.ok]
    cross = [s.ms for s in good if s.cross_worker]
    every = [s.ms for s in good]
    return {
        "duplicates": len(samples),
        "replayed": len(good),
        "cross_worker": len(cross),
        "cross_p50_ms": statistics.median(cross) if cross else None,
        "cross_p99_ms": percentile(cross, 99) if cross else None,
        "all_p50_ms": statistics.median(every) if every else None,
        "all_p99_ms": percentile(every, 99) if every else None,
        "all_max_ms": max(every) if every else None,
    }


def run_throughput(
    servers: list[Server],
    rounds: int,
    seconds: float,
    connections: int,
    replay_keys: int,
    new_share: float,
) -> dict[str, Any]:
    script = Path(tempfile.mkstemp(prefix="idem-bench-", suffix=".lua")[1])
    script.write_text(WRK_SCRIPT)
    try:
        for server in servers:  # the records the replay-heavy mix replays
            for i in range(1, replay_keys + 1):
                _, status, _ = post(server.gunicorn.port, f"mix-{i}")
                assert status == 201, (server.key, status)
        by_key = {s.key: s for s in servers}
        cells = [
            ("ours", "bare"),
            ("ours", "mix"),
            ("ours", "new"),
            ("ik-redis", "bare"),
            ("ik-redis", "mix"),
            ("ik-redis", "new"),
            ("ik-pg", "mix"),
            ("ik-pg", "new"),
        ]
        runs: dict[str, list[dict[str, Any]]] = {f"{s}:{m}": [] for s, m in cells}
        rng = random.Random(11)
        for r in range(rounds):
            order = list(cells)
            rng.shuffle(order)
            for server_key, mode in order:
                port = by_key[server_key].gunicorn.port
                runs[f"{server_key}:{mode}"].append(
                    wrk_run(script, port, mode, seconds, connections, replay_keys, new_share)
                )
            print(f"  throughput round {r + 1}/{rounds} done (load {loadavg()})", flush=True)
    finally:
        script.unlink(missing_ok=True)
    base = [run["rps"] for run in runs["ours:bare"]]
    summary = {}
    for cell, results in runs.items():
        rps = [run["rps"] for run in results]
        ratios = [x / b for x, b in zip(rps, base, strict=False)]
        summary[cell] = {
            "rps": statistics.median(rps),
            "rps_rounds": rps,
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "p50_ms": statistics.median(run["p50_us"] for run in results) / 1000,
            "p99_ms": statistics.median(run["p99_us"] for run in results) / 1000,
            "non2xx": sum(run["non2xx"] for run in results),
            "errors": sum(run["errors"] for run in results),
        }
    return summary


# -- output ------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def write_markdown(
    out: Path,
    meta: dict[str, Any],
    inproc: list[dict[str, Any]],
    http_rows: list[dict[str, Any]],
    wake: dict[str, Any],
    throughput: dict[str, Any] | None,
    notes: dict[str, Any],
) -> str:
    v = meta["versions"]
    by = {row["name"]: row for row in inproc}
    bare = by["bare"]
    floor_redis = 1 + by["floor-redis-get"]["p50_us"] / bare["p50_us"]
    floor_first = 1 + by["floor-pg-upsert"]["p50_us"] / bare["p50_us"]
    targets = {
        "replay-redis": (
            TARGET_REPLAY_REDIS,
            f"≤ {TARGET_REPLAY_REDIS}× (floor {floor_redis:.2f}×)",
        ),
        "first-redis": (TARGET_FIRST, f"≤ {TARGET_FIRST}×"),
        "first-pg": (TARGET_FIRST, f"≤ {TARGET_FIRST}×"),
    }
    lines = [
        "# Flask-Idempotency benchmarks",
        "",
        f"Run {meta['date']} by `make bench` (`bench/run.py`), {meta['seconds']:.0f} s in all.",
        "",
        (
            f"**Machine:** {v['cpu']}, {v['cores']} cores, Linux {v['kernel']}; Python {v['python']},"
            f" PostgreSQL {v['postgresql']}, Redis {v['redis']}; Flask {v['flask']}, SQLAlchemy {v['sqlalchemy']},"
            f" redis-py {v['redis-py']}, gunicorn {v['gunicorn']}, idemkit {v['idemkit']}."
        ),
        (
            f"Shared and noisy: load average {meta['load_before']} before, {meta['load_after']} after"
            " (other test suites ran at the same time)."
        ),
        "",
        (
            f"**Noise:** the bare route's p50 ranged {min(bare['round_p50_us']):.0f}–{max(bare['round_p50_us']):.0f} µs"
            f" across {meta['rounds']} rounds (spread {bare['p50_spread_pct']:.0f}% of its median)."
            " Each ratio is the median over rounds of (path p50 / bare p50 in the same round); its range"
            " over the rounds is shown next to it."
        ),
        "",
        "## Targets",
        "",
        *target_lines(by, http_rows, wake, floor_redis, floor_first),
        "",
        "## 1. In-process latency (WSGI call, same harness for every path)",
        "",
        (
            f"{meta['rounds']} interleaved rounds × {meta['per_round']} requests per path (shuffled order each round)."
            " p50 = median of the per-round medians; p99 = over all rounds' samples."
            " PostgreSQL is the durable store for every path of ours; replays from Redis read"
            " the cached copy of a completed record."
        ),
        "",
        "| library | path | p50 µs | p99 µs | ratio to bare p50 | ratio range (rounds) | p50 spread | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in inproc:
        target = ""
        if row["name"] in targets:
            limit, text_ = targets[row["name"]]
            target = f"{text_}: {verdict(row['ratio'] <= limit)}"
        lines.append(
            f"| {row['library']} | {row['label']} | {row['p50_us']:,.0f} | {row['p99_us']:,.0f} |"
            f" {row['ratio']:.2f}× | {row['ratio_min']:.2f}–{row['ratio_max']:.2f}× |"
            f" {row['p50_spread_pct']:.0f}% | {target} |"
        )
    lines += [
        "",
        (
            f"Floor on this machine, same run: bare + one Redis GET = **{floor_redis:.2f}×** bare"
            f" (the least a replay from Redis can cost); bare + one upsert+commit = **{floor_first:.2f}×**"
            " (a first execution also needs a second statement, the fenced completion)."
        ),
        "",
        "Records for the lookup rows: "
        + ", ".join(
            f"{k[5:]}: {n['rows']:,} rows loaded in {n['seconds']} s"
            for k, n in notes.items()
            if k.startswith("fill_")
        )
        + " (INSERT … SELECT generate_series, then VACUUM ANALYZE); each replay picks a random stored key.",
        "",
        "## 2. HTTP latency, one client (gunicorn)",
        "",
    ]
    if not http_rows:
        lines.append("Not run (`--inprocess-only`).")
    else:
        lines += [
            (
                f"Sequential requests on one keep-alive connection per path, {meta['rounds']} interleaved rounds ×"
                f" {meta['http_per_round']} requests; the servers of §3 ({meta['workers']} workers ×"
                f" {meta['threads']} threads). The bare route here includes the HTTP round trip and gunicorn,"
                " which is what a client compares against."
            ),
            "",
            "| library | path | p50 µs | p99 µs | ratio to bare p50 | ratio range (rounds) | p50 spread | target |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        http_targets = {"http-replay-redis": TARGET_REPLAY_REDIS, "http-first-redis": TARGET_FIRST}
        for row in http_rows:
            target = ""
            if row["name"] in http_targets:
                limit = http_targets[row["name"]]
                target = f"≤ {limit}×: {verdict(row['ratio'] <= limit)}"
            lines.append(
                f"| {row['library']} | {row['label']} | {row['p50_us']:,.0f} | {row['p99_us']:,.0f} |"
                f" {row['ratio']:.2f}× | {row['ratio_min']:.2f}–{row['ratio_max']:.2f}× |"
                f" {row['p50_spread_pct']:.0f}% | {target} |"
            )
    lines += [
        "",
        "## 3. Wake-up latency of parked duplicates (gunicorn)",
        "",
        (
            f"gunicorn, {meta['workers']} workers × {meta['threads']} threads (gthread), one server per library, all up at"
            f" once, trials interleaved. Each of {meta['wake_trials']} trials: an original that sleeps 300 ms, then"
            f" {meta['wake_duplicates']} duplicates sent 100 ms after it on fresh connections; figure = time from the"
            " original's response to each duplicate's response, at the client. Negative = the duplicate was"
            " answered before the original's own response reached the client. Cross-worker = answered by"
            " another worker than the original (the wake-up crossed processes)."
        ),
        "",
        "| library, backend | duplicates | replayed | cross-worker | p50 ms (cross-worker) | p99 ms (cross-worker) | p50 ms (all) | p99 ms (all) | max ms | target p50 ≤ 5, p99 ≤ 25 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    names = {
        "ours": f"{OURS}, PostgreSQL + Redis",
        "ik-redis": f"{IDEMKIT}, Redis",
        "ik-pg": f"{IDEMKIT}, PostgreSQL",
    }
    for key, row in wake.items():
        target = ""
        if key == "ours" and row["cross_p50_ms"] is not None:
            ok = (
                row["cross_p50_ms"] <= TARGET_WAKE_P50_MS
                and row["cross_p99_ms"] <= TARGET_WAKE_P99_MS
            )
            target = verdict(ok)
        lines.append(
            f"| {names[key]} | {row['duplicates']} | {row['replayed']} | {row['cross_worker']} |"
            f" {fmt(row['cross_p50_ms'], 1)} | {fmt(row['cross_p99_ms'], 1)} | {fmt(row['all_p50_ms'], 1)} |"
            f" {fmt(row['all_p99_ms'], 1)} | {fmt(row['all_max_ms'], 1)} | {target} |"
        )
    if not wake:
        lines.append("Not run (`--inprocess-only`).")
    lines += ["", "## 4. Throughput under gunicorn (wrk on loopback)", ""]
    if throughput is None:
        lines.append(
            "Not run: `--inprocess-only`, or `wrk` is not installed (`apt-get install -y wrk`)."
        )
    else:
        lines += [
            (
                f"Same servers. wrk -t2 -c{meta['wrk_connections']}, {meta['wrk_seconds']:g} s per cell,"
                f" {meta['wrk_rounds']} interleaved rounds (shuffled). Replay-heavy mix:"
                f" {100 - meta['new_share'] * 100:.0f}% replays of {meta['replay_keys']} stored keys,"
                f" {meta['new_share'] * 100:.0f}% new keys. The client shares the 2 cores with the servers."
                " Ratio = requests/s over the bare route's requests/s (our server, no key) in the same round."
            ),
            "",
            "| library, backend | load | req/s (median) | ratio to bare | ratio range (rounds) | p50 ms | p99 ms | non-2xx | socket errors |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        loads = {"bare": "bare route, no key", "mix": "replay-heavy mix", "new": "all new keys"}
        for cell, row in throughput.items():
            server, mode = cell.split(":")
            lines.append(
                f"| {names[server]} | {loads[mode]} | {row['rps']:,.0f} | {row['ratio']:.2f}× |"
                f" {row['ratio_min']:.2f}–{row['ratio_max']:.2f}× | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |"
                f" {row['non2xx']} | {row['errors']} |"
            )
    lines += [
        "",
        "## Notes",
        "",
        (
            "- idemkit runs as its WSGI middleware around the same Flask app (it has no per-view Flask"
            " integration); its Redis backend is Redis-only (no durable store), its PostgreSQL backend has no"
            " cache tier. Its bare row is the same unprotected route, which still passes through its"
            " middleware (body buffered, one hop to its background event loop)."
        ),
        (
            "- idemkit does not cache 204 and releases oversized responses; neither case is exercised here"
            " (every path answers 201 with a small JSON body)."
        ),
        "- Figures are from this one run on this machine; rerun `make bench` to reproduce.",
        "",
    ]
    markdown = "\n".join(lines)
    out.write_text(markdown)
    return markdown


def target_lines(
    by: dict[str, dict[str, Any]],
    http_rows: list[dict[str, Any]],
    wake: dict[str, Any],
    floor_redis: float,
    floor_first: float,
) -> list[str]:
    """One line per target of the issue: the figure, where it was measured, met or missed."""
    http = {row["name"]: row for row in http_rows}
    replay, first, first_pg = by["replay-redis"], by["first-redis"], by["first-pg"]
    lines = [
        f"- Replay from Redis ≤ {TARGET_REPLAY_REDIS}× bare: in-process {replay['ratio']:.2f}×"
        f" ({verdict(replay['ratio'] <= TARGET_REPLAY_REDIS)}; this machine's floor, bare + one Redis"
        f" GET, is {floor_redis:.2f}×)"
        + (
            f"; over HTTP {http['http-replay-redis']['ratio']:.2f}×"
            f" ({verdict(http['http-replay-redis']['ratio'] <= TARGET_REPLAY_REDIS)})."
            if http
            else "."
        ),
        f"- First execution ≤ {TARGET_FIRST}× bare: in-process {first['ratio']:.2f}× with Redis,"
        f" {first_pg['ratio']:.2f}× PostgreSQL only ({verdict(first['ratio'] <= TARGET_FIRST)};"
        f" floor, bare + one upsert+commit, is {floor_first:.2f}×: the commit's WAL flush dominates)"
        + (
            f"; over HTTP {http['http-first-redis']['ratio']:.2f}×"
            f" ({verdict(http['http-first-redis']['ratio'] <= TARGET_FIRST)})."
            if http
            else "."
        ),
    ]
    ours = wake.get("ours")
    if ours and ours["cross_p50_ms"] is not None:
        ok = (
            ours["cross_p50_ms"] <= TARGET_WAKE_P50_MS
            and ours["cross_p99_ms"] <= TARGET_WAKE_P99_MS
        )
        lines.append(
            f"- Wake-up of parked duplicates p50 ≤ {TARGET_WAKE_P50_MS:g} ms, p99 ≤ {TARGET_WAKE_P99_MS:g} ms"
            f" (cross-worker): p50 {ours['cross_p50_ms']:.1f} ms, p99 {ours['cross_p99_ms']:.1f} ms"
            f" ({verdict(ok)})."
        )
    return lines


def plot(
    out: Path,
    inproc: list[dict[str, Any]],
    http_rows: list[dict[str, Any]],
    throughput: dict[str, Any] | None,
) -> None:
    """Ratios to bare: in-process (log scale), over HTTP, and throughput; bars span the rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {OURS: "#2b6cb0", IDEMKIT: "#dd6b20", "Flask": "#718096", "floor": "#38a169"}
    panels: list[tuple[str, list[tuple[str, float, float, float, str]], str, bool]] = []

    def latency_bars(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, float, str]]:
        return [
            (
                f"{'ik: ' if r['library'] == IDEMKIT else ''}{r['label']}",
                r["ratio"],
                r["ratio_min"],
                r["ratio_max"],
                r["library"],
            )
            for r in rows
            if r["name"] not in ("bare", "http-bare")
        ]

    panels.append(
        ("In-process latency / bare p50 (log scale)", latency_bars(inproc), "ratio", True)
    )
    if http_rows:
        panels.append(
            ("HTTP latency, one client / bare p50", latency_bars(http_rows), "ratio", False)
        )
    if throughput:
        names = {"ours": "ours", "ik-redis": "ik Redis", "ik-pg": "ik PG"}
        loads = {"bare": "bare", "mix": "replay mix", "new": "new keys"}
        bars = []
        for cell, row in throughput.items():
            server, mode = cell.split(":")
            bars.append(
                (
                    f"{names[server]}: {loads[mode]}",
                    row["ratio"],
                    row["ratio_min"],
                    row["ratio_max"],
                    OURS if server == "ours" else IDEMKIT,
                )
            )
        panels.append(("Throughput (req/s) / bare req/s", bars, "ratio", False))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 6.5), squeeze=False)
    for ax, (title, bars, xlabel, log) in zip(axes[0], panels, strict=False):
        labels = [b[0] for b in bars]
        values = [b[1] for b in bars]
        errors = [[b[1] - b[2] for b in bars], [b[3] - b[1] for b in bars]]
        ax.barh(labels, values, xerr=errors, color=[colours[b[4]] for b in bars], capsize=3)
        ax.axvline(1.0, color="black", linewidth=0.8)
        if not title.startswith("Throughput"):
            ax.axvline(
                TARGET_REPLAY_REDIS,
                color="green",
                linestyle="--",
                linewidth=0.8,
                label=f"target replay from Redis {TARGET_REPLAY_REDIS}×",
            )
            ax.axvline(
                TARGET_FIRST,
                color="red",
                linestyle="--",
                linewidth=0.8,
                label=f"target first execution {TARGET_FIRST}×",
            )
            ax.legend(loc="lower right", fontsize=8)
        if log:
            ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{xlabel} (blue: ours, orange: idemkit 1.0.2, green: floor)", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_gunicorn_parts(
    args: argparse.Namespace, meta: dict[str, Any], db_url: str, redis_url: str
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any] | None]:
    """Sections 2–4: HTTP latency, wake-ups and throughput, servers stopped whatever happens."""
    print("2/5 gunicorn: starting the servers", flush=True)
    servers = start_servers(db_url, redis_url, meta["workers"], meta["threads"])
    try:
        print("3/5 gunicorn: sequential HTTP latency", flush=True)
        http_paths, clients = build_http_paths(servers)
        try:
            run_inprocess(http_paths, args.rounds, args.http_per_round, 10, 10.0, what="HTTP")
        finally:
            for client in clients:
                client.close()
        http_base = next(p for p in http_paths if p.name == "http-bare")
        http_rows = [summarise(p, http_base) for p in http_paths]
        print("4/5 gunicorn: wake-up latency", flush=True)
        wake_raw = run_wake(servers, args.wake_trials, meta["wake_duplicates"])
        wake = {key: summarise_wake(samples) for key, samples in wake_raw.items()}
        throughput = None
        if shutil.which("wrk"):
            print("5/5 gunicorn: throughput (wrk)", flush=True)
            throughput = run_throughput(
                servers,
                args.wrk_rounds,
                args.wrk_seconds,
                meta["wrk_connections"],
                meta["replay_keys"],
                meta["new_share"],
            )
        else:
            print("5/5 skipped: wrk is not installed (apt-get install -y wrk)", flush=True)
    finally:
        stop_servers(servers)
    return http_rows, wake, throughput


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "IDEMPOTENCY_BENCH_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
        ),
        help="PostgreSQL server; a private database is created on it and dropped afterwards",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=300)
    parser.add_argument("--big-rows", type=int, default=1_000_000)
    parser.add_argument("--wake-trials", type=int, default=40)
    parser.add_argument("--wrk-rounds", type=int, default=3)
    parser.add_argument("--wrk-seconds", type=float, default=4.0)
    parser.add_argument("--http-per-round", type=int, default=60)
    parser.add_argument(
        "--inprocess-only",
        action="store_true",
        help="skip the gunicorn parts (quick before/after checks)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: few rounds, small tables"
    )
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw latency.png from results.json"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.per_round, args.big_rows = 2, 50, 10_000
        args.wake_trials, args.wrk_rounds, args.wrk_seconds, args.http_per_round = 3, 1, 1.0, 10
    if args.plot_only:
        saved = json.loads((args.out / "results.json").read_text())
        plot(args.out / "latency.png", saved["in_process"], saved["http"], saved["throughput"])
        return 0
    # `kill <pid>` still runs the cleanups below (servers, private database).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    started = time.monotonic()
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_before": loadavg(),
        "rounds": args.rounds,
        "per_round": args.per_round,
        "workers": 3,
        "threads": 4,
        "wake_trials": args.wake_trials,
        "wake_duplicates": 5,
        "wrk_rounds": args.wrk_rounds,
        "wrk_seconds": args.wrk_seconds,
        "wrk_connections": 12,
        "replay_keys": 200,
        "new_share": 0.1,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with private_database(args.database_url) as db_url, private_redis() as redis_server:
        redis_url = redis_server.url
        meta["versions"] = versions(db_url, redis_url)
        print(
            f"bench: {meta['versions']['cpu']}, {meta['versions']['cores']} cores, load {meta['load_before']}",
            flush=True,
        )

        print("1/5 in-process: loading records and warming up", flush=True)
        paths, notes, ik_backends = build_inprocess_paths(db_url, redis_url, args.big_rows)
        run_inprocess(paths, args.rounds, args.per_round, warmup=30, block_seconds=20.0)
        baseline = next(p for p in paths if p.name == "bare")
        inproc = [summarise(p, baseline) for p in paths]
        close_idemkit(ik_backends)

        http_rows: list[dict[str, Any]] = []
        wake: dict[str, Any] = {}
        throughput = None
        if not args.inprocess_only:
            http_rows, wake, throughput = run_gunicorn_parts(args, meta, db_url, redis_url)
    meta["load_after"] = loadavg()
    meta["seconds"] = time.monotonic() - started

    meta["http_per_round"] = args.http_per_round
    markdown = write_markdown(
        args.out / "RESULTS.md", meta, inproc, http_rows, wake, throughput, notes
    )
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "in_process": inproc,
                "http": http_rows,
                "wake": wake,
                "throughput": throughput,
                "notes": notes,
            },
            indent=1,
        )
    )
    plot(args.out / "latency.png", inproc, http_rows, throughput)
    print(markdown)
    print(
        f"bench: wrote {args.out / 'RESULTS.md'}, results.json and latency.png in {meta['seconds']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
