"""CPU per request of each path, in-process, against its floor: quick enough for a busy machine.

    .venv/bin/python bench/cpu_per_request.py [--rounds 5] [--per-round 1500] [--profile]

Where ``make bench`` takes minutes and judges wall-clock ratios, this takes about a
minute and judges the CPU this process spends per request (``time.process_time_ns``),
which other work on a shared machine moves far less than wall time. Paths, interleaved
round by round (each round runs every path once), per PostgreSQL driver:

- ``bare``: the bare route of an app without the extension;
- ``floor``: the same plus one raw redis-py GET (the floor of a replay from Redis);
- ``replay``: a replay from Redis of the protected route;
- ``first``: a first execution (new key each time) on PostgreSQL + Redis.

Reports the median over rounds of each round's mean CPU µs per request, the spread over
rounds (the run's noise), the replay's CPU above its floor and the load average.
``--profile`` adds the top own-time functions of a replay and a first execution
(``PROFILE_SORT=cumulative`` and ``PROFILE_TOP=N`` change the order and the length).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
import sqlalchemy as sa

from bench.benchapp import create_app
from bench.paths import Floor

DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
TABLE = "idempotency_cpu_bench"
BODY = b'{"amount": 1999, "currency": "EUR"}'
DRIVERS = {"psycopg2": "postgresql+psycopg2", "psycopg 3": "postgresql+psycopg"}


def _environ(path: str, key: str | None) -> dict[str, Any]:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(BODY),
        "wsgi.errors": sys.stderr,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(BODY)),
    }
    if key is not None:
        environ["HTTP_IDEMPOTENCY_KEY"] = key
    return environ


def _caller(app: Any, path: str, key: Callable[[], str | None]) -> Callable[[], None]:
    def start_response(status: str, headers: Any, exc_info: Any = None) -> None:
        return None

    def call() -> None:
        out = app(_environ(path, key()), start_response)
        try:
            b"".join(out)
        finally:
            getattr(out, "close", lambda: None)()

    return call


def build(database_url: str, redis_url: str, driver: str) -> dict[str, Callable[[], None]]:
    """The five paths of one driver."""
    ours = create_app("ours", database_url=database_url, redis_url=redis_url, table=TABLE)
    plain = create_app("plain")
    client = redis.Redis.from_url(redis_url)
    client.set("cpu-bench:floor", b"x" * 300)
    bare = _caller(plain, "/bare", lambda: None)
    replay_key = f"replay-{uuid.uuid4().hex}"
    replay = _caller(ours, "/pay", lambda: replay_key)
    first = _caller(ours, "/pay", lambda: uuid.uuid4().hex)
    replay()
    replay()  # the second answered from Redis: the path measured
    raw = Floor(database_url, redis_url, TABLE, *_replayed(redis_url, database_url), driver)

    def floor() -> None:
        bare()
        client.get("cpu-bench:floor")

    def first_floor() -> None:
        bare()
        raw.set_publish(raw.claim_and_complete())

    return {
        "bare": bare,
        "floor": floor,
        "replay": replay,
        "first-floor": first_floor,
        "first": first,
    }


def _replayed(redis_url: str, database_url: str) -> tuple[bytes, str]:
    """The Redis name and digest of a record the app stored (what the raw floor reads)."""
    with sa.create_engine(database_url).connect() as connection:
        digest = connection.execute(sa.text(f"SELECT key_digest FROM {TABLE} LIMIT 1")).scalar()
    names = list(redis.Redis.from_url(redis_url).scan_iter(match=f"*{digest}*"))
    return names[0], str(digest)


def measure(paths: dict[str, dict[str, Callable[[], None]]], rounds: int, per_round: int) -> Any:
    """CPU µs per request per round, every path once per round."""
    cpu: dict[str, list[float]] = {}
    for _ in range(rounds):
        for driver, steps in paths.items():
            for name, step in steps.items():
                n = per_round // 4 if name.startswith("first") else per_round
                started = time.process_time_ns()
                for _ in range(n):
                    step()
                cpu.setdefault(f"{driver}:{name}", []).append(
                    (time.process_time_ns() - started) / n / 1000
                )
    return cpu


def profile(step: Callable[[], None], n: int, top: int = 15) -> str:
    """The functions with the most own CPU time over ``n`` calls of ``step``."""
    profiler = cProfile.Profile(time.process_time)  # CPU, not the waits
    profiler.enable()
    for _ in range(n):
        step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(
        os.environ.get("PROFILE_SORT", "tottime")
    ).print_stats(int(os.environ.get("PROFILE_TOP", top)))
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=1500)
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    base = sa.make_url(args.database_url)
    load_start = os.getloadavg()
    paths = {
        driver: build(
            base.set(drivername=name).render_as_string(False), args.redis_url, name.split("+")[1]
        )
        for driver, name in DRIVERS.items()
    }
    cpu = measure(paths, args.rounds, args.per_round)
    print(f"load at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print(f"{args.rounds} interleaved rounds; CPU µs per request: median (min–max over rounds)")
    for cell, values in cpu.items():
        print(
            f"  {cell:20s} {statistics.median(values):7.1f}  ({min(values):.1f}–{max(values):.1f})"
        )
    for driver in paths:
        floors = cpu[f"{driver}:floor"]
        replays = cpu[f"{driver}:replay"]
        above = [r - f for r, f in zip(replays, floors, strict=True)]
        ratio = [r / f for r, f in zip(replays, floors, strict=True)]
        print(
            f"  {driver}: replay from Redis − floor {statistics.median(above):.1f} µs CPU"
            f" ({min(above):.1f}–{max(above):.1f}); ÷ floor {statistics.median(ratio):.3f}"
        )
        firsts = [
            a / b for a, b in zip(cpu[f"{driver}:first"], cpu[f"{driver}:first-floor"], strict=True)
        ]
        print(f"  {driver}: first execution ÷ its floor {statistics.median(firsts):.3f}")
    if args.profile:
        for driver, steps in paths.items():
            print(f"\n### {driver}: replay from Redis\n{profile(steps['replay'], 2000)}")
            print(f"\n### {driver}: first execution\n{profile(steps['first'], 300)}")
    with sa.create_engine(args.database_url).begin() as connection:
        connection.execute(sa.text(f"DROP TABLE IF EXISTS {TABLE}"))


if __name__ == "__main__":
    main()
