"""Several ``make bench`` runs in one table: each path's ratio to its floor per driver,
throughput against bare and idemkit, and CPU per request, run by run.

    .venv/bin/python bench/summarize.py RUN_DIR [RUN_DIR ...]

Each ``RUN_DIR`` holds one run's ``results.json`` (``make bench BENCH_ARGS="--out DIR"``).
One run on a shared machine says little; the issue asks for five, started at a load
below 1, and this is how they are read side by side (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PATHS = {
    "replay-redis": "replay from Redis (÷ bare + GET)",
    "replay-pg": "replay from PostgreSQL only (÷ bare + PK SELECT)",
    "first-redis": "first execution, PostgreSQL + Redis (÷ bare + claim + completion + SET)",
    "first-pg": "first execution, PostgreSQL only (÷ bare + claim + completion)",
}
DRIVERS = {"psycopg2": "psycopg2", "psycopg": "psycopg 3"}
SERVERS = {"ours": "psycopg2", "ours-psycopg": "psycopg 3"}


def _runs(dirs: list[Path]) -> list[dict[str, Any]]:
    return [json.loads((d / "results.json").read_text()) for d in dirs]


def _join(values: list[str]) -> str:
    return ", ".join(values)


def table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| run (UTC) | load at start | bare route p50 µs | twin ÷ bare |",
        "|---|---:|---:|---:|",
    ]
    for run in runs:
        meta, noise = run["meta"], run["in_process"]["noise"]
        lines.append(
            f"| {meta['date']} | {meta['loads'][0]} | {run['in_process']['bare']['p50_us']:,.0f}"
            f" | {noise['twin_ratio']['ratio']:.2f} ({noise['twin_ratio']['min']:.2f}–"
            f"{noise['twin_ratio']['max']:.2f}) |"
        )
    lines += ["", "| path | driver | ÷ its floor, run by run | ours CPU µs, run by run |"]
    lines.append("|---|---|---|---|")
    for key, label in PATHS.items():
        for driver, name in DRIVERS.items():
            ratios, cpus = [], []
            for run in runs:
                row = next(
                    (
                        r
                        for r in run["in_process"].get("drivers", [])
                        if r["key"] == key and r["driver"] == driver
                    ),
                    None,
                )
                ratios.append("–" if row is None else f"{row['to_floor']['ratio']:.2f}")
                cpus.append("–" if row is None else f"{row['ours']['cpu_us']:,.0f}")
            lines.append(f"| {label} | {name} | {_join(ratios)} | {_join(cpus)} |")
    lines += [
        "",
        "| throughput cell | req/s ÷ bare, run by run | req/s | worker CPU µs / request"
        " | machine CPU µs / request (PostgreSQL part) |",
        "|---|---|---|---|---|",
    ]
    cells = [
        ("ours:mix", "ours psycopg2, 90 % replays"),
        ("ours-psycopg:mix", "ours psycopg 3, 90 % replays"),
        ("ik-redis:mix", "idemkit Redis only, 90 % replays"),
        ("ours:new", "ours psycopg2, all new keys"),
        ("ours-psycopg:new", "ours psycopg 3, all new keys"),
        ("ik-redis:new", "idemkit Redis only, all new keys"),
        ("ik-pg:new", "idemkit PostgreSQL, all new keys"),
    ]
    for cell, label in cells:
        got = [run["throughput"].get(cell) for run in runs if run.get("throughput")]
        if not got or any(g is None for g in got):
            continue
        machine = [
            "–"
            if g.get("machine_us") is None
            else f"{g['machine_us']:,.0f} ({g.get('postgres_us', 0):,.0f})"
            for g in got
        ]
        ratios = _join([f"{g['ratio']:.2f}" for g in got])
        rps = _join([f"{g['rps']:,.0f}" for g in got])
        cpu = _join([f"{g['cpu_us']:,.0f}" for g in got])
        lines.append(f"| {label} | {ratios} | {rps} | {cpu} | {_join(machine)} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    print("\n".join(table(_runs(args.runs))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
