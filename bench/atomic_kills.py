"""What transactional mode buys: the same SIGKILL schedule with and without ``atomic=True`` (C40).

    .venv/bin/python bench/atomic_kills.py [--keys 72] [--seed 40] [--lease 2]

Runs the payments app (tests/apps/atomicapp.py) under gunicorn twice, once with
``@idempotent(atomic=True)`` (the extension commits the payment and the record
together) and once as typical code (the view commits the payment itself, the
record completes afterwards). Both runs get the same kill schedule
(tests/support/kill_campaign.py): per key, a kill aimed before the write, one
while the write is pending, one after the view's work, and one at a random
instant of a short request; killed keys rest until their lease lapses and are
tried again. Then every key is retried until it answers 201, and the payments
table is counted. ``idem_key`` there is deliberately not unique, so a duplicate
charge is a second row.

Prints a Markdown table. Everything runs in a private database, dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

from tests.support.kill_campaign import (
    AtomicHarness,
    KillCampaign,
    audit,
    body_for,
    make_schedule,
    settle_all,
)

PHASE_LABELS = (
    ("started", "before the write"),
    ("written", "write pending"),
    ("finishing", "after the view's work"),
    ("committed", "after the commit"),
)


def run_mode(url: URL, *, atomic: bool, keys: int, seed: int, lease: float) -> dict[str, object]:
    """One mode: kill as scheduled, settle every key, count the business rows."""
    harness = AtomicHarness(
        url, f"idem_bench_{'atomic' if atomic else 'plain'}_{uuid.uuid4().hex[:6]}"
    )
    try:
        started = time.monotonic()
        server = harness.server(atomic=atomic, lease=lease)
        names = [f"bench-{i}" for i in range(keys)]
        bodies = {name: body_for(name, i) for i, name in enumerate(names)}
        result = KillCampaign(
            harness, server, make_schedule(names, seed), bodies, lease=lease
        ).run()
        server.wait_for_workers()
        answers = settle_all(server.url, bodies)
        unsettled = sorted(name for name, answer in answers.items() if answer.status_code != 201)
        if unsettled:
            raise SystemExit(f"keys that never completed: {unsettled[:5]} …")
        found = audit(harness, names)
        return {
            "mode": "`atomic=True`" if atomic else "view commits itself",
            "keys": keys,
            "kills": len(result.kills),
            "phases": " / ".join(str(result.phases.get(phase, 0)) for phase, _ in PHASE_LABELS),
            "executions": harness.attempt_count(),
            "duplicates": len(found.keys_with_duplicates),
            "rows": found.total_rows,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        harness.close()


def private_database(base: URL) -> tuple[URL, object]:
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"idem_bench_atomic_{os.getpid()}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return base.set(database=name), admin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=72)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "IDEMPOTENCY_TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args()
    url, admin = private_database(make_url(args.database_url))
    try:
        rows = [
            run_mode(url, atomic=atomic, keys=args.keys, seed=args.seed, lease=args.lease)
            for atomic in (True, False)
        ]
    finally:
        with admin.connect() as conn:  # type: ignore[attr-defined]
            conn.execute(text(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)'))
        admin.dispose()  # type: ignore[attr-defined]

    phases = " / ".join(label for _, label in PHASE_LABELS)
    print(
        "| mode | keys | SIGKILLs | killed at: " + phases + " | view executions"
        " | keys with duplicate business rows | business rows | seconds |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['keys']} | {row['kills']} | {row['phases']}"
            f" | {row['executions']}"
            f" | {row['duplicates']} | {row['rows']} | {row['seconds']} |"
        )
    print(
        f"\nSeed {args.seed}, lease {args.lease:g} s, 3 sync gunicorn workers (preloaded), 3 lanes."
    )


if __name__ == "__main__":
    main()
