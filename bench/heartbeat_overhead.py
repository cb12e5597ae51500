"""What the lease heartbeat costs a request (C44), and what a renewal costs the database.

    .venv/bin/python bench/heartbeat_overhead.py [--requests 2000] [--threads 4]

Runs one Flask app in-process on the real PostgreSQL with the durable store only
(no Redis), twice: ``IDEMPOTENCY_HEARTBEAT`` on and off. Each request is a new
key on a protected view that returns at once, so the layer's own work is all
there is to measure: claim, register with the renewer, complete, unregister.
``--threads`` clients send requests at the same time; the runs alternate in
rounds so that drift on a shared machine hits both alike. Then it times the
renewal statement itself (one fenced UPDATE per running owner, every lease/3).

Prints a Markdown table of per-request latency (median, p99) in milliseconds.
Everything runs in a private database, dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flask import Flask, jsonify
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.records import Identity

BASE_URL = os.environ.get(
    "IDEMPOTENCY_TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def build(url: str, heartbeat: bool) -> Flask:
    app = Flask(f"bench_heartbeat_{heartbeat}")
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=url,
        IDEMPOTENCY_TABLE="bench_heartbeat",
        IDEMPOTENCY_HEARTBEAT=heartbeat,
        IDEMPOTENCY_CREATE_TABLE=True,
    )
    Idempotency(app)

    @app.post("/pay")
    @idempotent
    def pay():  # type: ignore[no-untyped-def]
        return jsonify(ok=True), 201

    return app


def run(app: Flask, requests: int, threads: int, tag: str) -> list[float]:
    local = threading.local()

    def one(i: int) -> float:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = app.test_client()
        started = time.perf_counter()
        response = client.post(
            "/pay", json={"i": i}, headers={"Idempotency-Key": f"{tag}-{uuid.uuid4().hex}"}
        )
        elapsed = time.perf_counter() - started
        assert response.status_code == 201, response.data
        return elapsed * 1000

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, range(requests)))


def p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.99) - 1)]


def renewal_cost(app: Flask, samples: int) -> list[float]:
    """Milliseconds for one fenced renewal of one running claim (its own transaction)."""
    store = app.extensions["idempotency"].store
    ident = Identity(
        scope="bench", key_digest=uuid.uuid4().hex * 2, fingerprint="f", method="POST", path="/"
    )
    claim = store.acquire(ident, ttl=3600, lease=60)
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        assert store.renew([claim], 60.0) == {claim.record_id}
        times.append((time.perf_counter() - started) * 1000)
    store.release(claim)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    base = make_url(BASE_URL)
    name = f"bench_heartbeat_{uuid.uuid4().hex[:8]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = base.set(database=name).render_as_string(hide_password=False)
        apps = {True: build(url, True), False: build(url, False)}
        for app in apps.values():
            run(app, 200, args.threads, "warm")
        results: dict[bool, list[float]] = {True: [], False: []}
        per_round = args.requests // args.rounds
        for round_ in range(args.rounds):
            for on in (round_ % 2 == 0, round_ % 2 == 1):
                results[on] += run(apps[on], per_round, args.threads, f"r{round_}")
        renewals = renewal_cost(apps[True], 500)
        print(f"{args.requests} requests per mode, {args.threads} client threads, PostgreSQL\n")
        print("| heartbeat | median ms | p99 ms |")
        print("|---|---|---|")
        for on in (False, True):
            values = results[on]
            print(
                f"| {'on' if on else 'off'} | {statistics.median(values):.2f} | {p99(values):.2f} |"
            )
        print(
            f"\nOne fenced renewal (own transaction): median {statistics.median(renewals):.2f} ms,"
            f" p99 {p99(renewals):.2f} ms"
        )
        for app in apps.values():
            app.extensions["idempotency"].store.engine.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


if __name__ == "__main__":
    main()
