"""The picture of a ``make bench`` run: per path and per driver, ours against its floor,
against the bare route and against idemkit, and throughput under gunicorn.

    .venv/bin/python bench/chart.py [bench/results/results.json] [--out docs/benchmarks.png]

``bench/run.py`` draws it at the end of each run (``bench/results/benchmarks.png``);
``docs/benchmarks.png`` is the copy the docs show, refreshed by ``--docs``.
Bars are medians over the rounds, whiskers the per-round range: the run's own noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_COPY = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.png"

#: (path key, short label) in the chart's order.
_PATHS = [
    ("replay-redis", "replay\nfrom Redis"),
    ("replay-pg", "replay from\nPostgreSQL"),
    ("first-redis", "first execution\nPG + Redis"),
    ("first-pg", "first execution\nPG only"),
]
_COLOURS = {"psycopg2": "#1f77b4", "psycopg": "#2ca02c", "idemkit": "#d62728", "ik-pg": "#ff9896"}


def _bar(ax: Any, x: float, width: float, ratio: dict[str, float], colour: str, label: str) -> None:
    low, high = ratio["ratio"] - ratio["min"], ratio["max"] - ratio["ratio"]
    ax.bar(x, ratio["ratio"], width, color=colour, label=label, yerr=[[low], [high]], capsize=2)


def draw(results: dict[str, Any], out: Path) -> Path:
    """Write the chart of ``results`` (bench/run.py's results.json) to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inproc = results["in_process"]
    drivers = {(row["key"], row["driver"]): row for row in inproc.get("drivers", [])}
    rows = {row["key"]: row for row in inproc["rows"]}
    throughput = results.get("throughput")
    split = bool(throughput) and throughput.get("ours:new", {}).get("machine_us") is not None
    panels = 2 + bool(throughput) + split
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4), constrained_layout=True)
    width = 0.26
    for ax, measure, title in (
        (axes[0], "to_floor", "in-process, ÷ each path's floor"),
        (axes[1], "to_bare", "in-process, ÷ the bare Flask route"),
    ):
        for i, (key, _) in enumerate(_PATHS):
            seen = i == 0
            for j, driver in enumerate(("psycopg2", "psycopg")):
                row = drivers.get((key, driver))
                if row is not None:
                    name = "ours, psycopg2" if driver == "psycopg2" else "ours, psycopg 3"
                    _bar(ax, i + (j - 1) * width, width, row[measure], _COLOURS[driver],
                         name if seen else "_")  # fmt: skip
            idemkit = rows[key].get("idemkit")
            if idemkit is not None:
                backend = "Redis only" if key.endswith("redis") else "PostgreSQL"
                _bar(ax, i + width, width, idemkit[measure], _COLOURS["idemkit"],
                     "idemkit 1.0.2 (its backend)" if seen else "_")  # fmt: skip
                ax.annotate(backend, (i + width, 0.02), rotation=90, fontsize=6, ha="center",
                            va="bottom", color="white")  # fmt: skip
        if measure == "to_floor":
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.text(len(_PATHS) - 0.5, 1.02, "floor", fontsize=7, ha="right")
        ax.set_xticks(range(len(_PATHS)), [label for _, label in _PATHS], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("ratio (median over rounds; whiskers: range)", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
    if throughput:
        ax = axes[2]
        cells = [
            ("ours", "ours, psycopg2", _COLOURS["psycopg2"]),
            ("ours-psycopg", "ours, psycopg 3", _COLOURS["psycopg"]),
            ("ik-redis", "idemkit, Redis only", _COLOURS["idemkit"]),
            ("ik-pg", "idemkit, PostgreSQL", _COLOURS["ik-pg"]),
        ]
        width = 0.2
        for j, (server, label, colour) in enumerate(cells):
            for i, mode in enumerate(("mix", "new")):
                row = throughput.get(f"{server}:{mode}")
                if row is None:
                    continue
                ratio = {"ratio": row["ratio"], "min": row["ratio_min"], "max": row["ratio_max"]}
                _bar(ax, i + (j - 1.5) * width, width, ratio, colour, label if i == 0 else "_")
        ceiling = throughput.get("ceiling-psycopg2:8")
        if ceiling is not None:
            ax.axhline(ceiling["ratio"], color="grey", linestyle="--", linewidth=0.8)
            note = "ceiling: raw claim + completion pairs, psycopg2, 8 threads"
            ax.text(-0.45, ceiling["ratio"] * 1.01, note, fontsize=7, va="bottom", color="grey")
            ax.set_ylim(0, ceiling["ratio"] * 1.12)
        ax.set_xticks([0, 1], ["90 % replays", "all new keys"], fontsize=8)
        ax.set_title("gunicorn + wrk, req/s ÷ the bare route's", fontsize=10)
        ax.legend(fontsize=7, loc="center right")
    if split:
        _cpu_split(axes[3], throughput)
    meta = results["meta"]
    fig.suptitle(
        f"make bench, {meta['date']}, load {min(meta['loads'])}–{max(meta['loads'])}",
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


#: The parts of a request's machine CPU, stacked bottom to top (bench/paths.py SPLIT).
_PARTS = (
    ("cpu_us", "app's workers", "#4c72b0"),
    ("postgres_us", "PostgreSQL", "#dd8452"),
    ("redis_us", "Redis", "#c44e52"),
    ("wrk_us", "wrk", "#8c8c8c"),
)


def _cpu_split(ax: Any, throughput: dict[str, Any]) -> None:
    """Machine CPU µs per request with all new keys, stacked by process: what sets req/s
    when the servers, the databases and the load generator share 2 cores."""
    cells = [
        ("ours", "ours\npsycopg2"),
        ("ours-psycopg", "ours\npsycopg 3"),
        ("ik-redis", "idemkit\nRedis only"),
        ("ik-pg", "idemkit\nPostgreSQL"),
    ]
    shown = [(server, label) for server, label in cells if f"{server}:new" in throughput]
    for i, (server, _) in enumerate(shown):
        row = throughput[f"{server}:new"]
        bottom = 0.0
        for key, name, colour in _PARTS:
            value = row.get(key) or 0.0
            ax.bar(i, value, 0.6, bottom=bottom, color=colour, label=name if i == 0 else "_")
            bottom += value
        other = max(0.0, row["machine_us"] - bottom)  # the kernel, everything else
        ax.bar(i, other, 0.6, bottom=bottom, color="#e5e5e5", label="rest" if i == 0 else "_")
    ax.set_xticks(range(len(shown)), [label for _, label in shown], fontsize=8)
    ax.set_title("all new keys: machine CPU µs per request", fontsize=10)
    ax.set_ylabel("CPU µs per request (median over rounds)", fontsize=8)
    top = max(throughput[f"{server}:new"]["machine_us"] for server, _ in shown)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS / "results.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "benchmarks.png")
    parser.add_argument("--docs", action="store_true", help="also copy it to docs/benchmarks.png")
    args = parser.parse_args()
    out = draw(json.loads(args.results.read_text()), args.out)
    print(f"chart: wrote {out}")
    if args.docs:
        shutil.copyfile(out, DOCS_COPY)
        print(f"chart: copied to {DOCS_COPY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
