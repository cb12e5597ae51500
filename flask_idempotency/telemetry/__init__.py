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

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from flask import Flask

from .. import signals

if TYPE_CHECKING:
    from ..config import Settings

#: What :func:`install` tells a user to install when a library is missing.
EXTRAS = {
    "prometheus": ("prometheus_client", "prometheus"),
    "opentelemetry": ("opentelemetry-api", "opentelemetry"),
}

#: ``request_waited``'s ``outcome`` (the type of what the wait ended in) as a label.
_WAIT_OUTCOMES = {"completed": "completed", "claim": "claimed", "record": "timed_out"}

#: Histogram buckets, in seconds: a replay from Redis takes well under a millisecond,
#: a parked duplicate up to ``IDEMPOTENCY_WAIT``, an owner's whole run up to its lease.
BUCKETS = (
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class Decision(NamedTuple):
    """One decision of the layer, as the sinks see it."""

    #: The endpoint (``once:<name>`` for ``once()``); ``""`` when none is known (a Redis
    #: outage found outside a request).
    endpoint: str
    decision: str
    outcome: str
    #: Seconds from the layer's first look at the request (or the ``once()`` call) to
    #: this decision: the time a replay, a 409 or a 422 cost; for ``executed``, the time
    #: to win the claim; for ``stored`` and ``released``, the owner's whole run.
    seconds: float
    #: The signal's other arguments (``key_digest``, ``waited``, …): for spans, never
    #: for metric labels.
    extra: dict[str, Any]


class Sink(Protocol):
    """Where decisions go: metrics, spans."""

    def record(self, decision: Decision) -> None: ...


def _store_error(extra: dict[str, Any]) -> tuple[str, str]:
    if extra.get("tier") == "database" and extra.get("action") == "claim":
        return "unavailable", str(extra.get("answer", "error"))
    return "store_error", f"{extra.get('tier')}:{extra.get('action')}"


def _waited(extra: dict[str, Any]) -> tuple[str, str]:
    outcome = str(extra.get("outcome"))
    return "parked", _WAIT_OUTCOMES.get(outcome, outcome)


#: ``(decision, outcome)`` of each signal a sink hears. ``lease_taken_over`` is left out:
#: ``executed`` with outcome ``taken_over`` says it.
_TRANSLATE: dict[Any, Callable[[dict[str, Any]], tuple[str, str]]] = {
    signals.request_replayed: lambda extra: ("replayed", str(extra.get("source"))),
    signals.request_executed: lambda extra: ("executed", str(extra.get("how"))),
    signals.request_waited: _waited,
    signals.request_conflict: lambda extra: ("conflict", "409"),
    signals.key_mismatch: lambda extra: ("key_reused", "422"),
    signals.response_stored: lambda extra: (
        "stored",
        "body_omitted" if extra.get("body_omitted") else "whole",
    ),
    signals.claim_released: lambda extra: ("released", str(extra.get("reason"))),
    signals.lease_lost: lambda extra: ("lease_lost", str(extra.get("action"))),
    signals.store_error: _store_error,
    signals.lease_renewal_failed: lambda extra: ("lease_renewal_failed", str(extra.get("reason"))),
    signals.transaction_retried: lambda extra: ("transaction_retried", str(extra.get("sqlstate"))),
}


class _Hub:
    """The receivers of one app: one per signal, handing each decision to every sink."""

    def __init__(self) -> None:
        self.sinks: dict[Any, Sink] = {}
        self._lock = threading.Lock()

    def add(self, key: Any, make: Callable[[], Sink]) -> Sink:
        with self._lock:
            sink = self.sinks.get(key)
            if sink is None:
                sink = self.sinks[key] = make()
            return sink

    def connect(self, app: Flask) -> None:
        for signal, translate in _TRANSLATE.items():
            signal.connect(self._receiver(translate), sender=app, weak=False)

    def _receiver(self, translate: Callable[[dict[str, Any]], tuple[str, str]]) -> Any:
        sinks = self.sinks

        def receive(sender: Any, **extra: Any) -> None:
            decision, outcome = translate(extra)
            event = Decision(
                extra.get("route") or "", decision, outcome, extra.get("duration") or 0.0, extra
            )
            for sink in tuple(sinks.values()):
                sink.record(event)

        return receive


_hubs: weakref.WeakKeyDictionary[Flask, _Hub] = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def add_sink(app: Flask, key: Any, make: Callable[[], Sink]) -> Sink:
    """Hand ``app``'s decisions to the sink ``make()`` builds, once per ``key`` and app."""
    with _hubs_lock:
        hub = _hubs.get(app)
        if hub is None:
            hub = _hubs[app] = _Hub()
            hub.connect(app)
    return hub.add(key, make)


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
            f"{setting} needs the {package} package: pip install 'Flask-Idempotency[{extra}]'."
        ) from None


def digest_prefix(extra: dict[str, Any]) -> str | None:
    """The first 16 hex characters of the key digest, as the logs name a record (C30)."""
    digest = extra.get("key_digest")
    return digest[:16] if isinstance(digest, str) else None
