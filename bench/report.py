# ruff: noqa: E501 - Markdown prose and table rows read better unbroken
"""Turning measured paths into RESULTS.md and results.json: per path floor, ours, idemkit."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.harness import Path_, ratio_to, summary
from bench.paths import DRIVER_PATHS, DRIVERS, IDEMKIT_FOR, PATHS

#: Goals of issue 11, as ratios to each path's floor (the unprotected route: to bare).
GOALS = {"unprotected": 1.03, "replay-redis": 1.1, "replay-pg": 1.15, "first-redis": 1.2}
#: Goals of issue 21, on each driver, as ratios to that driver's floor.
DRIVER_GOALS = {"replay-redis": 1.1, "first-redis": 1.1, "replay-pg": 1.0}
DRIVER_NAMES = {"psycopg2": "psycopg2", "psycopg": "psycopg 3"}


def path_names(key: str, driver: str) -> tuple[str, str]:
    """The names of (ours, its floor) for ``key`` on ``driver`` (see bench.paths)."""
    at = "" if driver == "psycopg2" else f"@{driver}"
    return f"ours{at}:{key}", f"floor{at}:{key}"


def analyse_drivers(by: dict[str, Path_]) -> list[dict[str, Any]]:
    """Per path and driver: ours against that driver's floor and the bare route."""
    rows = []
    for key in DRIVER_PATHS:
        for driver in DRIVERS:
            ours, floor = path_names(key, driver)
            if ours not in by or floor not in by:
                continue
            rows.append(
                {
                    "key": key,
                    "driver": driver,
                    "ours": summary(by[ours]),
                    "floor": summary(by[floor]),
                    "to_floor": ratio_to(by[ours], by[floor]),
                    "to_bare": ratio_to(by[ours], by["bare"]),
                    "floor_to_psycopg2_floor": ratio_to(
                        by[floor], by[path_names(key, "psycopg2")[1]]
                    ),
                }
            )
    return rows


def analyse(paths: list[Path_]) -> dict[str, Any]:
    """Per path: floor, ours and idemkit, each with p50/p99 and ratios to bare and floor."""
    by = {p.name: p for p in paths}
    bare = by["bare"]
    twin = ratio_to(by["bare-twin"], bare)
    rows = []
    for key, label, floor_label in PATHS:
        floor = bare if key == "unprotected" else by[f"floor:{key}"]
        row: dict[str, Any] = {
            "key": key,
            "label": label,
            "floor_label": floor_label,
            "floor": summary(floor),
            "floor_to_bare": ratio_to(floor, bare),
        }
        for side, name in (("ours", f"ours:{key}"), ("idemkit", f"{IDEMKIT_FOR[key]}:{key}")):
            if name in by:
                row[side] = {
                    **summary(by[name]),
                    "to_bare": ratio_to(by[name], bare),
                    "to_floor": ratio_to(by[name], floor),
                }
        rows.append(row)
    bare_summary = summary(bare)
    other = ratio_to(by["bare-other"], bare) if "bare-other" in by else None
    return {
        "bare": bare_summary,
        "noise": {
            "twin_ratio": twin,
            "other_app_ratio": other,
            "twin_deviation_pct": 100 * max(abs(twin["min"] - 1), abs(twin["max"] - 1)),
            "bare_round_p50_us": bare_summary["round_p50_us"],
            "bare_spread_pct": bare_summary["spread_pct"],
        },
        "rows": rows,
        "drivers": analyse_drivers(by),
    }


def _split(value: float | None) -> str:
    """A CPU µs figure of the machine split; ``n/a`` where it was not read (older results,
    or PostgreSQL for the ceiling, whose backends end before the reading)."""
    return "n/a" if value is None or value != value else _us(value)


def _us(value: float) -> str:
    return f"{value:,.0f}"


def _ratio(r: dict[str, float]) -> str:
    return f"{r['ratio']:.2f}× ({r['min']:.2f}–{r['max']:.2f})"


