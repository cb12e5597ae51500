"""How soon the Redis tier is back after Redis is: gunicorn workers under load (C54).

Starts a private redis-server (or a Sentinel group: master, replica, three sentinels)
on free loopback ports, and gunicorn (3 workers x 16 threads, ``bench/recoveryapp.py``)
on PostgreSQL from ``BENCH_DATABASE_URL`` (default
``postgresql+psycopg2://postgres@127.0.0.1:5432/test``, a table of its own, dropped
after). Client threads replay completed keys without pause (and every fourth request is
a first execution, whose cached copy is a write) while Redis is SIGKILLed and
started again a second later (``--mode kill``), or a ``SENTINEL FAILOVER`` is forced
(``--mode sentinel``), or the Sentinel group's master is SIGKILLed and its replica
promoted (``--mode sentinel-kill``). For each worker it reports, counted from the moment Redis
answered again (the restarted server's first ``PING``; the sentinels agreeing on the
new master): the first replay that worker served from the cache, and the first moment
its tier said it was out of its back-off with its wake-up listener subscribed (the
state in which a parked request gets its wake-up by message).

    python bench/redis_recovery.py [--mode kill|sentinel|sentinel-kill] [--rounds 3] [--clients 24]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sqlalchemy import MetaData, Table, create_engine

from tests.support.binaries import system_binary
from tests.support.gunicorn import GunicornServer
from tests.support.redis_cluster import SentinelGroup
from tests.support.redis_server import RedisServer

DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def one_round(mode: str, clients: int, directory: Path) -> dict[str, Any]:
    binary = system_binary("redis-server")
    assert binary, "redis-server is not on PATH"
    redis: Any
    if mode == "kill":
        redis = RedisServer(binary, directory / "redis").start()
    else:
        redis = SentinelGroup(binary, directory / "sentinel").start()
    table = f"recovery_{uuid.uuid4().hex[:10]}"
    server = GunicornServer(
        "bench.recoveryapp:create_app()",
        env={"DATABASE_URL": DATABASE_URL, "IDEM_TABLE": table, "REDIS_URL": redis.url},
        workers=3,
        threads=16,
    )
    try:
        server.start()
        return _measure(mode, server, redis, clients)
    finally:
        server.stop()
        redis.stop()
        engine = create_engine(DATABASE_URL)
        with engine.begin() as conn:
            Table(table, MetaData()).drop(conn, checkfirst=True)
        engine.dispose()


def _measure(mode: str, server: GunicornServer, redis: Any, clients: int) -> dict[str, Any]:
    keys = [f"recovery-{n}" for n in range(clients)]
    warm = requests.Session()
    for key in keys:
        assert warm.post(f"{server.url}/pay", headers={"Idempotency-Key": key}).status_code == 201
    pids = server.worker_pids()
    stop = threading.Event()
    served: list[tuple[float, int, str | None, int]] = []
    tiers: list[tuple[float, int, bool, bool]] = []

    def replay(n: int) -> None:
        session = requests.Session()
        turn = 0
        while not stop.is_set():
            turn += 1  # every fourth request a first execution: its copy is a write
            key = keys[n] if turn % 4 else f"new-{n}-{turn}-{uuid.uuid4().hex[:6]}"
            answer = session.post(f"{server.url}/pay", headers={"Idempotency-Key": key}, timeout=30)
            served.append(
                (
                    time.monotonic(),
                    int(answer.headers.get("X-Worker-Pid", 0)),
                    answer.headers.get("X-Replay-Source"),
                    answer.status_code,
                )
            )

    def watch() -> None:
        while not stop.is_set():
            try:  # a new connection each time: a kept one stays with one worker
                state = requests.get(
                    f"{server.url}/tier", headers={"Connection": "close"}, timeout=30
                ).json()
            except requests.RequestException:
                continue
            tiers.append((time.monotonic(), state["pid"], state["down"], state["live"]))
            time.sleep(0.005)

    threads = [threading.Thread(target=replay, args=(n,)) for n in range(clients)]
    threads += [threading.Thread(target=watch) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(2.0)
        if mode == "kill":
            redis.kill()
            time.sleep(1.0)
            redis.start()  # returns once the new server answers PING
        elif mode == "sentinel":
            redis.failover()  # returns once the sentinels agree on the new master
        else:  # the master SIGKILLed: the sentinels notice (1 s) and promote the replica
            before = redis.master_port()
            (redis.master if before == redis.master.port else redis.replica).kill()
            while _master_port(redis) in (before, None):
                time.sleep(0.02)
        answering = time.monotonic()
        time.sleep(15.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    statuses = collections.Counter(status for _, _, _, status in served)
    cache: dict[int, float] = {}
    wakeups: dict[int, float] = {}
    for at, pid, source, _ in served:
        if at > answering and source == "cache" and pid not in cache:
            cache[pid] = at - answering
    for at, pid, down, live in tiers:
        if at > answering and not down and live and pid not in wakeups:
            wakeups[pid] = at - answering
    return {
        "statuses": dict(statuses),
        "cache": [round(cache.get(pid, float("inf")), 2) for pid in pids],
        "wakeups": [round(wakeups.get(pid, float("inf")), 2) for pid in pids],
        "replays": len(served),
    }


def _master_port(group: SentinelGroup) -> int | None:
    try:
        return group.master_port()
    except (IndexError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["kill", "sentinel", "sentinel-kill"], default="kill")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=24)
    args = parser.parse_args()
    for n in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="recovery-") as directory:
            result = one_round(args.mode, args.clients, Path(directory))
        load = os.getloadavg()[0]
        print(
            f"{args.mode} round {n + 1}: seconds after Redis answered, per worker:"
            f" cache {result['cache']}, wake-ups {result['wakeups']};"
            f" {result['replays']} requests {result['statuses']}; load {load:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
