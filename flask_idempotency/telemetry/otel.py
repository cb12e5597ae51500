"""OpenTelemetry spans and metrics of every decision (C57): the ``opentelemetry`` extra.

Metrics, through the meter ``flask_idempotency`` (attributes ``idempotency.endpoint``,
``idempotency.decision``, ``idempotency.outcome``):

``idempotency.decision.duration``
    histogram (s): the layer's time up to each decision. Its count is the number of
    decisions: the Prometheus counter ``idempotency_decisions_total`` and the
    histogram ``idempotency_decision_seconds`` in one instrument (exported to
    Prometheus as ``idempotency_decision_duration_seconds_count``, ``_sum``,
    ``_bucket``). One instrument, not two: the SDK checks the attributes of every
    measurement again, at about the cost of a span on the replay path.
``idempotency.wait.duration``
    histogram (s): how long parked duplicates waited (``idempotency.outcome``: what
    the wait ended in).

Tracing, through the tracer ``flask_idempotency``: one span named ``idempotency``
per protected request that reached a decision, a child of the span active at the
time (the server span of ``opentelemetry-instrumentation-flask``, say). It starts
when the layer first looked at the request and ends with the answer: at once for
a replay, a 409, a 422 or a 503; for the owner, when its outcome was settled
(stored or released), so its view's time is inside it. Attributes:

``idempotency.endpoint``, ``idempotency.decision``, ``idempotency.outcome``
    as for the metrics;
``idempotency.source``
    a replay's source: ``cache`` or ``database``;
``idempotency.wait.duration``, ``idempotency.wait.outcome``
    when the request was parked first;
``idempotency.key_digest``
    the first 16 hex characters of the digest of (scope, key), as the logs and
    ``flask idempotency show --digest`` name the record; never the key itself (C30);
``idempotency.settlement``
    the owner's end: ``stored``, ``released``, ``lease_lost`` or ``store_error``, and
    ``idempotency.settlement.detail`` (the release reason, the step, the tier).

A 503 and a lost lease or a failed store set the span's status to ``ERROR``.
``once()`` runs get a span too, named by their job (``once:<name>``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from importlib import metadata
from typing import Any

from flask import Flask
from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from . import BUCKETS, Decision, add_sink, digest_prefix

__all__ = ["OpenTelemetryMetrics", "OpenTelemetryTracing", "instrument"]

SCOPE_NAME = "flask_idempotency"
SPAN_NAME = "idempotency"
#: Decisions that answer the request; ``executed`` answers it when the owner settles.
_ANSWERS = frozenset({"replayed", "conflict", "key_reused", "unavailable"})
_SETTLEMENTS = frozenset({"stored", "released", "lease_lost", "store_error"})
_FAILED = frozenset({"unavailable", "lease_lost", "store_error"})


def _version() -> str:
    try:
        return metadata.version("Flask-Idempotency")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class OpenTelemetryMetrics:
    """The counter and histograms on one meter."""

    def __init__(self, meter_provider: Any = None) -> None:
        meter = (
            metrics.get_meter(SCOPE_NAME, _version())
            if meter_provider is None
            else meter_provider.get_meter(SCOPE_NAME, _version())
        )
        # No separate counter: a histogram's count is the number of decisions, and each
        # measurement costs the SDK its attribute checks again (about as much as a span).
        self.duration = _histogram(
            meter,
            "idempotency.decision.duration",
            "Time the idempotency layer had spent on a request when it decided.",
        )
        self.wait = _histogram(
            meter,
            "idempotency.wait.duration",
            "Time a duplicate stayed parked while its original ran.",
        )
        #: One attribute mapping per label set, made once (and never changed).
        self._attributes: dict[tuple[str, str, str], dict[str, str]] = {}

    def record(self, event: Decision) -> None:
        key = (event.endpoint, event.decision, event.outcome)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = self._attributes[key] = {
                "idempotency.endpoint": event.endpoint,
                "idempotency.decision": event.decision,
                "idempotency.outcome": event.outcome,
            }
        self.duration.record(event.seconds, attributes)
        if event.decision == "parked":
            self.wait.record(event.extra.get("waited") or 0.0, attributes)


def _histogram(meter: Any, name: str, description: str) -> Any:
    """A histogram in seconds with this package's buckets as advice (API 1.23 and later;
    an older API gets the SDK's default buckets)."""
    try:
        return meter.create_histogram(
            name, unit="s", description=description, explicit_bucket_boundaries_advisory=BUCKETS
        )
    except TypeError:
        return meter.create_histogram(name, unit="s", description=description)


