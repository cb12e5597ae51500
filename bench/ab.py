"""The working tree's package against a git ref's, in one process, interleaved (issue 21 item 4).

    PYTHONPATH=. .venv/bin/python bench/ab.py [--ref main] [--rounds 6] [--per-round 200]
        [--drivers psycopg2,psycopg] [--paths first-redis,first-pg,replay-redis,replay-pg]

``git archive <ref> flask_idempotency`` is unpacked into a temporary directory as the
package ``flask_idempotency_ref`` (every import inside the package is relative), and
both versions serve the same bench view from apps of their own, on one private
PostgreSQL database and Redis. Every path of both runs sample by sample in shuffled
order (:func:`bench.harness.run_rounds`), so a load spike from the machine's other
tenants lands on both alike; the figure is the median over rounds of the paired
difference of this thread's CPU per request (new − ref).

The app built later gets a few µs of CPU per request less (an A/A run shows it), so
the whole comparison runs twice, once in each build order, and both are printed with
their mean.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flask import Flask, Response, jsonify  # noqa: E402

from bench.harness import (  # noqa: E402
    DEFAULT_DATABASE_URL,
    Path_,
    WsgiCaller,
    counter_keys,
    loadavg,
    private_database,
    private_redis,
    round_medians,
    run_rounds,
)

PAYMENT = {"id": "pay_123", "amount_cents": 1999, "currency": "EUR", "status": "succeeded"}
PATHS = ("first-redis", "first-pg", "replay-redis", "replay-pg")


def ref_package(ref: str, into: Path) -> ModuleType:
    """The package as it is at ``ref``, imported as ``flask_idempotency_ref``."""
    archive = subprocess.run(
        ["git", "archive", ref, "flask_idempotency"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "flask_idempotency").rename(into / "flask_idempotency_ref")
    sys.path.insert(1, str(into))
    return importlib.import_module("flask_idempotency_ref")


def make_app(package: ModuleType, database_url: str, redis_url: str | None, table: str) -> Flask:
    """The bench view, protected by ``package``'s extension."""
    app = Flask(__name__)

    def pay() -> tuple[Response, int]:
        return jsonify(PAYMENT), 201

    app.config.update(
        IDEMPOTENCY_DATABASE_URI=database_url,
        IDEMPOTENCY_TABLE=table,
        IDEMPOTENCY_WAIT=5.0,
        IDEMPOTENCY_CREATE_TABLE=True,
    )
    if redis_url:
        app.config["IDEMPOTENCY_REDIS_URL"] = redis_url
    app.add_url_rule("/pay", "pay", package.idempotent(pay), methods=["POST"])
    package.Idempotency(app)
    return app


def build(
    packages: dict[str, ModuleType],
    db_url: str,
    redis_url: str,
    drivers: list[str],
    wanted: list[str],
) -> list[Path_]:
    """Each wanted path for each driver and version, apps built in ``packages``' order."""
    paths = []
    for driver in drivers:
        url = db_url.replace("postgresql+psycopg2://", f"postgresql+{driver}://")
        for version, package in packages.items():
            for tier in ("redis", "pg"):
                name = f"{driver}_{version}_{tier}_{uuid.uuid4().hex[:6]}"
                app = make_app(package, url, redis_url if tier == "redis" else None, name)
                fixed = f"fixed-{name}"
                WsgiCaller(app, "/pay")(fixed)
                for kind in ("first", "replay"):
                    if f"{kind}-{tier}" not in wanted:
                        continue
                    caller = WsgiCaller(app, "/pay")
                    keys = counter_keys(name) if kind == "first" else (lambda f=fixed: f)
                    paths.append(
                        Path_(
                            f"{driver}:{kind}-{tier}:{version}",
                            "",
                            version,
                            lambda c=caller, k=keys: c(k()),
                            lambda c=caller, r=kind == "replay": _check(c, r),
                        )
                    )
    return paths


def _check(caller: WsgiCaller, replay: bool) -> None:
    assert caller.status.startswith("201"), caller.status
    assert caller.replayed() == replay


def compare(paths: list[Path_]) -> dict[str, tuple[float, float, list[float]]]:
    """Per path: the ref's and the new CPU µs (medians over rounds), and new − ref per round."""
    by = {p.name: p for p in paths}
    out = {}
    for path in paths:
        if not path.name.endswith(":ref"):
            continue
        stem = path.name.removesuffix(":ref")
        ref, new = round_medians(path.cpu), round_medians(by[stem + ":new"].cpu)
        out[stem] = (
            statistics.median(ref),
            statistics.median(new),
            [n - r for r, n in zip(ref, new, strict=True)],
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", default="main")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--drivers", default="psycopg2,psycopg")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    args = parser.parse_args()
    logging.getLogger("flask_idempotency").setLevel(logging.ERROR)  # the default-scope warning
    with tempfile.TemporaryDirectory() as tmp:
        ref = ref_package(args.ref, Path(tmp))
        new = importlib.import_module("flask_idempotency")
        results: list[dict[str, tuple[float, float, list[float]]]] = []
        with private_database(args.database_url) as db_url, private_redis() as redis_url:
            for order in ({"ref": ref, "new": new}, {"new": new, "ref": ref}):
                paths = build(
                    order, db_url, redis_url, args.drivers.split(","), args.paths.split(",")
                )
                print(f"built {' then '.join(order)}; load {loadavg()}", flush=True)
                run_rounds(
                    paths, args.rounds, args.per_round, warmup=50, block_seconds=30.0, what="ab"
                )
                results.append(compare(paths))
    print(
        f"thread CPU µs per request, {args.ref} (ref) vs the working tree (new); load {loadavg()}"
    )
    heads = ("path", "ref", "new", "Δ ref built first", "Δ new built first", "mean Δ")
    print("{:<22} {:>6} {:>6} {:>22} {:>22} {:>7}".format(*heads))
    for stem in results[0]:
        cells, deltas = [], []
        for result in results:
            diffs = result[stem][2]
            deltas.append(statistics.median(diffs))
            cells.append(f"{deltas[-1]:+.0f} ({min(diffs):+.0f}..{max(diffs):+.0f})")
        ref_cpu = statistics.median(result[stem][0] for result in results)
        new_cpu = statistics.median(result[stem][1] for result in results)
        print(
            f"{stem:<22} {ref_cpu:>6.0f} {new_cpu:>6.0f} {cells[0]:>22} {cells[1]:>22}"
            f" {statistics.mean(deltas):>+7.1f}"
        )


if __name__ == "__main__":
    main()
