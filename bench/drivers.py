"""Each PostgreSQL driver against its own floor, in one process, interleaved (issue 21, C51).

    PYTHONPATH=. .venv/bin/python bench/drivers.py [--rounds 5] [--per-round 150] [--before]

For psycopg2 and psycopg 3: replay from Redis, replay from PostgreSQL only, and first
execution (PostgreSQL only, and PostgreSQL + Redis), each as a ratio to its floor: the
bare route plus the raw round trips the path needs, made with *that* driver
(autocommit, its defaults: psycopg 3 prepares a statement from its fifth run).
``--before`` adds psycopg 3 as it ran before issue 21 (each statement in a transaction
of SQLAlchemy's, three round trips) for an A/B in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import paths as bench_paths
from bench.benchapp import create_app
from bench.harness import (
    Path_,
    WsgiCaller,
    counter_keys,
    loadavg,
    private_database,
    private_redis,
    ratio_to,
    run_rounds,
    summary,
)

PG = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def build(db_url: str, redis_url: str, driver: str, before: bool) -> list[Path_]:
    url = db_url.replace("postgresql+psycopg2://", f"postgresql+{driver}://")
    tag = driver + ("-before" if before else "")
    t = tag.replace("-", "_")
    ours_redis = create_app("ours", database_url=url, redis_url=redis_url, table=f"r_{t}")
    ours_pg = create_app("ours", database_url=url, table=f"p_{t}")
    apps = [ours_redis, ours_pg]
    if before:  # psycopg 3 before issue 21: no autocommit pool, no direct path
        for app in apps:
            store = app.extensions["idempotency"].store
            store._single = lambda: None  # type: ignore[method-assign]
            store._direct = lambda: None  # type: ignore[method-assign]
    fixed = {}
    for name, app in (("r", ours_redis), ("p", ours_pg)):
        fixed[name] = f"replay-{tag}-{name}-{uuid.uuid4().hex[:6]}"
        caller = WsgiCaller(app, "/pay")
        caller(fixed[name])
        assert caller.status.startswith("201"), caller.status
    paths = [
        bench_paths._wsgi(f"{tag}:replay-redis", "", "ours", WsgiCaller(ours_redis, "/pay"),
                          lambda: fixed["r"], True),
        bench_paths._wsgi(f"{tag}:replay-pg", "", "ours", WsgiCaller(ours_pg, "/pay"),
                          lambda: fixed["p"], True),
        bench_paths._wsgi(f"{tag}:first-pg", "", "ours", WsgiCaller(ours_pg, "/pay"),
                          counter_keys(f"np-{tag}"), False),
        bench_paths._wsgi(f"{tag}:first-redis", "", "ours", WsgiCaller(ours_redis, "/pay"),
                          counter_keys(f"nr-{tag}"), False),
    ]  # fmt: skip
    return paths


def floors(db_url: str, redis_url: str, driver: str, bare: WsgiCaller) -> list[Path_]:
    floor_app = create_app("ours", database_url=db_url, redis_url=redis_url, table=f"f_{driver}")
    before = bench_paths.redis_keys(redis_url)
    caller = WsgiCaller(floor_app, "/pay")
    caller(f"floor-{driver}")
    added = bench_paths.redis_keys(redis_url) - before
    cached = [k for k in added if not k.startswith(b"bench-floor")]
    digest = bench_paths.newest_digest(db_url, f"f_{driver}")
    floor = bench_paths.Floor(db_url, redis_url, f"f_{driver}", cached[0], digest, driver=driver)
    steps = bench_paths.floor_steps(floor)
    out = []
    for key in ("replay-redis", "replay-pg", "first-pg", "first-redis"):
        step = steps[key]

        def run(step: Any = step) -> None:
            bare(None)
            step()

        out.append(Path_(f"floor-{driver}:{key}", "", "floor", run))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=150)
    parser.add_argument("--before", action="store_true")
    parser.add_argument("--database-url", default=PG)
    args = parser.parse_args()
    with private_database(args.database_url) as db_url, private_redis() as redis_url:
        plain = create_app("plain")
        bare = WsgiCaller(plain, "/bare")
        paths = [bench_paths._wsgi("bare", "", "Flask", bare, lambda: None, False)]
        for driver in ("psycopg2", "psycopg"):
            paths += floors(db_url, redis_url, driver, bare)
            paths += build(db_url, redis_url, driver, before=False)
        if args.before:
            paths += build(db_url, redis_url, "psycopg", before=True)
        print(f"load before: {loadavg()}", flush=True)
        began = time.time()
        loads = run_rounds(
            paths, args.rounds, args.per_round, warmup=30, block_seconds=20.0, what="drivers"
        )
        print(f"{time.time() - began:.0f} s; loads {loads}")
        print(f"{'path':<28} {'p50 us':>8} {'p99 us':>8} {'cpu us':>8} {'spread %':>8}")
        for p in paths:
            s = summary(p)
            print(
                f"{p.name:<28} {s['p50_us']:>8.0f} {s['p99_us']:>8.0f} {s['cpu_us'] or 0:>8.0f}"
                f" {s['spread_pct']:>8.1f}"
            )
        by = {p.name: p for p in paths}
        print(f"{'path':<28} {'ratio to floor':>14}  (min-max over rounds)")
        tags = ["psycopg2", "psycopg"] + (["psycopg-before"] if args.before else [])
        for key in ("replay-redis", "replay-pg", "first-pg", "first-redis"):
            for tag in tags:
                floor = by[f"floor-{tag.split('-')[0]}:{key}"]
                r = ratio_to(by[f"{tag}:{key}"], floor)
                print(f"{tag + ':' + key:<28} {r['ratio']:>14.2f}  ({r['min']:.2f}-{r['max']:.2f})")
        for key in ("replay-pg", "first-pg"):
            r = ratio_to(by[f"floor-psycopg:{key}"], by[f"floor-psycopg2:{key}"])
            spread = f"({r['min']:.2f}-{r['max']:.2f})"
            print(f"floor psycopg/psycopg2 {key:<12} {r['ratio']:.2f} {spread}")


if __name__ == "__main__":
    main()
