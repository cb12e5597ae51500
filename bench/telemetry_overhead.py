"""What the built-in telemetry costs a request (C57): replay and first execution, on and off.

    .venv/bin/python bench/telemetry_overhead.py [--rounds 5] [--per-round 1500]

In-process, the same harness as ``make bench`` (a WSGI call on a prepared
environ; samples of all paths interleaved and shuffled, so load from the
machine's other tenants lands on every path alike), against the real PostgreSQL
(a private database, dropped at the end) and a private redis-server. Apps, each
the bench app of ``bench/benchapp.py`` with its own table:

- ``off``: no telemetry (the default); ``off-twin``: a second such app, the
  noise between two identical apps;
- ``prometheus``: ``prometheus.instrument`` into a registry of its own;
- ``otel``: OpenTelemetry metrics and spans, on the SDK (a ``MeterProvider`` with an
  in-memory reader, a ``TracerProvider`` with a ``BatchSpanProcessor`` whose
  exporter drops the spans: the export is another thread's work);
- ``both``: Prometheus and OpenTelemetry together.

Paths: a replay from Redis (the cheapest protected request, where the layer's
share is largest) and a first execution on PostgreSQL + Redis. Prints a
Markdown table: median wall time and thread CPU per request, and each app's
extra CPU over ``off`` in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.benchapp import create_app
from bench.harness import (
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


def _otel(app: Any, metrics: bool = True, tracing: bool = True) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from flask_idempotency.telemetry import otel

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(Discard()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    otel.instrument(
        app,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        metrics=metrics,
        tracing=tracing,
    )


def _prometheus(app: Any) -> None:
    from prometheus_client import CollectorRegistry

    from flask_idempotency.telemetry import prometheus

    prometheus.instrument(app, CollectorRegistry())


SETUPS = {
    "off": lambda app: None,
    "off-twin": lambda app: None,
    "prometheus": _prometheus,
    "otel": _otel,
    "both": lambda app: (_prometheus(app), _otel(app)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("IDEMPOTENCY_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL),
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=1500)
    parser.add_argument("--first-per-round", type=int, default=300)
    args = parser.parse_args()
    print(f"load before: {loadavg()}", flush=True)
    with private_database(args.database_url) as db_url, private_redis() as redis_url:
        replays: list[Path_] = []
        firsts: list[Path_] = []
        for name, setup in SETUPS.items():
            app = create_app(
                "ours",
                database_url=db_url,
                redis_url=redis_url,
                table=f"tel_{name}".replace("-", "_"),
            )
            setup(app)
            caller = WsgiCaller(app, "/pay")
            key = f"replay-{name}-{uuid.uuid4().hex[:8]}"
            caller(key)
            assert caller.status.startswith("201") and not caller.replayed(), caller.status
            replays.append(_path(f"replay:{name}", WsgiCaller(app, "/pay"), lambda k=key: k, True))
            firsts.append(
                _path(f"first:{name}", WsgiCaller(app, "/pay"), counter_keys(name), False)
            )
        run_rounds(
            replays, args.rounds, args.per_round, warmup=200, block_seconds=3.0, what="replay"
        )
        run_rounds(
            firsts,
            args.rounds,
            args.first_per_round,
            warmup=50,
            block_seconds=3.0,
            what="first execution",
        )
    print(f"load after: {loadavg()}\n")
    print(
        report(replays, "replay from Redis") + "\n" + report(firsts, "first execution, PG + Redis")
    )
    return 0


def _path(name: str, caller: WsgiCaller, keys: Any, replay: bool) -> Path_:
    def run() -> None:
        caller(keys())

    def check() -> None:
        assert caller.status.startswith("201"), f"{name}: {caller.status}"
        assert caller.replayed() == replay, f"{name}: replayed={caller.replayed()}"

    return Path_(name, name, "ours", run, check)


def report(paths: list[Path_], what: str) -> str:
    base = paths[0]
    base_cpu = round_medians(base.cpu)
    lines = [
        f"### {what}",
        "",
        "| telemetry | wall p50 (µs) | thread CPU p50 (µs)"
        " | CPU over `off` (µs, median of rounds; range) |",
        "|---|---:|---:|---:|",
    ]
    for path in paths:
        cpu = round_medians(path.cpu)
        extra = [c - b for c, b in zip(cpu, base_cpu, strict=True)]
        lines.append(
            f"| {path.name.split(':', 1)[1]} | {statistics.median(round_medians(path.wall)):.0f}"
            f" | {statistics.median(cpu):.1f}"
            f" | {statistics.median(extra):+.1f} ({min(extra):+.1f} .. {max(extra):+.1f}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
