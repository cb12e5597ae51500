"""Asynchronous replication under a failover, in numbers (issue 25 item 4, C55).

    .venv/bin/python bench/async_failover.py [--lags 0,0.2,1.0] [--sync-lag 0.2]
        [--driver psycopg2] [--out bench/results/async_failover.md]

For each replication lag, a Patroni pair with ``synchronous_mode: false`` (etcd and two
PostgreSQL nodes on loopback, tests/support/patroni.py) whose standby streams the WAL
through a proxy that delivers it ``lag`` seconds late (tests/support/lag_proxy.py; lag 0:
no proxy, the standby streams directly). The storm of tests/failover (60 keys x 4
duplicates, 16 clients honouring ``Retry-After``, views of 0.4-1.0 s, lease 40 s, under
gunicorn) runs against it; mid-storm, with views running, the primary is SIGKILLed and
its proxy cut at the same moment (the host and its network die together: WAL still on
its way is never delivered). Patroni promotes the standby about 20 s later.

Two seconds after the kill, before the promotion, the standby's copy of the records
table is read: exactly what the new primary starts from. Compared with the app's
ledger (tests/failover/failapp.py), that says which writes the old primary had
committed, and acknowledged, that the failover lost:

- a lost *claim*: the view ran (or runs) but the new primary has no record of the key,
  so the next duplicate claims it afresh and runs the view again at once;
- a lost *completion*: the client has its 201, but the new primary holds the record
  in progress under the old lease, so a duplicate waits, then takes the key over
  when the lease lapses and runs the view again.

Each is timed by when it was committed, before the kill: the loss window. Then the
storm finishes (clients are patient beyond the lease) and the keys run twice are
counted. ``--sync-lag`` adds one run with ``synchronous_mode: true`` behind the same
kind of proxy, for the price of durability: each commit waits for the standby.

Takes about 90 s per run (about 2 min for the synchronous one) on a 2-core machine.
Not part of the test suite; docs/deployment.md quotes its figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg2

from flask_idempotency.fingerprint import key_digest
from tests.failover.failapp import Ledger
from tests.failover.test_patroni_failover import (
    APP,
    DATABASE,
    LEASE,
    RECORDS_TABLE,
    WAIT,
    Killer,
    Storm,
    body_for,
    create_database,
    create_records_table,
    records_not_completed,
)
from tests.support.gunicorn import GunicornServer
from tests.support.lag_proxy import LagProxy
from tests.support.patroni import PatroniCluster, PatroniNode

#: The failover app's one scope as records are named by it: a scope_loader's value is
#: prefixed ``scope:`` (the CLI's ``show --scope`` does the same).
SCOPE = "scope:failover"
#: Seconds after the kill at which the standby's table is read (it replays what it has).
SNAPSHOT_AFTER = 2.0


class LagSampler(threading.Thread):
    """``pg_stat_replication`` on the primary every 0.25 s until the kill: the last sample
    says how far behind the standby was when the primary died."""

    def __init__(self, primary: PatroniNode, killer: Killer) -> None:
        super().__init__(name="lag-sampler", daemon=True)
        self.primary = primary
        self.killer = killer
        self.last: dict[str, float | None] = {}
        self.max_bytes = 0

    def run(self) -> None:
        query = (
            "SELECT EXTRACT(EPOCH FROM write_lag), EXTRACT(EPOCH FROM flush_lag),"
            " EXTRACT(EPOCH FROM replay_lag),"
            " pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn) FROM pg_stat_replication"
        )
        while self.killer.killed_at is None:
            with contextlib.suppress(psycopg2.Error):
                conn = psycopg2.connect(
                    host="127.0.0.1",
                    port=self.primary.pg_port,
                    user="postgres",
                    dbname="postgres",
                    connect_timeout=1,
                )
                try:
                    conn.autocommit = True
                    with conn.cursor() as cursor:
                        cursor.execute(query)
                        row = cursor.fetchone()
                finally:
                    conn.close()
                if row is not None and self.killer.killed_at is None:
                    write, flush, replay, behind = row
                    self.last = {
                        "write": None if write is None else float(write),
                        "flush": None if flush is None else float(flush),
                        "replay": None if replay is None else float(replay),
                        "bytes": None if behind is None else float(behind),
                    }
                    self.max_bytes = max(self.max_bytes, int(behind or 0))
            time.sleep(0.25)


def standby_rows(node: PatroniNode) -> dict[str, str]:
    """key_digest -> state, read on the standby (a hot standby answers reads)."""
    conn = psycopg2.connect(
        host="127.0.0.1", port=node.pg_port, user="postgres", dbname=DATABASE, connect_timeout=5
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute(f"SELECT key_digest, state FROM {RECORDS_TABLE}")
            return {str(digest): str(state) for digest, state in cursor.fetchall()}
    finally:
        conn.close()


def run_once(lag: float, driver: str, *, synchronous: bool = False) -> dict[str, Any]:
    cluster = PatroniCluster(synchronous=synchronous)
    proxies: list[LagProxy] = []
    for node in cluster.nodes if lag > 0 else []:
        proxy = LagProxy("127.0.0.1", node.pg_port, lag=lag).start()
        node.connect_port = proxy.port
        proxies.append(proxy)
    ledger_dir = Path(cluster.directory) / "bench"
    ledger_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(ledger_dir / "ledger.jsonl")
    server: GunicornServer | None = None
    try:
        cluster.start()
        create_database(cluster)
        url = cluster.url(driver, DATABASE)
        env = {
            "DATABASE_URL": url,
            "IDEM_TABLE": RECORDS_TABLE,
            "IDEM_LEASE": str(LEASE),
            "IDEM_WAIT": str(WAIT),
            "LEDGER_PATH": str(ledger.path),
        }
        create_records_table(env)
        server = GunicornServer(APP, env=env, workers=2, threads=8, timeout=120)
        server.start()
        seed = random.SystemRandom().randrange(2**32)
        storm = Storm(server.url, f"async-{seed % 10_000}", seed)

        real_kill = cluster.kill

        def kill_host(node: PatroniNode) -> list[int]:
            for proxy in proxies:  # the host's network dies with it: in-flight WAL is lost
                proxy.cut()
            return real_kill(node)

        cluster.kill = kill_host  # type: ignore[method-assign]
        killer = Killer(cluster, storm, ledger)
        sampler = LagSampler(cluster.leader(), killer)
        snapshot: dict[str, Any] = {}

        def take_snapshot() -> None:
            while killer.killed_at is None and not storm.ended:
                time.sleep(0.01)
            if killer.killed_at is None:
                return
            time.sleep(SNAPSHOT_AFTER)
            standby = next(n for n in cluster.nodes if n is not killer.old)
            snapshot["at"] = time.monotonic()
            snapshot["rows"] = standby_rows(standby)

        snapper = threading.Thread(target=take_snapshot, daemon=True)
        killer.start()
        sampler.start()
        snapper.start()
        storm.run()
        killer.join(timeout=120)
        snapper.join(timeout=30)
        if killer.error is not None:
            raise RuntimeError(f"kill/promotion failed: {killer.error!r}") from killer.error
        events, _ = ledger.read()
        stuck = records_not_completed(url)
        return judge(lag, synchronous, storm, killer, sampler, snapshot, events, stuck)
    finally:
        if server is not None:
            server.stop()
        for proxy in proxies:
            proxy.stop()
        cluster.stop()
        cluster.remove()


def judge(
    lag: float,
    synchronous: bool,
    storm: Storm,
    killer: Killer,
    sampler: LagSampler,
    snapshot: dict[str, Any],
    events: list[dict[str, Any]],
    stuck: list[Any],
) -> dict[str, Any]:
    assert killer.killed_at is not None and killer.promoted_at is not None
    killed_at, promoted_at = killer.killed_at, killer.promoted_at
    rows: dict[str, str] = snapshot.get("rows", {})
    # Writes logged before the new primary took writes were committed on the old one
    # (none was possible in between): the claim's and completion's signals come after
    # their COMMIT. A deferred completion that landed later is the new primary's.
    before = promoted_at - 1.0
    claimed: dict[str, float] = {}
    stored: dict[str, float] = {}
    runs: dict[str, int] = collections.Counter()
    for event in events:
        key = event.get("key") or ""
        if event["event"] == "run-start":
            runs[key] += 1
        if event["t"] >= before:
            continue
        if event["event"] == "claim":
            claimed[key] = event["t"]
        elif event["event"] == "stored":
            stored[key] = event["t"]
    lost_claims = {k: t for k, t in claimed.items() if key_digest(SCOPE, k) not in rows}
    lost_completions = {
        k: t
        for k, t in stored.items()
        if k not in lost_claims and rows.get(key_digest(SCOPE, k)) != "completed"
    }
    lost = {**lost_claims, **lost_completions}
    kept = [t for k, t in [*claimed.items(), *stored.items()] if k not in lost and t < killed_at]
    window = [killed_at - t for t in lost.values()]
    recent = sum(1 for t in [*claimed.values(), *stored.values()] if killed_at - 5.0 < t)
    twice = sorted(k for k, n in runs.items() if n > 1)
    statuses = collections.Counter(a.status for a in storm.answers)
    # What the layer adds to a first execution before the kill: the answer's time less
    # the view's own sleep (the claim's and the completion's commits, among others).
    added = sorted(
        a.t - a.sent - body_for(a.key)["sleep"]
        for a in storm.answers
        if a.status == 201 and not a.replayed and a.t < killed_at
    )
    return {
        "mode": "synchronous" if synchronous else "asynchronous",
        "lag s": lag,
        "standby write lag s": sampler.last.get("write"),
        "standby behind bytes": sampler.last.get("bytes"),
        "commits in last 5 s": recent,
        "claims lost": len(lost_claims),
        "completions lost": len(lost_completions),
        "oldest lost ms": round(1000 * max(window)) if window else None,
        "youngest kept ms": round(1000 * (killed_at - max(kept))) if kept else None,
        "keys run twice": len(twice),
        "first run added p50 ms": round(1000 * added[len(added) // 2]) if added else None,
        "500": statuses[500],
        "stuck": len(stuck),
        "promoted s": round(promoted_at - killed_at, 2),
        "storm s": round(storm.ended - storm.started, 1),
        "snapshot rows": len(rows),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    columns = list(results[0])
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in results:
        cells = []
        for column in columns:
            value = row[column]
            cells.append(
                "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lags", default="0,0.2,1.0", help="seconds, comma-separated")
    parser.add_argument("--sync-lag", type=float, default=None, help="one synchronous run")
    parser.add_argument("--driver", default="psycopg2", choices=["psycopg2", "psycopg"])
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args()
    runs = [(float(lag), False) for lag in args.lags.split(",") if lag.strip()]
    if args.sync_lag is not None:
        runs.append((args.sync_lag, True))
    results = []
    for lag, synchronous in runs:
        started = time.monotonic()
        result = run_once(lag, args.driver, synchronous=synchronous)
        results.append(result)
        print(f"{result}  ({time.monotonic() - started:.0f} s)", flush=True)
    table = markdown(results)
    print(table)
    if args.out:
        command = f"python bench/async_failover.py --lags {args.lags} --driver {args.driver}"
        if args.sync_lag is not None:
            command += f" --sync-lag {args.sync_lag}"
        Path(args.out).write_text(
            f"# Asynchronous replication under a failover\n\n`{command}`"
            f" ({os.uname().nodename}, {time.strftime('%Y-%m-%d')})\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
