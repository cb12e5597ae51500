"""Built-in telemetry (issue 23 item 8; CONTRACT C57).

Every decision is counted and timed in a real ``prometheus_client`` registry
(scraped as Prometheus would, through its text format) and through an
OpenTelemetry meter, and each protected request gets a span, read back from
the SDK's in-memory exporter. Labels and attributes name the endpoint and the
outcome, never the key, the scope or the body; nothing runs on a request to an
unmarked view; it is off unless asked for.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from typing import Any

import pytest
from flask import Flask, jsonify, request

from flask_idempotency import Idempotency, idempotent, release_claim
from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest

prometheus_client = pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from flask_idempotency.telemetry import otel, prometheus  # noqa: E402

from .conftest import REDIS_URL, service_missing  # noqa: E402
from .support.gunicorn import free_port  # noqa: E402

RAW_KEY = "RAW-telemetry-key-never-a-label"
SECRET_BODY = "secret-telemetry-body"
SCOPE = "tenant-never-a-label"

pytestmark = pytest.mark.timeout(120)


class Gates:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.leave = threading.Event()


def build(make_app: Any, config: dict[str, Any] | None = None) -> tuple[Flask, Any, Gates]:
    app, idempotency = make_app({"IDEMPOTENCY_WAIT": 0, **(config or {})})
    gates = Gates()

    @idempotency.scope_loader
    def scope() -> str:
        return SCOPE

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(receipt=SECRET_BODY), 201

    @app.post("/slow")
    @idempotent
    def slow() -> Any:
        if request.headers.get("X-Hold"):
            gates.entered.set()
            gates.leave.wait(30)
        time.sleep(0.05)
        return jsonify(receipt=SECRET_BODY), 201

    @app.post("/parked")
    @idempotent(wait=5)
    def parked() -> Any:
        if request.headers.get("X-Hold"):
            gates.entered.set()
            gates.leave.wait(30)
        return jsonify(receipt=SECRET_BODY), 201

    @app.post("/validate")
    @idempotent
    def validate() -> Any:
        release_claim()
        return jsonify(error="bad"), 400

    @app.post("/plain")
    def plain() -> Any:
        return jsonify(ok=True), 201

    return app, idempotency, gates


def hold(app: Flask, gates: Gates, path: str, key: str) -> tuple[threading.Thread, list[Any]]:
    gates.entered.clear()
    gates.leave.clear()
    answers: list[Any] = []

    def original() -> None:
        answers.append(
            app.test_client().post(
                path, json={"n": 1}, headers={"Idempotency-Key": key, "X-Hold": "1"}
            )
        )

    thread = threading.Thread(target=original)
    thread.start()
    assert gates.entered.wait(30)
    return thread, answers


def drive(app: Flask, gates: Gates) -> float:
    """executed, stored, replayed, 422, 409, parked then woken, released; the replay's
    wall time in seconds (its decision's time cannot exceed it)."""
    client = app.test_client()
    key = {"Idempotency-Key": RAW_KEY}
    assert client.post("/pay", json={"n": 1}, headers=key).status_code == 201
    started = time.perf_counter()
    assert client.post("/pay", json={"n": 1}, headers=key).headers["Idempotent-Replayed"]
    replay_wall = time.perf_counter() - started
    assert client.post("/pay", json={"n": 2}, headers=key).status_code == 422

    thread, answers = hold(app, gates, "/slow", RAW_KEY + "-slow")
    busy = client.post("/slow", json={"n": 1}, headers={"Idempotency-Key": RAW_KEY + "-slow"})
    assert busy.status_code == 409
    gates.leave.set()
    thread.join()
    assert answers[0].status_code == 201

    thread, answers = hold(app, gates, "/parked", RAW_KEY + "-parked")
    waiter: list[Any] = []
    duplicate = threading.Thread(
        target=lambda: waiter.append(
            app.test_client().post(
                "/parked", json={"n": 1}, headers={"Idempotency-Key": RAW_KEY + "-parked"}
            )
        )
    )
    duplicate.start()
    time.sleep(0.2)  # parked by now
    gates.leave.set()
    thread.join()
    duplicate.join()
    assert waiter[0].headers.get("Idempotent-Replayed") == "true"

    assert (
        client.post("/validate", json={}, headers={"Idempotency-Key": RAW_KEY + "-v"}).status_code
        == 400
    )
    return replay_wall


def scrape(registry: Any) -> tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    """The registry as Prometheus reads it: its text format, parsed back."""
    text = prometheus_client.generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, samples


def counted(samples: dict[Any, float], endpoint: str, decision: str, outcome: str) -> float:
    labels = frozenset({"endpoint": endpoint, "decision": decision, "outcome": outcome}.items())
    return samples.get(("idempotency_decisions_total", labels), 0.0)


# -- Prometheus ---------------------------------------------------------------------------------


def test_i23_8_c57_prometheus_counts_and_times_every_decision_by_endpoint_and_outcome(
    make_app,
) -> None:
    app, _, gates = build(make_app)
    registry = prometheus_client.CollectorRegistry()
    prometheus.instrument(app, registry)
    replay_wall = drive(app, gates)
    text, samples = scrape(registry)

    assert counted(samples, "pay", "executed", "new") == 1
    assert counted(samples, "pay", "stored", "whole") == 1
    assert counted(samples, "pay", "replayed", "database") == 1
    assert counted(samples, "pay", "key_reused", "422") == 1
    assert counted(samples, "slow", "conflict", "409") == 1
    assert counted(samples, "parked", "parked", "completed") == 1
    assert counted(samples, "parked", "replayed", "database") == 1
    assert counted(samples, "validate", "released", "view") == 1
    replay_seconds = frozenset(
        {"endpoint": "pay", "decision": "replayed", "outcome": "database"}.items()
    )
    assert samples[("idempotency_decision_seconds_count", replay_seconds)] == 1
    # In seconds, and that replay's own: within the request's wall time (not a speed bound).
    assert 0 < samples[("idempotency_decision_seconds_sum", replay_seconds)] <= replay_wall
    waited = frozenset({"endpoint": "parked", "outcome": "completed"}.items())
    assert samples[("idempotency_wait_seconds_count", waited)] == 1
    assert samples[("idempotency_wait_seconds_sum", waited)] >= 0.1
    # Never the key, its digest, the scope or a body: one time series per key would not end.
    digest = key_digest("scope:" + SCOPE, RAW_KEY)
    for secret in (RAW_KEY, digest, digest[:16], SCOPE, SECRET_BODY):
        assert secret not in text
    labels = {name for (_, items) in samples for name, _ in items}
    assert labels <= {"endpoint", "decision", "outcome", "le"}


def test_i23_8_c57_prometheus_counts_503_lease_lost_and_a_tier_outage(make_app) -> None:
    """503 when the database cannot claim, an owner whose lease was taken, and a Redis
    outage (counted once, not once per request)."""
    registry = prometheus_client.CollectorRegistry()
    down = Flask("telemetry_store_down")
    down.config["IDEMPOTENCY_DATABASE_URI"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    )
    down.config["IDEMPOTENCY_REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    Idempotency(down)
    prometheus.instrument(down, registry)

    @down.post("/pay")
    @idempotent
    def pay_down() -> Any:
        return jsonify(ok=True), 201

    for n in range(3):
        answer = down.test_client().post("/pay", json={}, headers={"Idempotency-Key": f"k{n}"})
        assert answer.status_code == 503

    app, idempotency, _ = build(make_app, {"IDEMPOTENCY_HEARTBEAT": False})
    prometheus.instrument(app, registry)

    @app.post("/forgotten")
    @idempotent
    def forgotten() -> Any:
        with app.app_context():  # an operator's `flask idempotency forget` mid-run
            idempotency.store.engine  # noqa: B018
            app.test_cli_runner().invoke(
                args=["idempotency", "forget", "lost-key", "--scope", SCOPE, "--yes"]
            )
        return jsonify(ok=True), 201

    lost = app.test_client().post("/forgotten", json={}, headers={"Idempotency-Key": "lost-key"})
    assert lost.status_code == 201
    _, samples = scrape(registry)
    assert counted(samples, "pay_down", "unavailable", "503") == 3
    assert counted(samples, "pay_down", "store_error", "cache:get") == 1  # once per outage
    assert counted(samples, "forgotten", "lease_lost", "complete") == 1


def test_i23_8_c57_prometheus_tells_a_503_from_a_request_run_unprotected() -> None:
    registry = prometheus_client.CollectorRegistry()
    app = Flask("telemetry_fail_open")
    app.config["IDEMPOTENCY_DATABASE_URI"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    )
    app.config["IDEMPOTENCY_FAIL_OPEN"] = True
    Idempotency(app)
    prometheus.instrument(app, registry)

    @app.post("/pay")
    @idempotent
    def pay_open() -> Any:
        return jsonify(ok=True), 201

    answer = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "k"})
    assert answer.status_code == 201 and answer.headers["Idempotency-Unprotected"]
    _, samples = scrape(registry)
    assert counted(samples, "pay_open", "unavailable", "unprotected") == 1
    assert counted(samples, "pay_open", "unavailable", "503") == 0


