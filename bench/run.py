"""``make bench``: every path of Flask-Idempotency against its floor, with idemkit alongside.

    .venv/bin/python bench/run.py [--rounds 7] [--per-round 300] [--inprocess-only] [--quick]

One run, real PostgreSQL (a private database, dropped at the end) and a private
redis-server, on a machine other work shares. So every figure is a ratio to a
path measured in the same rounds, the paths are interleaved (each round runs
every path once, shuffled), and the run reports its own noise: the bare route is
measured twice per round, and the two must agree. Sections:

1. in-process latency (WSGI calls) per path: floor, ours, idemkit 1.0.2; our PostgreSQL
   paths once more with psycopg 3 against a psycopg 3 floor;
2. the same over HTTP to gunicorn, one client;
3. throughput under gunicorn with wrk: 90 % replays, all new keys, with psycopg2 and
   psycopg 3, beside the ceiling the durable commits set (raw claim + completion pairs);
4. wake-up latency of parked duplicates.

Writes ``bench/results/RESULTS.md``, ``results.json`` and the chart ``benchmarks.png``
(``bench/chart.py --docs`` copies it to ``docs/benchmarks.png``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import chart, report
from bench import paths as bench_paths
from bench.harness import (
    DEFAULT_DATABASE_URL,
    loadavg,
    private_database,
    private_redis,
    run_rounds,
    versions,
)

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("IDEMPOTENCY_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL),
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--http-per-round", type=int, default=50)
    parser.add_argument("--wake-trials", type=int, default=20)
    parser.add_argument("--wrk-rounds", type=int, default=5)
    parser.add_argument("--wrk-seconds", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--inprocess-only",
        action="store_true",
        help="skip the gunicorn parts (quick before/after checks)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.per_round, args.http_per_round = 2, 40, 10
        args.wake_trials, args.wrk_rounds, args.wrk_seconds = 2, 1, 1.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still runs the cleanups

    started = time.monotonic()
    meta: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "rounds": args.rounds,
        "per_round": args.per_round,
        "http_per_round": args.http_per_round,
        "workers": args.workers,
        "threads": args.threads,
        "wake_trials": args.wake_trials,
        "wrk_rounds": args.wrk_rounds,
        "wrk_seconds": args.wrk_seconds,
        "wrk_connections": 12,
        "replay_keys": 200,
        "new_share": 0.1,
    }
    loads = [loadavg().split()[0]]
    args.out.mkdir(parents=True, exist_ok=True)
    http = wake = throughput = None
    with private_database(args.database_url) as db_url, private_redis() as redis_url:
        meta["versions"] = versions(db_url, redis_url)
        print(f"bench: {meta['versions']['cpu']}, load {loadavg()}", flush=True)
        print("1/4 in-process latency", flush=True)
        built = bench_paths.build_inprocess(db_url, redis_url)
        try:
            loads += run_rounds(
                built.paths,
                args.rounds,
                args.per_round,
                warmup=30,
                block_seconds=20.0,
                what="in-process",
            )
            inproc = report.analyse(built.paths)
            if not args.inprocess_only:
                servers = bench_paths.start_servers(db_url, redis_url, args.workers, args.threads)
                try:
                    print("2/4 HTTP latency", flush=True)
                    http_paths, clients = bench_paths.build_http(servers, built.floor)
                    loads += run_rounds(
                        http_paths,
                        args.rounds,
                        args.http_per_round,
                        warmup=10,
                        block_seconds=10.0,
                        what="HTTP",
                    )
                    for client in clients:
                        client.close()
                    http = report.analyse(http_paths)
                    if shutil.which("wrk"):
                        print("3/4 throughput (wrk)", flush=True)
                        throughput = bench_paths.run_throughput(
                            servers,
                            db_url,
                            args.wrk_rounds,
                            args.wrk_seconds,
                            meta["wrk_connections"],
                            meta["replay_keys"],
                            meta["new_share"],
                        )
                    else:
                        print("3/4 skipped: wrk is not installed (apt-get install -y wrk)")
                    print("4/4 wake-ups", flush=True)
                    wake = bench_paths.run_wake(servers, args.wake_trials, 5)
                finally:
                    bench_paths.stop_servers(servers)
        finally:
            for cleanup in built.cleanup:
                cleanup()
    meta["loads"] = loads
    meta["load_after"] = loadavg()
    meta["seconds"] = time.monotonic() - started
    markdown = report.write(args.out / "RESULTS.md", meta, inproc, http, wake, throughput)
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "in_process": inproc,
                "http": http,
                "throughput": throughput,
                "wake": wake,
            },
            indent=1,
        )
    )
    print(markdown)
    try:
        results = json.loads((args.out / "results.json").read_text())
        print(f"bench: drew {chart.draw(results, args.out / 'benchmarks.png')}")
    except ImportError as exc:  # matplotlib is in the bench extra
        print(f"bench: no chart ({exc}): pip install -e '.[bench]'")
    print(f"bench: wrote {args.out / 'RESULTS.md'} and results.json in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
