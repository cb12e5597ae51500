"""The MariaDB paths of the store, with the raw-driver floor measured in the same run.

    python bench/mariadb.py [--url mysql+pymysql://root@127.0.0.1:3306/test] [-n 2000]

For each driver (PyMySQL, and mysqlclient when installed) it times, one caller
at a time on one connection pool:

* floor ``SELECT 1``: one round trip through the raw DB-API driver (autocommit);
* floor claim: the claim's own statements through the raw driver (``BEGIN``,
  ``INSERT … ON DUPLICATE KEY UPDATE``, ``SELECT``, ``COMMIT``), no SQLAlchemy;
* store claim (new key), store complete, store replay read (``acquire`` on a
  completed key), through :class:`DurableStore`;
* a protected Flask request, first execution and replay, through the test client.

Prints a Markdown table of median and p99 in microseconds. The table is created
in the given database under a random name and dropped afterwards.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flask import Flask, jsonify
from sqlalchemy.engine import make_url

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import Claim, Identity, StoredResponse
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine

RESPONSE = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id":1}')


def timed(n: int, op: Callable[[int], Any]) -> tuple[float, float]:
    """Median and p99 of ``op(i)`` in microseconds over ``n`` calls, after 50 warm-ups."""
    for i in range(50):
        op(-1 - i)
    samples = []
    for i in range(n):
        start = time.perf_counter()
        op(i)
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def ident(key: str) -> Identity:
    return Identity("anonymous", key_digest("anonymous", key), "f" * 64, "POST", "/pay")


def raw_connect(url: Any) -> Any:
    kwargs = {
        "host": url.host or "127.0.0.1",
        "port": url.port or 3306,
        "user": url.username or "root",
        "password": url.password or "",
        "database": url.database,
        "charset": "utf8mb4",
    }
    if url.get_driver_name() == "mysqldb":
        import MySQLdb

        kwargs["passwd"] = kwargs.pop("password")
        kwargs["db"] = kwargs.pop("database")
        return MySQLdb.connect(**kwargs)
    import pymysql

    return pymysql.connect(**kwargs)


def bench_driver(url: Any, n: int) -> list[tuple[str, float, float]]:
    engine = create_store_engine(url.render_as_string(hide_password=False))
    table = f"bench_{uuid.uuid4().hex[:10]}"
    store = DurableStore(lambda: engine, table_name=table)
    store.create_table()
    run = uuid.uuid4().hex[:8]
    rows: list[tuple[str, float, float]] = []
    try:
        raw = raw_connect(url)
        raw.autocommit(True)
        cursor = raw.cursor()
        rows.append(
            ("floor: SELECT 1 (raw driver)", *timed(n, lambda i: cursor.execute("SELECT 1")))
        )

        claim_sql = (
            f"INSERT INTO `{table}` (key_digest, scope, fingerprint, method, path, state,"
            " lock_token, created_at_ms, expires_at_ms, lease_expires_at_ms)"
            " VALUES (%s, 'anonymous', %s, 'POST', '/pay', 'in_progress', %s,"
            " 0, 86400000, 60000) ON DUPLICATE KEY UPDATE id = id"
        )
        select_sql = f"SELECT * FROM `{table}` WHERE key_digest = %s"

        def raw_claim(i: int) -> None:
            digest = key_digest("raw", f"{run}-{i}")
            cursor.execute("BEGIN")
            cursor.execute(claim_sql, (digest, "f" * 64, uuid.uuid4().hex))
            cursor.execute(select_sql, (digest,))
            cursor.fetchall()
            cursor.execute("COMMIT")

        rows.append(("floor: claim statements (raw driver)", *timed(n, raw_claim)))
        raw.close()

        claims: dict[int, Claim] = {}

        def claim(i: int) -> None:
            outcome = store.acquire(ident(f"{run}-s-{i}"), ttl=86400, lease=60)
            assert isinstance(outcome, Claim)
            claims[i] = outcome

        rows.append(("store: claim a new key", *timed(n, claim)))
        rows.append(("store: complete", *timed(n, lambda i: store.complete(claims[i], RESPONSE))))
        rows.append(
            (
                "store: replay read (completed key)",
                *timed(
                    n, lambda i: store.acquire(ident(f"{run}-s-{max(i, 0)}"), ttl=86400, lease=60)
                ),
            )
        )

        app = Flask("bench_mariadb")
        app.config.update(
            IDEMPOTENCY_DATABASE_URI=url.render_as_string(hide_password=False),
            IDEMPOTENCY_TABLE=table,
        )
        ext = Idempotency(app)
        ext.scope_loader(lambda: "bench")

        @app.post("/pay")
        @idempotent
        def pay() -> Any:
            return jsonify(id=1), 201

        client = app.test_client()

        def first(i: int) -> None:
            response = client.post("/pay", json={}, headers={"Idempotency-Key": f"{run}-f-{i}"})
            assert response.status_code == 201

        def replay(i: int) -> None:
            response = client.post(
                "/pay", json={}, headers={"Idempotency-Key": f"{run}-f-{max(i, 0)}"}
            )
            assert response.headers.get("Idempotent-Replayed") == "true"

        rows.append(("flask: first execution", *timed(n, first)))
        rows.append(("flask: replay (from MariaDB, no Redis)", *timed(n, replay)))
        app.extensions["idempotency"].store.engine.dispose()
    finally:
        store.table.drop(engine, checkfirst=True)
        engine.dispose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="mysql+pymysql://root@127.0.0.1:3306/test")
    parser.add_argument("-n", type=int, default=2000)
    args = parser.parse_args()
    base = make_url(args.url)
    drivers = ["pymysql"]
    try:
        import MySQLdb  # noqa: F401

        drivers.append("mysqldb")
    except ImportError:
        print("mysqlclient is not installed: PyMySQL only", file=sys.stderr)
    with raw_connect(base) as probe:
        cursor = probe.cursor()
        cursor.execute("SELECT VERSION()")
        version = cursor.fetchone()[0]
    print(f"MariaDB/MySQL {version}, n={args.n} per row, one caller at a time\n")
    print("| driver | path | median µs | p99 µs |")
    print("|---|---|---:|---:|")
    for driver in drivers:
        for name, median, p99 in bench_driver(base.set(drivername=f"mysql+{driver}"), args.n):
            print(f"| {driver} | {name} | {median:.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