def test_i23_8_c57_prometheus_replays_by_source(make_app) -> None:
    """The cache tier in front: a replay from Redis is labelled ``cache``."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_missing("Redis", str(exc))
    finally:
        client.close()
    app, _, _ = build(
        make_app,
        {
            "IDEMPOTENCY_REDIS_URL": REDIS_URL,
            "IDEMPOTENCY_REDIS_PREFIX": f"test-telemetry-{uuid.uuid4().hex[:8]}",
        },
    )
    registry = prometheus_client.CollectorRegistry()
    prometheus.instrument(app, registry)
    key = {"Idempotency-Key": RAW_KEY}
    test_client = app.test_client()
    assert test_client.post("/pay", json={}, headers=key).status_code == 201
    assert test_client.post("/pay", json={}, headers=key).headers["Idempotent-Replayed"]
    _, samples = scrape(registry)
    assert counted(samples, "pay", "replayed", "cache") == 1


def test_i23_8_c57_several_apps_share_one_registry_and_instrumenting_twice_counts_once(
    make_app,
) -> None:
    registry = prometheus_client.CollectorRegistry()
    first, _, _ = build(make_app)
    second, _, _ = build(make_app)
    for app in (first, second, first):
        assert prometheus.instrument(app, registry) is prometheus.metrics_for(registry)
    for app in (first, second):
        assert (
            app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "a"}).status_code
            == 201
        )
    _, samples = scrape(registry)
    assert counted(samples, "pay", "executed", "new") == 2


def test_i23_8_c57_once_is_counted_under_its_job_name(make_app) -> None:
    app, idempotency, _ = build(make_app)
    registry = prometheus_client.CollectorRegistry()
    prometheus.instrument(app, registry)
    with app.app_context():
        for _ in range(2):
            with idempotency.once("invoice-7", name="mail") as run:
                if run.owned:
                    run.result = {"sent": True}
    _, samples = scrape(registry)
    assert counted(samples, "once:mail", "executed", "new") == 1
    assert counted(samples, "once:mail", "replayed", "database") == 1


# -- OpenTelemetry ------------------------------------------------------------------------------


def otel_providers() -> tuple[
    TracerProvider, InMemorySpanExporter, MeterProvider, InMemoryMetricReader
]:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    return tracer_provider, exporter, meter_provider, reader


def otel_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    points: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "flask_idempotency"
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def test_i23_8_c57_opentelemetry_spans_one_per_protected_request(make_app) -> None:
    app, _, gates = build(make_app)
    tracer_provider, exporter, meter_provider, _ = otel_providers()
    otel.instrument(app, tracer_provider=tracer_provider, meter_provider=meter_provider)
    outer = tracer_provider.get_tracer("test")
    with outer.start_as_current_span("POST /pay (the server span)") as server:
        first = app.test_client().post(
            "/slow", json={"n": 1}, headers={"Idempotency-Key": RAW_KEY + "-server"}
        )
    assert first.status_code == 201
    drive(app, gates)
    spans = [s for s in exporter.get_finished_spans() if s.name == "idempotency"]
    by = [
        (s.attributes["idempotency.endpoint"], s.attributes["idempotency.decision"]) for s in spans
    ]
    assert by.count(("pay", "executed")) == 1 and by.count(("pay", "replayed")) == 1
    assert ("pay", "key_reused") in by and ("slow", "conflict") in by
    assert by.count(("parked", "replayed")) == 1 and ("validate", "executed") in by

    owner = spans[0]
    assert owner.parent is not None and owner.parent.span_id == server.get_span_context().span_id
    assert owner.attributes["idempotency.settlement"] == "stored"
    assert owner.end_time - owner.start_time >= 50_000_000  # the view's 50 ms are inside it
    digest = key_digest("scope:" + SCOPE, RAW_KEY + "-server")
    assert owner.attributes["idempotency.key_digest"] == digest[:16]

    replay = next(s for s in spans if s.attributes["idempotency.decision"] == "replayed")
    assert replay.attributes["idempotency.source"] == "database"
    woken = next(
        s
        for s in spans
        if s.attributes["idempotency.endpoint"] == "parked"
        and s.attributes["idempotency.decision"] == "replayed"
    )
    assert woken.attributes["idempotency.wait.outcome"] == "completed"
    assert woken.attributes["idempotency.wait.duration"] >= 0.1
    released = next(s for s in spans if s.attributes["idempotency.endpoint"] == "validate")
    assert released.attributes["idempotency.settlement"] == "released"
    assert released.attributes["idempotency.settlement.detail"] == "view"
    for span in spans:
        text = repr(dict(span.attributes))
        assert RAW_KEY not in text and SCOPE not in text and SECRET_BODY not in text


def test_i23_8_c57_opentelemetry_a_503_span_is_an_error(make_app) -> None:
    tracer_provider, exporter, meter_provider, _ = otel_providers()
    down = Flask("otel_store_down")
    down.config["IDEMPOTENCY_DATABASE_URI"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    )
    Idempotency(down)
    otel.instrument(down, tracer_provider=tracer_provider, meter_provider=meter_provider)

    @down.post("/pay")
    @idempotent
    def pay_down() -> Any:
        return jsonify(ok=True), 201

    assert (
        down.test_client().post("/pay", json={}, headers={"Idempotency-Key": "k"}).status_code
        == 503
    )
    [span] = exporter.get_finished_spans()
    assert span.attributes["idempotency.decision"] == "unavailable"
    assert span.attributes["idempotency.outcome"] == "503"
    assert span.status.status_code == StatusCode.ERROR


def test_i23_8_c57_opentelemetry_metrics_match_the_prometheus_ones(make_app) -> None:
    app, _, gates = build(make_app)
    _, _, meter_provider, reader = otel_providers()
    otel.instrument(app, meter_provider=meter_provider, tracing=False)
    drive(app, gates)
    points = otel_points(reader)

    def count(endpoint: str, decision: str, outcome: str) -> int:
        wanted = {
            "idempotency.endpoint": endpoint,
            "idempotency.decision": decision,
            "idempotency.outcome": outcome,
        }
        return sum(
            p.count for p in points["idempotency.decision.duration"] if dict(p.attributes) == wanted
        )

    assert count("pay", "executed", "new") == 1 and count("pay", "replayed", "database") == 1
    assert count("pay", "key_reused", "422") == 1 and count("slow", "conflict", "409") == 1
    assert count("parked", "parked", "completed") == 1
    durations = {
        dict(p.attributes)["idempotency.decision"]: p.count
        for p in points["idempotency.decision.duration"]
        if dict(p.attributes)["idempotency.endpoint"] == "pay"
    }
    assert durations["replayed"] == 1
    [wait] = points["idempotency.wait.duration"]
    assert wait.count == 1 and wait.sum >= 0.1
    for name, data_points in points.items():
        for point in data_points:
            assert set(point.attributes) == {
                "idempotency.endpoint",
                "idempotency.decision",
                "idempotency.outcome",
            }, name


# -- switched on by configuration, off by default, free on unmarked views -------------------------


def test_i23_8_c57_off_by_default_and_on_by_configuration(make_app) -> None:
    from flask_idempotency.telemetry.hub import _hubs
    from flask_idempotency.telemetry.otel import OpenTelemetryMetrics, OpenTelemetryTracing
    from flask_idempotency.telemetry.prometheus import PrometheusMetrics

    plain, _, _ = build(make_app)
    assert plain not in _hubs
    app, _, _ = build(
        make_app,
        {"IDEMPOTENCY_METRICS": "prometheus, opentelemetry", "IDEMPOTENCY_TRACING": "true"},
    )
    kinds = {type(sink) for sink in _hubs[app].sinks.values()}
    assert kinds == {PrometheusMetrics, OpenTelemetryMetrics, OpenTelemetryTracing}
    before = prometheus_client.REGISTRY.get_sample_value(
        "idempotency_decisions_total", {"endpoint": "pay", "decision": "executed", "outcome": "new"}
    )
    app.test_client().post("/pay", json={}, headers={"Idempotency-Key": uuid.uuid4().hex})
    after = prometheus_client.REGISTRY.get_sample_value(
        "idempotency_decisions_total", {"endpoint": "pay", "decision": "executed", "outcome": "new"}
    )
    assert after == (before or 0) + 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "IDEMPOTENCY_METRICS names the library"),
        ("statsd", "'statsd' is not one of prometheus, opentelemetry"),
    ],
)
def test_i23_8_c56_a_malformed_metrics_setting_names_itself(make_app, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_app({"IDEMPOTENCY_METRICS": value})


def test_i23_8_c57_a_missing_library_names_the_extra(make_app, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'prometheus_client'.*extra 'prometheus'"):
        make_app({"IDEMPOTENCY_METRICS": "prometheus"})
    monkeypatch.setitem(sys.modules, "opentelemetry.metrics", None)
    with pytest.raises(
        ImportError, match=r"IDEMPOTENCY_TRACING.*'opentelemetry-api'.*extra 'opentelemetry'"
    ):
        make_app({"IDEMPOTENCY_TRACING": True})


def test_i23_8_c57_an_unprotected_request_runs_nothing_with_telemetry_on(make_app) -> None:
    from tests.test_request_state import _calls_into_the_package

    app, _, _ = build(make_app)
    tracer_provider, exporter, meter_provider, _ = otel_providers()
    otel.instrument(app, tracer_provider=tracer_provider, meter_provider=meter_provider)
    prometheus.instrument(app, prometheus_client.CollectorRegistry())
    client = app.test_client()
    assert client.post("/plain").status_code == 201
    entered = _calls_into_the_package(
        lambda: client.post("/plain", headers={"Idempotency-Key": "ignored"})
    )
    assert entered == ["guard_bodies"]  # the body cap's look-up (C31), and nothing of telemetry
    assert exporter.get_finished_spans() == ()


def test_i23_8_c57_disabled_layer_reports_nothing(make_app) -> None:
    from flask_idempotency.telemetry.hub import _hubs

    app, _, _ = build(make_app, {"IDEMPOTENCY_ENABLED": False, "IDEMPOTENCY_METRICS": "prometheus"})
    assert app not in _hubs


def test_i23_8_a_digest_scope_and_key_never_reach_the_labels() -> None:
    """The key digest of the record is what spans carry: as the logs name it (16 hex)."""
    assert len(key_digest(ANONYMOUS_SCOPE, RAW_KEY)[:16]) == 16


def test_i23_8_c57_a_once_run_inside_a_view_gets_its_own_span(make_app) -> None:
    """Two owners in one request (the view's claim and a once() run it makes): each
    span ends at its own settlement."""
    app, idempotency, _ = build(make_app)
    tracer_provider, exporter, _, _ = otel_providers()
    otel.instrument(app, tracer_provider=tracer_provider, metrics=False)

    @app.post("/checkout")
    @idempotent
    def checkout() -> Any:
        with idempotency.once("receipt-mail", name="mail") as run:
            if run.owned:
                run.result = {"sent": True}
        return jsonify(ok=True), 201

    answer = app.test_client().post("/checkout", json={}, headers={"Idempotency-Key": "c1"})
    assert answer.status_code == 201
    spans = {s.attributes["idempotency.endpoint"]: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"checkout", "once:mail"}
    for span in spans.values():
        assert span.attributes["idempotency.decision"] == "executed"
        assert span.attributes["idempotency.settlement"] == "stored"
    job, view = spans["once:mail"], spans["checkout"]
    assert view.start_time <= job.start_time and job.end_time <= view.end_time


# -- the docs say what a scrape shows ------------------------------------------------------------


def test_i23_8_c57_the_docs_name_every_metric_label_and_decision(make_app) -> None:
    """docs/observability.md lists every family, label and decision a scrape shows, and
    its example queries use only those."""
    import re
    from pathlib import Path

    from flask_idempotency.telemetry.hub import _TRANSLATE

    page = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text()
    app, _, gates = build(make_app)
    registry = prometheus_client.CollectorRegistry()
    prometheus.instrument(app, registry)
    drive(app, gates)
    families = {
        f.name
        for f in text_string_to_metric_families(
            prometheus_client.generate_latest(registry).decode()
        )
    }
    families = {f for f in families if not f.endswith("_created")}  # prometheus_client's own
    for family in families:
        assert family in page, family
    documented = set(re.findall(r"\bidempotency_[a-z_]+\b", page))
    scraped = {
        f"{name}{suffix}"
        for name in families
        for suffix in ("", "_total", "_bucket", "_count", "_sum")
    }
    assert documented <= scraped | {"idempotency_decision_duration_seconds_count"}, (
        documented - scraped
    )
    decisions = {translate({})[0] for translate in _TRANSLATE.values()}
    for decision in decisions:
        assert f"| `{decision}` |" in page, decision
    for instrument in ("idempotency.decision.duration", "idempotency.wait.duration"):
        assert f"`{instrument}`" in page