def latency_table(result: dict[str, Any], cpu: bool) -> list[str]:
    head = (
        "| path | floor | floor p50 / p99 µs | ours p50 / p99 µs | ours ÷ bare | **ours ÷ floor** |"
    )
    rule = "|---|---|---:|---:|---:|---:|"
    if cpu:
        head += " ours CPU µs |"
        rule += "---:|"
    head += " idemkit 1.0.2 p50 / p99 µs | idemkit ÷ bare | idemkit ÷ floor | goal |"
    rule += "---:|---:|---:|---|"
    lines = [head, rule]
    for row in result["rows"]:
        f, o, k = row["floor"], row.get("ours"), row.get("idemkit")
        goal = GOALS.get(row["key"])
        cells = [row["label"], row["floor_label"], f"{_us(f['p50_us'])} / {_us(f['p99_us'])}"]
        if o:
            cells += [
                f"{_us(o['p50_us'])} / {_us(o['p99_us'])}",
                _ratio(o["to_bare"]),
                f"**{_ratio(o['to_floor'])}**",
            ]
            if cpu:
                cells.append(_us(o["cpu_us"]))
        if k:
            backend = "Redis" if IDEMKIT_FOR[row["key"]] == "ik-redis" else "PostgreSQL"
            cells += [
                f"{_us(k['p50_us'])} / {_us(k['p99_us'])} ({backend})",
                _ratio(k["to_bare"]),
                _ratio(k["to_floor"]),
            ]
        cells.append(
            "" if goal is None or not o else f"≤ {goal}×: {verdict(o['to_floor']['ratio'] <= goal)}"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def drivers_table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| path | driver | floor p50 / p99 µs | ours p50 / p99 µs | ours CPU µs | ours ÷ bare | **ours ÷ floor** | floor ÷ psycopg2's floor | goal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result.get("drivers", []):
        f, o = row["floor"], row["ours"]
        label = next(lbl for k, lbl, _ in PATHS if k == row["key"])
        goal = DRIVER_GOALS.get(row["key"])
        lines.append(
            f"| {label} | {DRIVER_NAMES[row['driver']]} | {_us(f['p50_us'])} / {_us(f['p99_us'])} |"
            f" {_us(o['p50_us'])} / {_us(o['p99_us'])} | {_us(o['cpu_us'])} | {_ratio(row['to_bare'])} |"
            f" **{_ratio(row['to_floor'])}** | {_ratio(row['floor_to_psycopg2_floor'])} |"
            + ("" if goal is None else f" ≤ {goal}×: {verdict(row['to_floor']['ratio'] <= goal)}")
            + " |"
        )
    return lines


def driver_goal_lines(inproc: dict[str, Any], throughput: dict[str, Any] | None) -> list[str]:
    lines = []
    for key, goal in DRIVER_GOALS.items():
        label = next(lbl for k, lbl, _ in PATHS if k == key)
        parts = [
            f"{DRIVER_NAMES[row['driver']]} {row['to_floor']['ratio']:.2f}×"
            f" ({verdict(row['to_floor']['ratio'] <= goal)})"
            for row in inproc.get("drivers", [])
            if row["key"] == key
        ]
        lines.append(f"- {label} ≤ {goal}× its driver's floor: " + "; ".join(parts) + ".")
    if throughput and "ik-redis:new" in throughput:
        ik = throughput["ik-redis:new"]
        for server, driver in (("ours", "psycopg2"), ("ours-psycopg", "psycopg")):
            if f"{server}:new" not in throughput:
                continue
            ours = throughput[f"{server}:new"]
            lines.append(
                f"- All new keys, {DRIVER_NAMES[driver]}, at least idemkit's Redis-only backend:"
                f" {ours['ratio']:.2f}× bare ({ours['rps']:,.0f} req/s) vs {ik['ratio']:.2f}×"
                f" ({ik['rps']:,.0f} req/s): {verdict(ours['ratio'] >= ik['ratio'])}."
                + _cpu_split_note(ours, ik)
            )
        ceilings = [
            f"{cell.split(':')[1]} threads {DRIVER_NAMES[cell.split(':')[0].removeprefix('ceiling-')]}"
            f" {row['rps']:,.0f} pairs/s ({row['ratio']:.2f}× bare's req/s)"
            for cell, row in throughput.items()
            if cell.startswith("ceiling-")
        ]
        if ceilings:
            lines.append(
                "- The ceiling the durable commits set (raw claim + completion pairs, autocommit,"
                " synchronous commit): " + "; ".join(ceilings) + "."
            )
    return lines


def _cpu_split_note(ours: dict[str, Any], ik: dict[str, Any]) -> str:
    """Where the machine's CPU per request went, ours against idemkit's, when it was read."""
    if ours.get("machine_us") is None or ik.get("machine_us") is None:
        return ""
    return (
        f" Machine CPU per request {_us(ours['machine_us'])} µs (workers {_us(ours['cpu_us'])},"
        f" PostgreSQL {_us(ours['postgres_us'])}, Redis {_us(ours['redis_us'])}) vs"
        f" {_us(ik['machine_us'])} µs (workers {_us(ik['cpu_us'])}, Redis {_us(ik['redis_us'])})."
    )


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def noise_line(result: dict[str, Any], what: str) -> str:
    n = result["noise"]
    p50s = n["bare_round_p50_us"]
    return (
        f"**Noise ({what}):** the bare route measured twice per round (bare and its twin, same app, same"
        f" harness) gave a twin ÷ bare ratio of {_ratio(n['twin_ratio'])} across rounds, i.e. up to"
        f" ±{n['twin_deviation_pct']:.0f}% between two identical paths; the bare p50 ranged"
        f" {min(p50s):,.0f}–{max(p50s):,.0f} µs over the rounds (spread {n['bare_spread_pct']:.0f}% of its median)."
        + (
            f" The same bare route of a second, identical app without idempotency ran at"
            f" {_ratio(n['other_app_ratio'])} of the first: what two apps of one process differ by"
            " when nothing else differs (the unprotected route is one app against another)."
            if n.get("other_app_ratio")
            else ""
        )
        + " A ratio that moves by less than this is not a measured change."
    )


def goal_lines(
    inproc: dict[str, Any], http: dict[str, Any] | None, throughput: dict[str, Any] | None
) -> list[str]:
    lines = []
    for key, goal in GOALS.items():
        label = next(lbl for k, lbl, _ in PATHS if k == key)
        base = "bare" if key == "unprotected" else "its floor"
        parts = []
        for what, result in (("in-process", inproc), ("HTTP", http)):
            if result is None:
                continue
            row = next(r for r in result["rows"] if r["key"] == key)
            r = row["ours"]["to_floor"]["ratio"]
            parts.append(f"{what} {r:.2f}× ({verdict(r <= goal)})")
        lines.append(f"- {label} ≤ {goal}× {base}: " + "; ".join(parts) + ".")
    if throughput:
        for mode, name in (("mix", "90 % replays"), ("new", "all new keys")):
            ours, ik = throughput[f"ours:{mode}"], throughput[f"ik-redis:{mode}"]
            lines.append(
                f"- Throughput, {name}, at least idemkit's Redis-only backend: ours"
                f" {ours['rps']:,.0f} req/s ({ours['ratio']:.2f}× bare) vs idemkit {ik['rps']:,.0f} req/s"
                f" ({ik['ratio']:.2f}× bare): {verdict(ours['ratio'] >= ik['ratio'])}."
            )
        unprotected = throughput["ours:bare"]
        lines.append(
            f"- Unprotected route under gunicorn: {unprotected['ratio']:.2f}× the plain app's"
            f" req/s ({unprotected['ratio_min']:.2f}–{unprotected['ratio_max']:.2f})."
        )
    return lines


def write(
    out: Path,
    meta: dict[str, Any],
    inproc: dict[str, Any],
    http: dict[str, Any] | None,
    wake: dict[str, Any] | None,
    throughput: dict[str, Any] | None,
) -> str:
    v = meta["versions"]
    loads = meta["loads"]
    lines = [
        "# Flask-Idempotency benchmarks",
        "",
        f"Run {meta['date']} by `make bench` (`bench/run.py`), {meta['seconds']:.0f} s in all.",
        "",
        (
            f"**Machine:** {v['cpu']}, {v['cores']} cores, Linux {v['kernel']}; Python {v['python']},"
            f" PostgreSQL {v['postgresql']} (synchronous_commit={v['synchronous_commit']}), Redis {v['redis']};"
            f" Flask {v['flask']}, SQLAlchemy {v['sqlalchemy']}, psycopg2 {v['psycopg2']}, redis-py {v['redis-py']},"
            f" gunicorn {v['gunicorn']}, idemkit {v['idemkit']}."
        ),
        (
            f"**Load:** 1-minute load average {loads[0]} at the start, {min(loads)}–{max(loads)} during the run,"
            f" {meta['load_after']} at the end, on {v['cores']} cores"
            + (
                " with nothing else running at the start (the bench's own servers, databases and wrk"
                " load it as it goes)."
                if float(loads[0]) < 1
                else " shared with whatever else ran at the time (the start was not quiet)."
            )
            + " Every figure below is a ratio to a path measured in the same rounds, interleaved,"
            " so that the machine's state weighs on both sides alike."
        ),
        "",
        noise_line(inproc, "in-process"),
    ]
    if http:
        lines += ["", noise_line(http, "HTTP")]
    lines += [
        "",
        "**Floor:** the bare route of an app without idempotency, followed in the same sample by the raw"
        " redis-py/psycopg2 round trips the path cannot avoid (autocommit, synchronous commit): replay"
        " from Redis = one GET; replay from PostgreSQL = one primary-key SELECT; first execution = claim"
        " INSERT … ON CONFLICT DO NOTHING RETURNING + fenced completion UPDATE … RETURNING (+ SET and"
        " PUBLISH pipelined in one round trip with Redis). Ratios are the median over rounds of"
        " (path p50 ÷ floor p50 in the same round), with their range over the rounds in brackets.",
        "",
        "## Goals (issue 11)",
        "",
        *goal_lines(inproc, http, throughput),
        "",
        "## Goals per driver (issue 21)",
        "",
        *driver_goal_lines(inproc, throughput),
        "",
        "## 1. In-process latency (a prepared WSGI environ handed to the app)",
        "",
        f"{meta['rounds']} rounds × {meta['per_round']} turns; each turn runs every path once in a freshly shuffled order, so paths are interleaved sample by sample."
        " p50 = median of per-round medians; p99 over all samples. CPU = this thread's CPU time per request"
        " (median of per-round medians): less sensitive to the load than wall time, and what a change"
        " of ours was judged by.",
        "",
        *latency_table(inproc, cpu=True),
        "",
        "### Per PostgreSQL driver (issue 21, C51)",
        "",
        "The same paths once more on apps whose URL names psycopg 3 (`postgresql+psycopg://`, what"
        " SQLAlchemy 2.1 picks for a plain `postgresql://`), each against a floor whose round trips"
        " psycopg 3 makes (autocommit, its defaults), in the same rounds as everything above.",
        "",
        *drivers_table(inproc),
        "",
    ]
    lines += ["## 2. Latency over HTTP, one client (gunicorn)", ""]
    if http is None:
        lines.append("Not run (`--inprocess-only`).")
    else:
        lines += [
            f"Sequential requests, one keep-alive connection per path, {meta['rounds']} interleaved rounds ×"
            f" {meta['http_per_round']} requests; gunicorn gthread, {meta['workers']} workers × {meta['threads']}"
            " threads per server (plain app, ours with Redis, ours PostgreSQL-only, idemkit Redis, idemkit"
            " PostgreSQL). The floor's round trips are made by the client process after the bare request.",
            "",
            *latency_table(http, cpu=False),
        ]
    lines += ["", "## 3. Throughput under gunicorn (wrk on loopback)", ""]
    if throughput is None:
        lines.append("Not run (`--inprocess-only`, or `wrk` missing: `apt-get install -y wrk`).")
    else:
        lines += [
            f"wrk -t2 -c{meta['wrk_connections']}, {meta['wrk_seconds']:g} s per cell, {meta['wrk_rounds']}"
            f" interleaved rounds. Replay-heavy mix: 90 % replays of {meta['replay_keys']} stored keys, 10 % new"
            " keys. wrk shares the 2 cores with the servers. Ratio = req/s ÷ the plain app's bare route req/s"
            " in the same round.",
            "",
            "CPU µs per request (medians over rounds): the app's gunicorn workers; PostgreSQL's"
            " processes; the bench's redis-server; wrk; and the whole machine (everything busy,"
            " kernel included), which is what sets req/s when all of them share 2 cores.",
            "",
            "| server | load | req/s (median) | ratio to bare | range | worker CPU µs / request | PostgreSQL CPU | Redis CPU | wrk CPU | machine CPU | p50 ms | p99 ms | non-2xx | socket errors |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        names = {
            "plain": "plain Flask app",
            "ours": "Flask-Idempotency, PostgreSQL (psycopg2) + Redis",
            "ours-psycopg": "Flask-Idempotency, PostgreSQL (psycopg 3) + Redis",
            "ik-redis": "idemkit 1.0.2, Redis only",
            "ceiling-psycopg2": "ceiling: raw claim + completion pairs, psycopg2",
            "ceiling-psycopg": "ceiling: raw claim + completion pairs, psycopg 3",
            "ik-pg": "idemkit 1.0.2, PostgreSQL",
        }
        loads_ = {"bare": "bare route, no key", "mix": "90 % replays", "new": "all new keys"}
        loads_ |= {"8": "8 threads (pairs/s)", "32": "32 threads (pairs/s)"}
        for cell, row in throughput.items():
            server, mode = cell.split(":")
            lines.append(
                f"| {names[server]} | {loads_[mode]} | {row['rps']:,.0f} | {row['ratio']:.2f}× |"
                f" {row['ratio_min']:.2f}–{row['ratio_max']:.2f} | {'n/a' if row.get('cpu_us') is None else _us(row['cpu_us'])} |"
                f" {' | '.join(_split(row.get(f'{part}_us')) for part in ('postgres', 'redis', 'wrk', 'machine'))} |"
                f" {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |"
                f" {row['non2xx']} | {row['errors']} |"
            )
    lines += ["", "## 4. Wake-up of parked duplicates (gunicorn)", ""]
    if not wake:
        lines.append("Not run.")
    else:
        lines += [
            f"{meta['wake_trials']} trials: an original that sleeps 300 ms, 5 duplicates 100 ms later on fresh"
            " connections; figure = time from the original's response to a duplicate's, at the client,"
            " for duplicates answered by another worker than the original.",
            "",
            "| server | duplicates | replayed | cross-worker | p50 ms | p99 ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for key, row in wake.items():
            p50 = "n/a" if row["p50_ms"] is None else f"{row['p50_ms']:.1f}"
            p99 = "n/a" if row["p99_ms"] is None else f"{row['p99_ms']:.1f}"
            lines.append(
                f"| {key} | {row['duplicates']} | {row['replayed']} | {row['cross_worker']} | {p50} | {p99} |"
            )
    lines += [
        "",
        "## Notes",
        "",
        "- idemkit runs as its WSGI middleware around the same Flask app; its Redis backend keeps no"
        " durable record, its PostgreSQL backend has no cache tier. Its unprotected route still passes"
        " through its middleware.",
        "- Per-step profiles of our paths: [profile.md](profile.md).",
        f"- Median load over the run: {statistics.median(float(x) for x in loads):.2f}.",
        "",
    ]
    markdown = "\n".join(lines)
    out.write_text(markdown)
    return markdown
