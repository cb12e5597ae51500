"""What each step of a replay from Redis costs with caches cooled, as ``make bench`` runs it.

    .venv/bin/python bench/cold_steps.py [--turns 3000]

``make bench`` takes each sample of a different path in turn, so every request starts
with CPU caches the other paths have cooled, and a step costs more there than in a loop
that repeats it. This measures the steps that way: the replay from Redis of the bench
app, and the same replay with one step switched off (answered by its value from an
earlier call), all interleaved in a shuffled order with the bare route and bare + GET,
``--turns`` samples each. A step's cold cost is the replay's median less the median of
the replay without it (a negative figure: the step costs less than what stands in for
it). Only the replay's own steps are switched; the answer is the same either way.
Issue 36: what is left above bare + GET, and where.

Fewer paths run between two samples here than in ``make bench`` (about twenty there,
PostgreSQL paths and idemkit's included), so caches are less cold and the replay's ratio
to bare + GET is lower than ``make bench`` reports: read the steps' figures as lower
bounds, each to about ±2 µs (two runs of 3,000 agreed to that).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
from flask import Response

import flask_idempotency.completion.inherit as inherit
import flask_idempotency.lifecycle as lifecycle
from bench.benchapp import create_app
from bench.cpu_per_request import DATABASE_URL, REDIS_URL, _caller
from flask_idempotency.cache.codec import ValueMac

TABLE = "idempotency_cold_steps"
#: The steps that can be switched off, and what each stands for.
STEPS = {
    "fingerprint": "the request's fingerprint: body read, canonical JSON, SHA-256 (C6)",
    "key_digest": "the record's name: SHA-256 of scope and key",
    "scope": "the default scope",
    "parse_key": "the Idempotency-Key header's parse",
    "spool_check": "the check for settlements an ended process handed on (C59)",
    "mac": "the cached value's MAC (C60)",
    "decode": "the cached value's decoding, MAC included",
    "redis": "the cache read: GET round trip and decoding",
    "build": "the replayed response (against a plain Response(b'{}'))",
}


class Switches:
    """Wraps each step so that it answers its remembered value while switched off."""

    def __init__(self) -> None:
        self.off: str | None = None
        self.values: dict[str, Any] = {}

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.off == name:
                return self.values[name]
            value = real(*args, **kwargs)
            self.values[name] = value
            return value

        return step


def build(database_url: str, redis_url: str) -> dict[str, Callable[[], None]]:
    """The paths: bare, bare + GET, the replay, and the replay without each step."""
    plain = create_app("plain")
    ours = create_app("ours", database_url=database_url, redis_url=redis_url, table=TABLE)
    bare = _caller(plain, "/bare", lambda: None)
    key = f"cold-{uuid.uuid4().hex}"
    replay = _caller(ours, "/pay", lambda: key)
    client = redis.Redis.from_url(redis_url)
    client.set("cold-steps:floor", b"x" * 300)
    state = ours.extensions["idempotency"]
    cache = state.cache
    switches = Switches()
    for owner, attribute, step in (
        (lifecycle, "request_fingerprint", "fingerprint"),
        (lifecycle, "key_digest", "key_digest"),
        (lifecycle, "parse_key", "parse_key"),
        (state, "scope_for_request", "scope"),
        (inherit, "pick_up", "spool_check"),
        (ValueMac, "tag", "mac"),
        (cache, "_decode", "decode"),
        (cache, "get", "redis"),
    ):
        setattr(owner, attribute, switches.wrap(step, getattr(owner, attribute)))
    real_replay = lifecycle.__dict__["replay"]

    def replay_or_plain(completed: Any, settings: Any) -> Any:
        if switches.off == "build":
            return Response(b"{}", 201)
        return real_replay(completed, settings)

    lifecycle.__dict__["replay"] = replay_or_plain
    replay()
    replay()  # from Redis now, every step's value remembered

    def without(step: str | None) -> Callable[[], None]:
        def run() -> None:
            switches.off = step
            try:
                replay()
            finally:
                switches.off = None

        return run

    def floor() -> None:
        bare()
        client.get("cold-steps:floor")

    paths = {"bare": bare, "bare + GET": floor, "replay": without(None)}
    paths.update({f"without {step}": without(step) for step in STEPS})
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3000)
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument("--redis-url", default=REDIS_URL)
    args = parser.parse_args()
    paths = build(args.database_url, args.redis_url)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for _ in range(args.turns):
        random.shuffle(order)
        for name in order:
            started = time.perf_counter_ns()
            paths[name]()
            samples[name].append((time.perf_counter_ns() - started) / 1000)
    median = {name: statistics.median(values) for name, values in samples.items()}
    print(f"{args.turns} interleaved samples per path; wall µs, median")
    for name in ("bare", "bare + GET", "replay"):
        print(f"  {name:12s} {median[name]:8.1f}")
    print(f"  replay ÷ (bare + GET) {median['replay'] / median['bare + GET']:.3f}")
    print("| step | cold µs |\n|---|---:|")
    for step, what in STEPS.items():
        print(f"| {what} | {median['replay'] - median[f'without {step}']:.1f} |")
    import sqlalchemy as sa

    with sa.create_engine(args.database_url).begin() as connection:
        connection.execute(sa.text(f"DROP TABLE IF EXISTS {TABLE}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
