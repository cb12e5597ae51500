# ruff: noqa: E501 - the wrk Lua script reads better unbroken
"""What is measured: each path of ours, idemkit's, and the floor each path cannot go below.

A floor is the bare Flask route (an app without any idempotency) followed by the
raw redis-py / psycopg2 round trips the path cannot avoid, done by the bench
process in the same sample:

- replay from Redis: one GET of the cached record;
- replay from PostgreSQL only: one primary-key SELECT of the stored row (autocommit);
- first execution: the claim (INSERT … ON CONFLICT DO NOTHING RETURNING, autocommit,
  synchronous commit) + the fenced completion (UPDATE … RETURNING, synchronous
  commit) + SET of the cached copy and PUBLISH of the wake-up in one pipelined round
  trip (without Redis: claim + completion only).

Floors run against the same database (a table the extension created, same indexes)
and the same private Redis as the paths they bound.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import resource
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.benchapp import create_app
from bench.harness import BODY, Gunicorn, Path_, WsgiCaller, counter_keys, dsn, loadavg

#: (path key, label, floor label) in report order.
PATHS = [
    ("unprotected", "unprotected route, app with the extension", "bare route"),
    ("replay-redis", "replay from Redis", "bare + GET"),
    ("replay-pg", "replay from PostgreSQL only", "bare + PK SELECT"),
    (
        "first-redis",
        "first execution, PostgreSQL + Redis",
        "bare + claim + completion + SET/PUBLISH",
    ),
    ("first-pg", "first execution, PostgreSQL only", "bare + claim + completion"),
]
#: Which idemkit backend each path is compared with.
IDEMKIT_FOR = {
    "unprotected": "ik-redis",
    "replay-redis": "ik-redis",
    "replay-pg": "ik-pg",
    "first-redis": "ik-redis",
    "first-pg": "ik-pg",
}


# -- the floor's raw round trips ----------------------------------------------------------


class Floor:
    """Raw clients doing, by hand, the round trips a path needs; nothing else."""

    def __init__(
        self,
        db_url: str,
        redis_url: str,
        table: str,
        cached_name: bytes,
        stored_digest: str,
        driver: str = "psycopg2",
    ) -> None:
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        # One statement = one implicit transaction = one round trip, with each driver's
        # defaults (psycopg 3 prepares a statement on the server from its fifth run).
        self.pg = connect(db_url, driver)
        self.cur = self.pg.cursor()
        self.table = table
        self.cached_name = cached_name
        self.stored_digest = stored_digest
        self.cached_value = self.redis.get(cached_name)
        assert self.cached_value is not None, "the floor's cached record must be in Redis"
        self.cur.execute(
            f"SELECT response_headers, response_body FROM {table} WHERE key_digest = %s",
            (stored_digest,),
        )
        self.headers, self.body = self.cur.fetchone()
        self.keys = counter_keys("floor")
        self.channel = "bench-floor:done"

    def get(self) -> None:
        assert self.redis.get(self.cached_name) is not None

    def pk_select(self) -> None:
        self.cur.execute(f"SELECT * FROM {self.table} WHERE key_digest = %s", (self.stored_digest,))
        assert self.cur.fetchone() is not None

    def claim_and_complete(self) -> int:
        digest = uuid.uuid4().hex + uuid.uuid4().hex
        token = uuid.uuid4().hex
        now = int(time.time() * 1000)
        self.cur.execute(
            f"INSERT INTO {self.table} (key_digest, scope, fingerprint, method, path, state,"
            " lock_token, created_at_ms, expires_at_ms, lease_expires_at_ms)"
            " VALUES (%s, 'anonymous', %s, 'POST', '/pay', 'in_progress', %s, %s, %s, %s)"
            " ON CONFLICT (key_digest) DO NOTHING RETURNING id, expires_at_ms",
            (digest, "0" * 64, token, now, now + 86_400_000, now + 60_000),
        )
        record_id, expires = self.cur.fetchone()
        self.cur.execute(
            f"UPDATE {self.table} SET state = 'completed', response_status = 201,"
            " response_headers = %s, response_body = %s, body_omitted = false,"
            " completed_at_ms = %s, lock_token = NULL, lease_expires_at_ms = NULL"
            " WHERE id = %s AND lock_token = %s RETURNING expires_at_ms",
            (self.headers, self.body, now, record_id, token),
        )
        assert self.cur.fetchone() is not None
        return int(expires)

    def set_publish(self, expires: int) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(b"bench-floor:" + uuid.uuid4().hex.encode(), self.cached_value, pxat=expires)
        pipe.publish(self.channel, b'{"k":"x","e":"done"}')
        pipe.execute()

    def close(self) -> None:
        self.pg.close()
        self.redis.close()


def connect(db_url: str, driver: str) -> Any:
    """An autocommit connection of ``driver`` (``psycopg2`` or ``psycopg``, i.e. psycopg 3)."""
    if driver == "psycopg":
        import psycopg

        return psycopg.connect(dsn(db_url), autocommit=True)
    import psycopg2

    conn = psycopg2.connect(dsn(db_url))
    conn.autocommit = True
    return conn


def driver_url(db_url: str, driver: str) -> str:
    """``db_url`` naming ``driver`` explicitly (the bench's URLs name psycopg2)."""
    scheme, rest = db_url.split("://", 1)
    return f"postgresql+{driver}://{rest}" if scheme.startswith("postgresql") else db_url


def floor_steps(floor: Floor) -> dict[str, Any]:
    """The round trips of each path's floor, after its bare request."""

    def first_redis() -> None:
        floor.set_publish(floor.claim_and_complete())

    return {
        "unprotected": lambda: None,
        "replay-redis": floor.get,
        "replay-pg": floor.pk_select,
        "first-redis": first_redis,
        "first-pg": floor.claim_and_complete,
    }


def redis_keys(redis_url: str) -> set[bytes]:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return set(client.scan_iter(count=1000))
    finally:
        client.close()


def newest_digest(db_url: str, table: str) -> str:
    import psycopg2

    conn = psycopg2.connect(dsn(db_url))
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT key_digest FROM {table} ORDER BY id DESC LIMIT 1")
            return str(cur.fetchone()[0])
    finally:
        conn.close()


def create_idemkit_table(db_url: str, table: str) -> None:
    from idemkit.backends.postgres import init_pg

    asyncio.run(init_pg(dsn(db_url), table=table))


def close_idemkit(apps: list[Any]) -> None:
    """Close idemkit's pools on its own loop now, before the private database is dropped."""
    from idemkit.core.sync_bridge import run_sync

    for app in apps:
        run_sync(app.wsgi_app.app.backend.aclose())


# -- in-process ---------------------------------------------------------------------------------


@dataclass
class Built:
    paths: list[Path_]
    floor: Floor
    cleanup: list[Any]


def _wsgi(
    name: str, label: str, library: str, caller: WsgiCaller, keys: Any, replay: bool | None
) -> Path_:
    def run() -> None:
        caller(keys())

    def check() -> None:
        assert caller.status.startswith("201"), f"{name}: got {caller.status}"
        if replay is not None:
            assert caller.replayed() == replay, f"{name}: replayed={caller.replayed()}"

    return Path_(name, label, library, run, check)


def build_inprocess(db_url: str, redis_url: str) -> Built:
    """Every in-process path, each a WSGI call on a prepared environ (same harness for all)."""
    ours_redis = create_app("ours", database_url=db_url, redis_url=redis_url, table="idem_redis")
    ours_pg = create_app("ours", database_url=db_url, table="idem_pg")
    floor_app = create_app("ours", database_url=db_url, redis_url=redis_url, table="idem_floor")
    plain = create_app("plain")
    create_idemkit_table(db_url, "ik_inproc")
    ik_redis = create_app("idemkit-redis", redis_url=redis_url, table="ik_inproc")
    ik_pg = create_app("idemkit-pg", database_url=db_url, table="ik_inproc")
    # A second app without idempotency, made last: what two identical apps of one process
    # differ by (where each lies in memory), the noise between the bare route of one app
    # and the unprotected route of another.
    other_plain = create_app("plain")

    # The records the replay paths replay, stored by a first request each.
    fixed: dict[str, str] = {}
    before = redis_keys(redis_url)
    for name, app in (
        ("floor", floor_app),
        ("ours-redis", ours_redis),
        ("ours-pg", ours_pg),
        ("ik-redis", ik_redis),
        ("ik-pg", ik_pg),
    ):
        fixed[name] = f"replay-{name}-{uuid.uuid4().hex[:8]}"
        caller = WsgiCaller(app, "/pay")
        caller(fixed[name])
        assert caller.status.startswith("201") and not caller.replayed(), (name, caller.status)
        if name == "floor":  # the one Redis key the floor's first request stored
            added = redis_keys(redis_url) - before
            cached = [k for k in added if not k.startswith(b"bench-floor")]
            assert len(cached) == 1, f"expected one cached record, found {added}"
    floor = Floor(db_url, redis_url, "idem_floor", cached[0], newest_digest(db_url, "idem_floor"))
    steps = floor_steps(floor)
    bare = WsgiCaller(plain, "/bare")

    def floor_path(key: str, label: str) -> Path_:
        step = steps[key]

        def run() -> None:
            bare(None)
            step()

        return Path_(f"floor:{key}", f"floor: {label}", "floor", run)

    paths = [
        _wsgi("bare", "bare route, app without idempotency", "Flask", bare, lambda: None, False),
        _wsgi(
            "bare-twin",
            "the same bare route again (noise)",
            "Flask",
            WsgiCaller(plain, "/bare"),
            lambda: None,
            False,
        ),
        _wsgi(
            "bare-other",
            "the bare route of a second app without idempotency (noise between apps)",
            "Flask",
            WsgiCaller(other_plain, "/bare"),
            lambda: None,
            False,
        ),
        *(floor_path(key, floor_label) for key, _, floor_label in PATHS if key != "unprotected"),
        _wsgi(
            "ours:unprotected",
            "unprotected route",
            "ours",
            WsgiCaller(ours_redis, "/bare"),
            lambda: None,
            False,
        ),
        _wsgi(
            "ours:replay-redis",
            "replay from Redis",
            "ours",
            WsgiCaller(ours_redis, "/pay"),
            lambda: fixed["ours-redis"],
            True,
        ),
        _wsgi(
            "ours:replay-pg",
            "replay from PostgreSQL",
            "ours",
            WsgiCaller(ours_pg, "/pay"),
            lambda: fixed["ours-pg"],
            True,
        ),
        _wsgi(
            "ours:first-redis",
            "first execution, PG + Redis",
            "ours",
            WsgiCaller(ours_redis, "/pay"),
            counter_keys("new-r"),
            False,
        ),
        _wsgi(
            "ours:first-pg",
            "first execution, PG only",
            "ours",
            WsgiCaller(ours_pg, "/pay"),
            counter_keys("new-p"),
            False,
        ),
        _wsgi(
            "ik-redis:unprotected",
            "unprotected route",
            "idemkit",
            WsgiCaller(ik_redis, "/bare"),
            lambda: None,
            False,
        ),
        _wsgi(
            "ik-redis:replay-redis",
            "replay, Redis backend",
            "idemkit",
            WsgiCaller(ik_redis, "/pay"),
            lambda: fixed["ik-redis"],
            True,
        ),
        _wsgi(
            "ik-pg:replay-pg",
            "replay, PostgreSQL backend",
            "idemkit",
            WsgiCaller(ik_pg, "/pay"),
            lambda: fixed["ik-pg"],
            True,
        ),
        _wsgi(
            "ik-redis:first-redis",
            "first execution, Redis backend",
            "idemkit",
            WsgiCaller(ik_redis, "/pay"),
            counter_keys("ikn-r"),
            False,
        ),
        _wsgi(
            "ik-pg:first-pg",
            "first execution, PostgreSQL backend",
            "idemkit",
            WsgiCaller(ik_pg, "/pay"),
            counter_keys("ikn-p"),
            False,
        ),
    ]
    extra, floor3 = _psycopg3_paths(db_url, redis_url, bare)
    paths += extra
    return Built(
        paths, floor, [lambda: close_idemkit([ik_redis, ik_pg]), floor.close, floor3.close]
    )


#: The paths measured with each PostgreSQL driver (issue 21, C51), by their key in PATHS.
DRIVER_PATHS = ("replay-redis", "replay-pg", "first-redis", "first-pg")
#: The drivers compared; the main table's paths and floors are psycopg2's.
DRIVERS = ("psycopg2", "psycopg")


def _psycopg3_paths(db_url: str, redis_url: str, bare: WsgiCaller) -> tuple[list[Path_], Floor]:
    """Our paths and their floors once more with psycopg 3: ``ours@psycopg:<key>`` and
    ``floor@psycopg:<key>``, the floor's round trips made with psycopg 3 itself."""
    url = driver_url(db_url, "psycopg")
    with_redis = create_app("ours", database_url=url, redis_url=redis_url, table="idem3_redis")
    pg_only = create_app("ours", database_url=url, table="idem3_pg")
    floor_app = create_app("ours", database_url=url, redis_url=redis_url, table="idem3_floor")
    fixed: dict[str, str] = {}
    before = redis_keys(redis_url)
    for name, app in (("floor", floor_app), ("redis", with_redis), ("pg", pg_only)):
        fixed[name] = f"replay3-{name}-{uuid.uuid4().hex[:8]}"
        caller = WsgiCaller(app, "/pay")
        caller(fixed[name])
        assert caller.status.startswith("201") and not caller.replayed(), (name, caller.status)
        if name == "floor":
            added = redis_keys(redis_url) - before
            cached = [k for k in added if not k.startswith(b"bench-floor")]
            assert len(cached) == 1, f"expected one cached record, found {added}"
    floor = Floor(
        db_url,
        redis_url,
        "idem3_floor",
        cached[0],
        newest_digest(db_url, "idem3_floor"),
        driver="psycopg",
    )
    steps = floor_steps(floor)
    apps = {"replay-redis": with_redis, "first-redis": with_redis}
    apps |= {"replay-pg": pg_only, "first-pg": pg_only}
    keys = {
        "replay-redis": lambda: fixed["redis"],
        "replay-pg": lambda: fixed["pg"],
        "first-redis": counter_keys("new3-r"),
        "first-pg": counter_keys("new3-p"),
    }
    paths: list[Path_] = []
    for key in DRIVER_PATHS:
        step = steps[key]

        def run(step: Any = step) -> None:
            bare(None)
            step()

        label = next(label for k, label, _ in PATHS if k == key)
        paths.append(Path_(f"floor@psycopg:{key}", f"floor (psycopg 3): {label}", "floor", run))
        replay = key.startswith("replay")
        caller = WsgiCaller(apps[key], "/pay")
        paths.append(
            _wsgi(f"ours@psycopg:{key}", f"{label}, psycopg 3", "ours", caller, keys[key], replay)
        )
    return paths, floor


# -- over HTTP (gunicorn) -------------------------------------------------------------------------


class KeepAlive:
    """One persistent HTTP/1.1 connection: sequential requests, timed at the client."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        self.last_used = 0.0
        self.status = 0
        self.replayed = False

    def __call__(self, path: str, key: str | None) -> None:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        if time.monotonic() - self.last_used > 1.0:
            # gunicorn closes idle keep-alive connections after 2 s: connect afresh.
            self.conn.close()
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
            self.conn.connect()
        self.conn.request("POST", path, body=BODY, headers=headers)
        response = self.conn.getresponse()
        response.read()
        self.last_used = time.monotonic()
        self.status = response.status
        self.replayed = (
            response.getheader("Idempotent-Replayed") or response.getheader("Idempotency-Replayed")
        ) == "true"

    def close(self) -> None:
        self.conn.close()


SERVERS = {
    # key: (bench mode, uses Redis, table, PostgreSQL driver)
    "plain": ("plain", False, "none", "psycopg2"),
    "ours": ("ours", True, "idem_gunicorn_r", "psycopg2"),
    "ours-pg": ("ours", False, "idem_gunicorn_p", "psycopg2"),
    "ours-psycopg": ("ours", True, "idem_gunicorn_r3", "psycopg"),
    "ik-redis": ("idemkit-redis", True, "ik_gunicorn", "psycopg2"),
    "ik-pg": ("idemkit-pg", False, "ik_gunicorn", "psycopg2"),
}


def start_servers(db_url: str, redis_url: str, workers: int, threads: int) -> dict[str, Gunicorn]:
    create_idemkit_table(db_url, "ik_gunicorn")
    servers: dict[str, Gunicorn] = {}
    try:
        for key, (mode, uses_redis, table, driver) in SERVERS.items():
            env = {
                "BENCH_MODE": mode,
                "DATABASE_URL": driver_url(db_url, driver),
                "BENCH_TABLE": table,
                "BENCH_WAIT": "5",
                "REDIS_URL": redis_url if uses_redis else "",
            }
            servers[key] = Gunicorn(env, workers, threads).start()
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, Gunicorn]) -> None:
    for server in servers.values():
        server.stop()


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
        return (
            time.perf_counter(),
            response.status,
            {k.lower(): v for k, v in response.getheaders()},
        )
    finally:
        conn.close()


def build_http(servers: dict[str, Gunicorn], floor: Floor) -> tuple[list[Path_], list[KeepAlive]]:
    """Sequential requests over keep-alive connections: the latency one client sees."""
    clients: list[KeepAlive] = []
    steps = floor_steps(floor)
    fixed = {}
    for key in ("ours", "ours-pg", "ik-redis", "ik-pg"):
        fixed[key] = f"http-replay-{uuid.uuid4().hex[:8]}"
        _, status, _ = post(servers[key].port, fixed[key])
        assert status == 201, (key, status)

    def path(
        name: str,
        label: str,
        library: str,
        server: str,
        route: str,
        keys: Any,
        replay: bool | None,
        step: Any = None,
    ) -> Path_:
        client = KeepAlive(servers[server].port)
        clients.append(client)

        def run() -> None:
            client(route, keys())
            if step is not None:
                step()

        def check() -> None:
            assert client.status == 201, (name, client.status)
            if replay is not None:
                assert client.replayed == replay, (name, client.replayed)

        return Path_(name, label, library, run, check)

    def none() -> None:
        return None

    paths = [
        path("bare", "bare route, app without idempotency", "Flask", "plain", "/bare", none, False),
        path(
            "bare-twin", "the same bare route again (noise)", "Flask", "plain", "/bare", none, False
        ),
        *(
            path(
                f"floor:{key}",
                f"floor: {label}",
                "floor",
                "plain",
                "/bare",
                none,
                False,
                steps[key],
            )
            for key, _, label in PATHS
            if key != "unprotected"
        ),
        path("ours:unprotected", "unprotected route", "ours", "ours", "/bare", none, False),
        path(
            "ours:replay-redis",
            "replay from Redis",
            "ours",
            "ours",
            "/pay",
            lambda: fixed["ours"],
            True,
        ),
        path(
            "ours:replay-pg",
            "replay from PostgreSQL",
            "ours",
            "ours-pg",
            "/pay",
            lambda: fixed["ours-pg"],
            True,
        ),
        path(
            "ours:first-redis",
            "first execution, PG + Redis",
            "ours",
            "ours",
            "/pay",
            counter_keys("hn-r"),
            False,
        ),
        path(
            "ours:first-pg",
            "first execution, PG only",
            "ours",
            "ours-pg",
            "/pay",
            counter_keys("hn-p"),
            False,
        ),
        path(
            "ik-redis:unprotected", "unprotected route", "idemkit", "ik-redis", "/bare", none, False
        ),
        path(
            "ik-redis:replay-redis",
            "replay, Redis backend",
            "idemkit",
            "ik-redis",
            "/pay",
            lambda: fixed["ik-redis"],
            True,
        ),
        path(
            "ik-pg:replay-pg",
            "replay, PostgreSQL backend",
            "idemkit",
            "ik-pg",
            "/pay",
            lambda: fixed["ik-pg"],
            True,
        ),
        path(
            "ik-redis:first-redis",
            "first execution, Redis backend",
            "idemkit",
            "ik-redis",
            "/pay",
            counter_keys("hk-r"),
            False,
        ),
        path(
            "ik-pg:first-pg",
            "first execution, PostgreSQL backend",
            "idemkit",
            "ik-pg",
            "/pay",
            counter_keys("hk-p"),
            False,
        ),
    ]
    return paths, clients


# -- wake-ups ----------------------------------------------------------------------------------


def wake_trial(port: int, duplicates: int) -> list[tuple[float, bool, bool]]:
    """A slow original (300 ms), duplicates 100 ms later; each one's delay after it, in ms."""
    key = f"wake-{uuid.uuid4().hex}"
    original: dict[str, Any] = {}
    answers: list[Any] = [None] * duplicates
    go = threading.Event()

    def run_duplicate(i: int) -> None:
        go.wait()
        answers[i] = post(port, key)

    threads = [threading.Thread(target=run_duplicate, args=(i,)) for i in range(duplicates)]
    for thread in threads:
        thread.start()
    first = threading.Thread(target=lambda: original.update(r=post(port, key, sleep=0.3)))
    first.start()
    time.sleep(0.1)
    go.set()
    first.join()
    for thread in threads:
        thread.join()
    done, status, headers = original["r"]
    assert status == 201, status
    out = []
    for t, dup_status, dup_headers in answers:
        ok = dup_status == 201 and "true" in (
            dup_headers.get("idempotent-replayed"),
            dup_headers.get("idempotency-replayed"),
        )
        cross = dup_headers.get("x-worker-pid") != headers.get("x-worker-pid")
        out.append(((t - done) * 1000, cross, ok))
    return out


def run_wake(servers: dict[str, Gunicorn], trials: int, duplicates: int) -> dict[str, Any]:
    keys = ["ours", "ik-redis", "ik-pg"]
    raw: dict[str, list[tuple[float, bool, bool]]] = {k: [] for k in keys}
    for key in keys:  # warm-up: start each worker's subscriber, open its pools
        for _ in range(2):
            wake_trial(servers[key].port, duplicates)
    rng = random.Random(7)
    for _ in range(trials):
        rng.shuffle(keys)
        for key in keys:
            raw[key] += wake_trial(servers[key].port, duplicates)
    from bench.harness import percentile

    result = {}
    for key, samples in raw.items():
        cross = [ms for ms, c, ok in samples if ok and c]
        result[key] = {
            "duplicates": len(samples),
            "replayed": sum(ok for _, _, ok in samples),
            "cross_worker": len(cross),
            "p50_ms": statistics.median(cross) if cross else None,
            "p99_ms": percentile(cross, 99) if cross else None,
        }
    return result


# -- throughput (wrk) ---------------------------------------------------------------------------

WRK_SCRIPT = r"""
-- Each wrk thread runs this chunk in a Lua state of its own: its `counter` starts at 0
-- in every thread, and `tid` is the global that setup() gives each thread (a `local tid`
-- here would be 0 in every thread, and every "new" key would be sent once per thread).
local counter = 0
local next_tid = 0
setup = function(thread)
  thread:set("tid", next_tid)
  next_tid = next_tid + 1
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

THROUGHPUT_CELLS = [
    ("plain", "bare"),
    ("ours", "bare"),
    ("ours", "mix"),
    ("ours", "new"),
    ("ours-psycopg", "mix"),
    ("ours-psycopg", "new"),
    ("ik-redis", "mix"),
    ("ik-redis", "new"),
    ("ik-pg", "mix"),
    ("ik-pg", "new"),
    # Not a server: raw claim + completion pairs from N threads (``commit_ceiling``).
    ("ceiling-psycopg2", "8"),
    ("ceiling-psycopg2", "32"),
    ("ceiling-psycopg", "8"),
]


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


def workers_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (``/proc``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a worker gone (recycled): its CPU is not counted
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / ticks


#: The parts of the machine's CPU a throughput cell reports per request.
SPLIT = ("machine", "postgres", "redis", "wrk")


def processes_named(name: str) -> list[int]:
    """The pids of the processes whose command name (``/proc/PID/comm``) is ``name``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == name:
                    found.append(int(entry))
            except OSError:
                continue  # gone meanwhile
    return found


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait, ``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def redis_server_pids(port: int) -> list[int]:
    """The redis-server listening on ``port``: its command line names the port, as given
    (``--port N``) or as redis-server retitles itself (``127.0.0.1:N``)."""
    found = []
    for pid in processes_named("redis-server"):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue  # gone meanwhile
        if f"\0{port}\0" in cmdline or f":{port}" in cmdline:
            found.append(pid)
    return found


def machine_split(redis_pids: list[int]) -> dict[str, float]:
    """CPU seconds so far: the machine, PostgreSQL's processes, the bench's redis-server
    (``redis_pids``, found once by :func:`redis_server_pids`), and this process's
    waited-for children (each ``wrk`` run)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "machine": machine_busy_s(),
        "postgres": workers_cpu_s(processes_named("postgres")),
        "redis": workers_cpu_s(redis_pids),
        "wrk": children.ru_utime + children.ru_stime,
    }


def per_request(
    before: dict[str, float], after: dict[str, float], requests: int
) -> dict[str, float]:
    """µs per request of each part between two :func:`machine_split` readings. A PostgreSQL
    backend that ended between them is not counted: the servers' pools keep theirs."""
    n = max(1, requests)
    return {f"{part}_us": (after[part] - before[part]) * 1e6 / n for part in SPLIT}


def commit_ceiling(
    db_url: str, table: str, driver: str, threads: int, seconds: float
) -> dict[str, Any]:
    """What the durable commits alone allow: raw claim + completion pairs (the floor's
    two autocommit statements, each waiting for its WAL flush) from ``threads``
    threads with a connection each, for ``seconds``; shaped like :func:`wrk_run`'s result.

    PostgreSQL commits concurrent transactions with one flush (group commit), so this
    grows with the threads; a first execution of ours makes exactly these two writes.
    """
    headers, body = json.dumps([["Content-Type", "application/json"]]), b'{"id": "pay_1"}'
    done: list[int] = []
    latencies: list[float] = []
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def worker() -> None:
        conn = connect(db_url, driver)
        cur = conn.cursor()
        count, own = 0, []
        try:
            start.wait()
            while time.perf_counter() < stop_at[0]:
                t0 = time.perf_counter()
                now = int(time.time() * 1000)
                cur.execute(
                    f"INSERT INTO {table} (key_digest, scope, fingerprint, method, path, state,"
                    " lock_token, created_at_ms, expires_at_ms, lease_expires_at_ms)"
                    " VALUES (%s, 'anonymous', %s, 'POST', '/pay', 'in_progress', %s, %s, %s, %s)"
                    " ON CONFLICT (key_digest) DO NOTHING RETURNING id",
                    (uuid.uuid4().hex * 2, "0" * 64, "t", now, now + 86_400_000, now + 60_000),
                )
                (record_id,) = cur.fetchone()
                cur.execute(
                    f"UPDATE {table} SET state = 'completed', response_status = 201,"
                    " response_headers = %s, response_body = %s, body_omitted = false,"
                    " completed_at_ms = %s, lock_token = NULL, lease_expires_at_ms = NULL"
                    " WHERE id = %s AND lock_token = %s RETURNING expires_at_ms",
                    (headers, body, now, record_id, "t"),
                )
                cur.fetchone()
                own.append(time.perf_counter() - t0)
                count += 1
        finally:
            conn.close()
            done.append(count)
            latencies.extend(own)

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in pool:
        thread.start()
    stop_at[0] = time.perf_counter() + seconds
    began = time.perf_counter()
    start.wait()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "requests": sum(done),
        "duration_us": elapsed * 1e6,
        "rps": sum(done) / elapsed,
        "p50_us": latencies[len(latencies) // 2] * 1e6 if latencies else 0.0,
        "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6 if latencies else 0.0,
        "non2xx": 0,
        "errors": 0,
    }


def run_throughput(
    servers: dict[str, Gunicorn],
    db_url: str,
    rounds: int,
    seconds: float,
    connections: int,
    replay_keys: int,
    new_share: float,
) -> dict[str, Any]:
    """Each cell once per round, shuffled; ratio = req/s ÷ the plain bare route's, same round.

    Beside req/s, each cell's CPU per request: the app's workers, and the whole machine
    split by process (:func:`machine_split`), since on a shared 2-core machine what
    PostgreSQL and Redis spend per request takes from the workers' share too.
    """
    redis_port = int(servers["ours"].env["REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
    redis_pids = redis_server_pids(redis_port)
    # The ceiling's table, made by the extension (same columns and indexes as ours).
    WsgiCaller(create_app("ours", database_url=db_url, table="idem_ceiling"), "/pay")("warm")
    with tempfile.NamedTemporaryFile(
        "w", suffix=".lua", prefix="idem-bench-", delete=False
    ) as handle:
        handle.write(WRK_SCRIPT)
    script = Path(handle.name)
    try:
        for key in ("ours", "ours-psycopg", "ik-redis", "ik-pg"):  # what the mix replays
            for i in range(1, replay_keys + 1):
                _, status, _ = post(servers[key].port, f"mix-{i}")
                assert status == 201, (key, status)
        runs: dict[str, list[dict[str, Any]]] = {f"{s}:{m}": [] for s, m in THROUGHPUT_CELLS}
        rng = random.Random(11)
        for r in range(rounds):
            order = list(THROUGHPUT_CELLS)
            rng.shuffle(order)
            for server, mode in order:
                if server.startswith("ceiling-"):
                    driver = server.removeprefix("ceiling-")
                    split_before = machine_split(redis_pids)
                    result = commit_ceiling(db_url, "idem_ceiling", driver, int(mode), seconds)
                    result |= per_request(
                        split_before, machine_split(redis_pids), result["requests"]
                    )
                    result["postgres_us"] = float("nan")  # its backends ended before the reading
                    runs[f"{server}:{mode}"].append(result)
                    continue
                workers = servers[server].worker_pids()
                cpu_before = workers_cpu_s(workers)
                split_before = machine_split(redis_pids)
                result = wrk_run(
                    script, servers[server].port, mode, seconds, connections, replay_keys, new_share
                )
                spent = workers_cpu_s(workers) - cpu_before
                result["cpu_us_per_request"] = spent * 1e6 / max(1, result["requests"])
                result |= per_request(split_before, machine_split(redis_pids), result["requests"])
                runs[f"{server}:{mode}"].append(result)
            print(f"  throughput round {r + 1}/{rounds} done (load {loadavg()})", flush=True)
    finally:
        script.unlink(missing_ok=True)
    base = [run["rps"] for run in runs["plain:bare"]]
    out = {}
    for cell, results in runs.items():
        rps = [run["rps"] for run in results]
        ratios = [x / b for x, b in zip(rps, base, strict=True)]
        out[cell] = {
            "rps": statistics.median(rps),
            "rps_rounds": rps,
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "p50_ms": statistics.median(run["p50_us"] for run in results) / 1000,
            "p99_ms": statistics.median(run["p99_us"] for run in results) / 1000,
            "non2xx": sum(run["non2xx"] for run in results),
            # What the server's workers spent per answer: a load-independent figure, where
            # req/s moves with whatever else the shared machine runs.
            "cpu_us": (
                statistics.median(run["cpu_us_per_request"] for run in results)
                if all("cpu_us_per_request" in run for run in results)
                else None
            ),
            "errors": sum(run["errors"] for run in results),
        }
        for part in SPLIT:
            out[cell][f"{part}_us"] = statistics.median(run[f"{part}_us"] for run in results)
    return out
