"""Built-in telemetry: every decision counted, timed and traced (C57).

Built on the :mod:`~flask_idempotency.signals` the layer already sends, so the
request path knows nothing of it: a receiver per signal and app turns each
signal into one :class:`Decision` (what was decided, with which outcome, on
which endpoint, and how long the layer had spent by then) and hands it to the
sinks installed on that app:

- :func:`flask_idempotency.telemetry.prometheus.instrument`: counters and
  histograms in a ``prometheus_client`` registry (the ``prometheus`` extra);
- :func:`flask_idempotency.telemetry.otel.instrument`: the same metrics through
  an OpenTelemetry meter, and a span per protected request (the
  ``opentelemetry`` extra).

``IDEMPOTENCY_METRICS`` and ``IDEMPOTENCY_TRACING`` install them from
``init_app`` (:func:`install`); calling ``instrument`` yourself does the same
with a registry or providers of your choice. Off by default. Labels and
attributes name the endpoint and the outcome, never a key, a scope or a body.
Nothing here runs on a request to an unmarked view: the layer sends no signal
there.

========================= ======================================================
decision                  outcome
========================= ======================================================
``executed``              how the claim was won: ``new``, ``replaced``, ``taken_over``
``replayed``              where the record came from: ``cache``, ``database``
``parked``                what the wait ended in: ``completed`` (woken to a replay),
                          ``claimed`` (woken to run the view: the original gave up
                          its claim), ``timed_out`` (then 409)
``conflict``              ``409``: the original still runs after the wait
``key_reused``            ``422``: the key came with a different request
``unavailable``           the database could not claim: ``503``, or ``unprotected``
                          (``IDEMPOTENCY_FAIL_OPEN``), ``error`` for ``once()``
``stored``                the owner's answer was stored: ``whole``, ``body_omitted``
``released``              the claim was given back: the reason (``view``,
                          ``exception``, ``transient-status``, ``server-error``, …)
``lease_lost``            an owner found its lease taken: the step (``complete``,
                          ``release``, ``begin``)
``store_error``           a tier failed: ``<tier>:<step>`` (``cache:get``,
                          ``database:complete``, …); a Redis outage counts once
``lease_renewal_failed``  the heartbeat gave up: ``taken-over``, ``store-unavailable``,
                          ``max-runtime``
``transaction_retried``   transactional mode re-ran the view: the SQLSTATE
========================= ======================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flask import Flask

from .hub import BUCKETS, EXTRAS, Decision, Sink, add_sink, digest_prefix

if TYPE_CHECKING:
    from ..config import Settings

__all__ = ["BUCKETS", "EXTRAS", "Decision", "Sink", "add_sink", "digest_prefix", "install"]


def install(app: Flask, settings: Settings) -> None:
    """What ``IDEMPOTENCY_METRICS`` and ``IDEMPOTENCY_TRACING`` ask for (from ``init_app``).

    A library that is not installed is an error naming the setting and the extra.
    """
    if "prometheus" in settings.metrics:
        _require("prometheus", "IDEMPOTENCY_METRICS = 'prometheus'")
        from . import prometheus

        prometheus.instrument(app)
    otel_metrics = "opentelemetry" in settings.metrics
    if otel_metrics or settings.tracing:
        setting = "IDEMPOTENCY_TRACING" if settings.tracing else "IDEMPOTENCY_METRICS"
        _require("opentelemetry", f"{setting} (OpenTelemetry)")
        from . import otel

        otel.instrument(app, metrics=otel_metrics, tracing=settings.tracing)


def _require(backend: str, setting: str) -> None:
    package, extra = EXTRAS[backend]
    module = "prometheus_client" if backend == "prometheus" else "opentelemetry.metrics"
    try:
        __import__(module)
    except ImportError:
        raise ImportError(
            f"{setting} needs the {package} package: pip install '{package}'"
            f" (Flask-Idempotency's extra '{extra}')."
        ) from None
