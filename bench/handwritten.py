"""What each piece of hand-written wire code saves on the full request (issue 21, item 3).

    PYTHONPATH=. .venv/bin/python bench/handwritten.py [--rounds 5] [--per-round 150]

``flask_idempotency/_wire/`` goes below three libraries' public APIs to save CPU.
Each piece has a public-API fallback the package takes by itself when a library
release breaks what the piece relies on; this measures, in one process and the same
interleaved rounds (real PostgreSQL, a private Redis, in-process WSGI calls as
``bench/drivers.py`` makes them), the full request with the piece on and with
exactly that fallback:

- ``redis-off``: no pre-packed reader (``_reader_for`` finds none): the cache's ``GET``
  goes through ``client.get``, the completion's ``SET`` + ``EXISTS`` through a pipeline;
- ``lean-off``: ``sqla_pool._POOL_ENTRY_API`` false (what the import-time signature
  check sets): the direct path checks out through ``pool.connect()``;
- ``direct-off``: no psycopg2 direct path (``store.engines.supported`` false at set-up):
  SQLAlchemy's ``Connection`` on the same autocommit pool;
- ``unprepared``: no ``PREPARE`` (the path a pooler forces): all that is left of
  ``_wire/psycopg2.py``, since psycopg2 quotes the values itself again (its literal
  writer was measured here, 0.96–1.00× of psycopg2's quoting on the full request, and
  removed: ``bench/results/handwritten.md``);
- ``pg3`` / ``pg3-lean-off``: psycopg 3's direct path (its own API, nothing
  hand-written but the shared pool checkout) with the lean checkout on and off.

``twin`` is a second app identical to ``on``: what two apps of one process differ by
when nothing else does, the noise a saving must clear. Ratios are ``on ÷ off``, the
median over rounds of the two paths' p50s in the same round, with its per-round range.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import paths as bench_paths
from bench.benchapp import create_app
from bench.harness import (
    DEFAULT_DATABASE_URL,
    Path_,
    WsgiCaller,
    counter_keys,
    loadavg,
    private_database,
    private_redis,
    ratio_to,
    round_medians,
    run_rounds,
    summary,
    versions,
)
from flask_idempotency._wire import sqla_pool
from flask_idempotency.store import engines as store_engines

_PG = ("replay-pg", "first-pg", "first-redis")
#: (variant, driver, paths measured); what each switches off: the module docstring.
VARIANTS: list[tuple[str, str, tuple[str, ...]]] = [
    ("on", "psycopg2", ("replay-redis", *_PG)),
    ("twin", "psycopg2", ("replay-redis", *_PG)),
    ("redis-off", "psycopg2", ("replay-redis", "first-redis")),
    ("lean-off", "psycopg2", _PG),
    ("unprepared", "psycopg2", _PG),
    ("direct-off", "psycopg2", _PG),
    ("pg3", "psycopg", _PG),
    ("pg3-lean-off", "psycopg", _PG),
]

#: (piece, variant with it on, variant with its fallback) in report order.
COMPARISONS = [
    ("noise: two identical apps", "on", "twin"),
    ("_wire/redis.py (pre-packed GET, SET+EXISTS)", "on", "redis-off"),
    ("_wire/sqla_pool.py lean checkout, psycopg2", "on", "lean-off"),
    ("_wire/sqla_pool.py lean checkout, psycopg 3", "pg3", "pg3-lean-off"),
    ("psycopg2 hand PREPARE/EXECUTE", "on", "unprepared"),
    ("psycopg2 direct path vs SQLAlchemy Connection", "on", "direct-off"),
]

PATH_NAMES = {
    "replay-redis": "replay from Redis",
    "replay-pg": "replay from PostgreSQL",
    "first-pg": "first execution, PostgreSQL only",
    "first-redis": "first execution, PostgreSQL + Redis",
}


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for the duration (a module flag, as a library change would set it)."""
    kept = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, kept)


def make_app(variant: str, driver: str, db_url: str, redis_url: str | None) -> Any:
    """One bench app of ``variant``, its store set up by a first request (the switches that
    act at set-up are taken then), its pieces checked to be on or off as meant."""
    url = db_url.replace("postgresql+psycopg2://", f"postgresql+{driver}://")
    tier = "r" if redis_url else "p"
    table = f"hw_{variant.replace('-', '_')}_{tier}"
    app = create_app("ours", database_url=url, redis_url=redis_url, table=table)
    state = app.extensions["idempotency"]
    setup = (
        patched(store_engines, "supported", lambda engine: False)
        if variant == "direct-off"
        else contextlib.nullcontext()
    )
    with setup:
        caller = WsgiCaller(app, "/pay")
        caller(f"setup-{variant}-{tier}-{uuid.uuid4().hex[:6]}")
        assert caller.status.startswith("201"), caller.status
    store = state.store
    runner = store._direct_runner
    if variant == "direct-off":
        assert store._direct() is None
    else:
        assert runner is not None and store._direct() is runner
        pool = runner._engine.pool
        lean = runner._cursors._lean
        with patched(sqla_pool, "_POOL_ENTRY_API", False):
            assert not lean(pool)
        assert lean(pool), "the lean checkout is not taken: lean-off would measure nothing"
    if redis_url:
        if variant == "redis-off":
            state.cache._reader = None  # what _reader_for returns for a client it cannot serve
        assert (state.cache._reader is None) == (variant == "redis-off")
    if variant == "unprepared":
        runner.prepare = False
    return app


