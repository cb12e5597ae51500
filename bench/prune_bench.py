"""How fast ``flask idempotency prune`` deletes, and what it costs the requests meanwhile.

    .venv/bin/python bench/prune_bench.py [--rows 1000000] [--batch-sizes 500,1000,5000,10000]

For each batch size: load ``--rows`` expired records into a fresh table with one
``INSERT … SELECT generate_series``, ``VACUUM ANALYZE``, then

1. measure claims on the idle table: ``--threads`` threads each claiming fresh
   keys (``DurableStore.acquire``, the request path's ``INSERT … ON CONFLICT``)
   with ``--think-ms`` between claims, a service at a steady moderate load;
2. run the prune (``Maintenance.prune_batch`` in a loop, in a separate process
   like a cron job would) and measure the same claims while it runs.

Prints a Markdown table: rows/s of the prune and the median (p50) and p95 claim
latency, idle and during the prune. Targets: ≥ 50,000 rows/s and a p50 during
the prune within 1.5× of the idle p50. Everything runs in a private database
that is dropped at the end. Figures, not a test: they depend on the machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

from flask_idempotency.records import Identity
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine
from flask_idempotency.store.maintenance import Maintenance

TABLE = "idempotency_bench"
TARGET_ROWS_PER_SECOND = 50_000
TARGET_LATENCY_RATIO = 1.5


@dataclass
class Run:
    batch_size: int
    rows: int
    load_seconds: float
    prune_seconds: float
    idle_p50_ms: float
    idle_p95_ms: float
    busy_p50_ms: float
    busy_p95_ms: float
    claims_during_prune: int

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.prune_seconds

    @property
    def ratio(self) -> float:
        return self.busy_p50_ms / self.idle_p50_ms

    @property
    def meets_targets(self) -> bool:
        return self.rows_per_second >= TARGET_ROWS_PER_SECOND and self.ratio <= TARGET_LATENCY_RATIO


def make_store(url: str) -> DurableStore:
    engine = create_store_engine(url)
    return DurableStore(lambda: engine, table_name=TABLE)


def load_expired_rows(store: DurableStore, rows: int) -> float:
    """A fresh table holding ``rows`` completed records that expired a while ago."""
    started = time.perf_counter()
    store.table.drop(store.engine, checkfirst=True)
    store.create_table()
    with store.autocommit.connect() as conn:
        conn.execute(
            text(
                f"""
                INSERT INTO {TABLE} (key_digest, scope, fingerprint, method, path, state,
                                     created_at_ms, expires_at_ms, completed_at_ms,
                                     response_status, response_headers, response_body)
                SELECT encode(sha256(int8send(g)), 'hex'), 'anonymous', repeat('f', 64),
                       'POST', '/payments', 'completed',
                       now_ms - 90000000, now_ms - 3600000 - g, now_ms - 89990000,
                       201, '[["Content-Type","application/json"]]',
                       convert_to('{{"id":' || g || ',"status":"succeeded"}}', 'UTF8')
                  FROM generate_series(1, :rows) AS g,
                       (SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)
                          AS now_ms) AS clock
                """
            ),
            {"rows": rows},
        )
        conn.execute(text(f"VACUUM ANALYZE {TABLE}"))
    return time.perf_counter() - started


class Claimers:
    """Threads claiming fresh keys at a steady pace, recording each claim's latency."""

    def __init__(self, store: DurableStore, threads: int, think: float) -> None:
        self.store = store
        self.threads = threads
        self.think = think
        self.latencies: list[tuple[float, float]] = []  # (finished at, seconds)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []

    def start(self) -> None:
        self._stop.clear()
        self._workers = [
            threading.Thread(target=self._work, daemon=True) for _ in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    def stop(self) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join()

    def _work(self) -> None:
        while not self._stop.is_set():
            key = uuid.uuid4().hex
            ident = Identity(
                scope="bench",
                key_digest=(key * 2)[:64],
                fingerprint="f" * 64,
                method="POST",
                path="/payments",
            )
            started = time.perf_counter()
            self.store.acquire(ident, ttl=86400, lease=60)
            finished = time.perf_counter()
            with self._lock:
                self.latencies.append((finished, finished - started))
            self._stop.wait(self.think)

    def between(self, start: float, end: float) -> list[float]:
        with self._lock:
            return [seconds for at, seconds in self.latencies if start <= at <= end]


def prune_in_child(url: str, batch_size: int, results: Any, go: Any) -> None:
    """The prune loop, in its own process as a cron job runs it."""
    store = make_store(url)
    maintenance = Maintenance(store)
    maintenance.count_prunable()  # connect before the clock starts
    go.wait()
    started = time.perf_counter()
    deleted = 0
    resume_at = None
    while True:
        batch = maintenance.prune_batch(batch_size, from_expiry=resume_at)
        deleted += batch.deleted
        resume_at = batch.last_expiry
        if batch.deleted < batch_size:
            break
    results.put((deleted, time.perf_counter() - started))
    store.engine.dispose()


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(
    url: str, batch_size: int, rows: int, threads: int, think: float, idle_seconds: float
) -> Run:
    store = make_store(url)
    load_seconds = load_expired_rows(store, rows)
    claimers = Claimers(store, threads, think)
    claimers.start()
    time.sleep(0.5)  # warm the pool
    idle_start = time.perf_counter()
    time.sleep(idle_seconds)
    idle_end = time.perf_counter()
    idle = claimers.between(idle_start, idle_end)

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    go = context.Event()
    child = context.Process(target=prune_in_child, args=(url, batch_size, results, go), daemon=True)
    child.start()
    time.sleep(1.0)  # let the child import and connect; it waits for `go`
    busy_start = time.perf_counter()
    go.set()
    deleted, prune_seconds = results.get(timeout=600)
    busy_end = time.perf_counter()
    child.join(timeout=30)
    claimers.stop()
    busy = claimers.between(busy_start, busy_end)
    store.engine.dispose()
    if deleted != rows:
        raise SystemExit(f"prune deleted {deleted} rows, expected {rows}")
    return Run(
        batch_size=batch_size,
        rows=deleted,
        load_seconds=load_seconds,
        prune_seconds=prune_seconds,
        idle_p50_ms=statistics.median(idle) * 1000,
        idle_p95_ms=percentile(idle, 0.95) * 1000,
        busy_p50_ms=statistics.median(busy) * 1000,
        busy_p95_ms=percentile(busy, 0.95) * 1000,
        claims_during_prune=len(busy),
    )


def private_database(base: URL) -> tuple[URL, Any]:
    admin = create_engine(base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    name = f"idem_bench_{os.getpid()}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return base.set(database=name), drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "IDEMPOTENCY_BENCH_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
        ),
        help="server to use; a private database is created on it and dropped afterwards",
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-sizes", default="500,1000,5000,10000")
    parser.add_argument("--threads", type=int, default=4, help="claiming threads")
    parser.add_argument("--think-ms", type=float, default=10.0, help="pause between claims")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    args = parser.parse_args()
    batch_sizes = [int(part) for part in args.batch_sizes.split(",") if part.strip()]
    # `kill <pid>` still drops the private database on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(1))

    url, drop = private_database(make_url(args.database_url))
    runs: list[Run] = []
    try:
        for batch_size in batch_sizes:
            print(
                f"batch size {batch_size}: loading {args.rows} rows…", file=sys.stderr, flush=True
            )
            run = measure(
                url.render_as_string(hide_password=False),
                batch_size,
                args.rows,
                args.threads,
                args.think_ms / 1000,
                args.idle_seconds,
            )
            print(
                f"  pruned in {run.prune_seconds:.2f}s ({run.rows_per_second:,.0f} rows/s),"
                f" claim p50 {run.idle_p50_ms:.2f} → {run.busy_p50_ms:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
    finally:
        drop()

    print(
        f"\nPrune of {args.rows:,} expired rows; {args.threads} threads claiming"
        f" (think {args.think_ms:g} ms); PostgreSQL {server_version(args.database_url)},"
        f" {os.cpu_count()} CPUs.\n"
    )
    print(
        "| batch size | prune s | rows/s | claim p50 idle ms | claim p50 during prune ms"
        " | ratio | claim p95 idle ms | claim p95 during prune ms | meets targets |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for run in runs:
        print(
            f"| {run.batch_size} | {run.prune_seconds:.2f} | {run.rows_per_second:,.0f}"
            f" | {run.idle_p50_ms:.2f} | {run.busy_p50_ms:.2f} | {run.ratio:.2f}"
            f" | {run.idle_p95_ms:.2f} | {run.busy_p95_ms:.2f}"
            f" | {'yes' if run.meets_targets else 'no'} |"
        )
    good = [run for run in runs if run.meets_targets]
    if good:
        best = max(good, key=lambda run: run.rows_per_second)
        print(
            f"\nLargest throughput within both targets: --batch-size {best.batch_size}"
            f" ({best.rows_per_second:,.0f} rows/s, p50 ratio {best.ratio:.2f})."
        )
    else:
        print("\nNo batch size met both targets on this machine.")


def server_version(url: str) -> str:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return str(conn.execute(text("SHOW server_version")).scalar_one()).split()[0]
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
