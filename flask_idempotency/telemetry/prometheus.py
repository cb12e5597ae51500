"""Prometheus metrics of every decision (C57): the ``prometheus`` extra, ``prometheus_client``.

Three families, labelled by endpoint and outcome, never by key, scope or body:

``idempotency_decisions_total{endpoint, decision, outcome}``
    counter: one per decision (see :mod:`flask_idempotency.telemetry` for the values).
``idempotency_decision_seconds{endpoint, decision, outcome}``
    histogram: the layer's time up to each decision.
``idempotency_wait_seconds{endpoint, outcome}``
    histogram: how long parked duplicates waited, by what the wait ended in.

Enabled by ``IDEMPOTENCY_METRICS = "prometheus"`` (the default registry) or by
:func:`instrument` with a registry of your own. Expose the registry as you already
do (``prometheus_client.make_wsgi_app()``, ``start_http_server``, or your
exporter); under gunicorn with several workers use ``prometheus_client``'s
multiprocess mode, as for any other metric.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from flask import Flask
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from . import BUCKETS, Decision, add_sink

__all__ = ["PrometheusMetrics", "instrument"]


class PrometheusMetrics:
    """The metric families in one registry, shared by every app instrumented into it."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "idempotency_decisions",
            "Decisions of the idempotency layer, by endpoint, decision and outcome.",
            ["endpoint", "decision", "outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "idempotency_decision_seconds",
            "Seconds the idempotency layer had spent on a request when it took a decision.",
            ["endpoint", "decision", "outcome"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.wait = Histogram(
            "idempotency_wait_seconds",
            "Seconds a duplicate stayed parked while its original ran, by what it ended in.",
            ["endpoint", "outcome"],
            buckets=BUCKETS,
            registry=registry,
        )
        #: The labelled children, found once per label set (``labels()`` costs more).
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._waits: dict[tuple[str, str], Any] = {}

    def record(self, event: Decision) -> None:
        key = (event.endpoint, event.decision, event.outcome)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.decisions.labels(*key),
                self.seconds.labels(*key),
            )
        children[0].inc()
        children[1].observe(event.seconds)
        if event.decision == "parked":
            wait_key = (event.endpoint, event.outcome)
            wait = self._waits.get(wait_key)
            if wait is None:
                wait = self._waits[wait_key] = self.wait.labels(*wait_key)
            wait.observe(event.extra.get("waited") or 0.0)


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, PrometheusMetrics] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def metrics_for(registry: CollectorRegistry) -> PrometheusMetrics:
    """The families in ``registry``, made on first use (a registry refuses them twice)."""
    with _lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = PrometheusMetrics(registry)
        return metrics


def instrument(app: Flask, registry: CollectorRegistry | None = None) -> PrometheusMetrics:
    """Count and time ``app``'s decisions in ``registry`` (default: the global one).

    Callable before or after ``init_app``, once or more (later calls with the same
    registry change nothing). Several apps may share one registry: their decisions
    add up, told apart by endpoint.
    """
    metrics = metrics_for(REGISTRY if registry is None else registry)
    sink = add_sink(app, ("prometheus", id(metrics)), lambda: metrics)
    assert sink is metrics
    return metrics