def lean_off(run: Callable[[], None]) -> Callable[[], None]:
    """``run`` with ``sqla_pool._POOL_ENTRY_API`` false: the flag the import-time check sets."""

    def off() -> None:
        sqla_pool._POOL_ENTRY_API = False
        try:
            run()
        finally:
            sqla_pool._POOL_ENTRY_API = True

    return off


def build(db_url: str, redis_url: str) -> list[Path_]:
    """The bare route and every variant's paths, each replay path's record stored first."""
    bare = WsgiCaller(create_app("plain"), "/bare")
    out = [bench_paths._wsgi("bare", "", "Flask", bare, lambda: None, False)]
    for variant, driver, wanted in VARIANTS:
        apps = {
            "redis": make_app(variant, driver, db_url, redis_url),
            "pg": make_app(variant, driver, db_url, None),
        }
        for key in wanted:
            app = apps["redis" if key.endswith("redis") else "pg"]
            caller = WsgiCaller(app, "/pay")
            if key.startswith("replay"):
                fixed = f"replay-{variant}-{key}-{uuid.uuid4().hex[:6]}"
                caller(fixed)
                assert caller.status.startswith("201"), caller.status
                path = bench_paths._wsgi(
                    f"{variant}:{key}", "", "ours", caller, lambda f=fixed: f, True
                )
            else:
                keys = counter_keys(f"{variant}-{key}")
                path = bench_paths._wsgi(f"{variant}:{key}", "", "ours", caller, keys, False)
            if variant.endswith("lean-off"):
                path.run = lean_off(path.run)
            out.append(path)
    return out


def cpu_ratio(path: Path_, base: Path_) -> dict[str, float]:
    """:func:`~bench.harness.ratio_to` for CPU per request: on a first execution the wall
    time is mostly the commit's flush to disk, the same for both, and hides the CPU."""
    ratios = [p / b for p, b in zip(round_medians(path.cpu), round_medians(base.cpu), strict=True)]
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def table(by: dict[str, Path_]) -> list[str]:
    """The markdown table: each piece on vs its fallback, per path, and the bare route."""
    lines = [
        "| piece (on vs off) | path | p50 µs on / off | p99 µs on / off | CPU µs on / off"
        " | wall on ÷ off (rounds) | CPU on ÷ off (rounds) | saves: wall, CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    bare = summary(by["bare"])
    lines.append(
        f"| bare route (scale) | | {bare['p50_us']:.0f} | {bare['p99_us']:.0f}"
        f" | {bare['cpu_us']:.0f} | | | |"
    )
    for piece, on, off in COMPARISONS:
        for key in PATH_NAMES:
            a, b = by.get(f"{on}:{key}"), by.get(f"{off}:{key}")
            if a is None or b is None:
                continue
            sa, sb = summary(a), summary(b)
            r, c = ratio_to(a, b), cpu_ratio(a, b)
            # From the ratio (each round's own pair): on a busy machine the difference
            # of two medians taken over different rounds says less.
            saved = (1 - r["ratio"]) * sb["p50_us"]
            saved_cpu = sb["cpu_us"] - sa["cpu_us"]
            lines.append(
                f"| {piece} | {PATH_NAMES[key]} | {sa['p50_us']:.0f} / {sb['p50_us']:.0f}"
                f" | {sa['p99_us']:.0f} / {sb['p99_us']:.0f}"
                f" | {sa['cpu_us']:.0f} / {sb['cpu_us']:.0f}"
                f" | {r['ratio']:.3f} ({r['min']:.3f}–{r['max']:.3f})"
                f" | {c['ratio']:.3f} ({c['min']:.3f}–{c['max']:.3f})"
                f" | {100 * (1 - r['ratio']):.1f} % ({saved:.0f} µs), {saved_cpu:.0f} µs |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=150)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    args = parser.parse_args()
    # Each app's one-time advice (no scope loader registered) is not what is measured.
    logging.getLogger("flask_idempotency").setLevel(logging.ERROR)
    with private_database(args.database_url) as db_url, private_redis() as redis_url:
        paths = build(db_url, redis_url)
        info = versions(db_url, redis_url)
        load_before = loadavg()
        began = time.time()
        loads = run_rounds(
            paths, args.rounds, args.per_round, warmup=30, block_seconds=20.0, what="handwritten"
        )
        took = time.time() - began
    by = {p.name: p for p in paths}
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"\n### Run of {when}\n")
    print(
        f"{args.rounds} rounds × {args.per_round}, {took:.0f} s; load average before"
        f" {load_before}, after each round {', '.join(loads)}"
        f" (median {statistics.median(float(x) for x in loads):.2f})."
    )
    print(
        f"{info['cpu']}, {info['cores']} cores; Python {info['python']}, PostgreSQL"
        f" {info['postgresql']} (synchronous_commit={info['synchronous_commit']}), Redis"
        f" {info['redis']}; Flask {info['flask']}, SQLAlchemy {info['sqlalchemy']}, redis-py"
        f" {info['redis-py']}, psycopg2 {info['psycopg2']}, psycopg {_version('psycopg')}.\n"
    )
    print("\n".join(table(by)))


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