class OpenTelemetryTracing:
    """A span per protected request (see the module's description).

    An owner's span waits for its settlement under (endpoint, digest): exactly one
    request owns a key at a time, and a ``once()`` run inside a view is told apart
    from the view's own claim. At most :data:`PENDING_LIMIT` wait at once: past it the
    oldest is ended as it stands (settlement ``unknown``), so nothing grows without
    bound if a settlement is never reported.
    """

    def __init__(self, tracer_provider: Any = None) -> None:
        self.tracer = (
            trace.get_tracer(SCOPE_NAME, _version())
            if tracer_provider is None
            else tracer_provider.get_tracer(SCOPE_NAME, _version())
        )
        self._owners: dict[tuple[str, Any], Any] = {}
        self._waits: dict[tuple[str, Any], Decision] = {}
        self._lock = threading.Lock()

    def record(self, event: Decision) -> None:
        decision = event.decision
        key = (event.endpoint, event.extra.get("key_digest"))
        if decision == "parked":
            with self._lock:
                _bounded(self._waits, key, event)
            return
        if decision in _ANSWERS or decision == "executed":
            span = self._start(event, key)
            if decision == "executed":
                with self._lock:
                    evicted = _bounded(self._owners, key, span)  # ended when it settles
                if evicted is not None:
                    evicted.set_attribute("idempotency.settlement", "unknown")
                    evicted.end()
                return
            if decision in _FAILED:
                span.set_status(Status(StatusCode.ERROR, f"{decision}: {event.outcome}"))
            span.end()
            return
        settles = decision in _SETTLEMENTS and not event.outcome.startswith("cache:")
        with self._lock:
            span = self._owners.pop(key, None) if settles else self._owners.get(key)
        if span is None:
            return  # no owner's span to tell (a Redis outage found outside a request)
        if settles:
            span.set_attributes(
                {"idempotency.settlement": decision, "idempotency.settlement.detail": event.outcome}
            )
            if decision in _FAILED:
                span.set_status(Status(StatusCode.ERROR, f"{decision}: {event.outcome}"))
            span.end()
        else:  # a Redis failure, a renewal given up, a retried transaction: moments of its run
            span.add_event(f"idempotency.{decision}", {"idempotency.outcome": event.outcome})

    def _start(self, event: Decision, key: tuple[str, Any]) -> Any:
        attributes: dict[str, Any] = {
            "idempotency.endpoint": event.endpoint,
            "idempotency.decision": event.decision,
            "idempotency.outcome": event.outcome,
        }
        digest = digest_prefix(event.extra)
        if digest is not None:
            attributes["idempotency.key_digest"] = digest
        if event.decision == "replayed":
            attributes["idempotency.source"] = event.outcome
        if self._waits:
            with self._lock:
                waited = self._waits.pop(key, None)
            if waited is not None:
                attributes["idempotency.wait.duration"] = waited.extra.get("waited") or 0.0
                attributes["idempotency.wait.outcome"] = waited.outcome
        started = time.time_ns() - int(event.seconds * 1e9)
        return self.tracer.start_span(
            SPAN_NAME, kind=SpanKind.INTERNAL, attributes=attributes, start_time=started
        )


#: Owners' spans (and parked requests' waits) kept at once, per tracer, at most.
PENDING_LIMIT = 10_000


def _bounded(pending: dict[Any, Any], key: Any, value: Any) -> Any:
    """Keep ``value`` under ``key``; return the oldest entry it pushed out, if any."""
    pending[key] = value
    if len(pending) > PENDING_LIMIT:
        return pending.pop(next(iter(pending)))
    return None


#: The metrics and tracing objects made for each provider (``None``: the global one).
_made: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_made_for_global: dict[str, Any] = {}
_lock = threading.Lock()


def _shared(provider: Any, kind: str, make: Callable[[], Any]) -> Any:
    """One metrics or tracing object per provider: instruments are made once per meter."""
    with _lock:
        made = _made_for_global if provider is None else _made.setdefault(provider, {})
        found = made.get(kind)
        if found is None:
            found = made[kind] = make()
        return found


def instrument(
    app: Flask,
    *,
    meter_provider: Any = None,
    tracer_provider: Any = None,
    metrics: bool = True,
    tracing: bool = True,
) -> None:
    """Report ``app``'s decisions to OpenTelemetry: metrics, spans, or both.

    ``meter_provider`` / ``tracer_provider``: default, the global ones (set before or
    after this call: the global proxy follows). Callable before or after ``init_app``;
    a second call with the same providers changes nothing.
    """
    if metrics:
        meters = _shared(meter_provider, "metrics", lambda: OpenTelemetryMetrics(meter_provider))
        add_sink(app, ("otel-metrics", id(meters)), lambda: meters)
    if tracing:
        tracer = _shared(tracer_provider, "tracing", lambda: OpenTelemetryTracing(tracer_provider))
        add_sink(app, ("otel-tracing", id(tracer)), lambda: tracer)
