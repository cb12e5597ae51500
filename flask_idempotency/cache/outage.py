"""Losing Redis changes latency, not outcomes (C24): the breaker that skips it while it is down.

Commands run with short socket timeouts and no retries; the first failure marks the
tier down for a back-off (1 s) during which Redis is skipped entirely: reads go to
the database, waiters poll. One probe at a time tests whether it came back. Only a
probe's failure can grow the back-off, and only one that made its request wait (a
timeout): it doubles, up to 10 s. The commands that were already on their way when
Redis went away fail too, however many there are: together they are the one failure
that started the outage (C54). A probe refused at once (nothing listens: Redis is
restarting) cost its request nothing, so the next probe follows one step later, and
a restarted Redis is in use again within about a second, whatever the load. Each
outage is logged once as a warning, its end once, and ``store_error`` with
``tier="cache"`` is sent once per outage (:func:`report_failure`,
:func:`report_success`).

One :class:`Outage` is shared by a tier's cache and notifier; on a Cluster,
:class:`ShardOutages` keeps one per master, so a lost shard does not switch the
cache off for the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from flask import current_app, has_app_context, has_request_context, request

from .. import redis_clients, signals
from ..store.errors import StoreError

log = logging.getLogger("flask_idempotency")


class Outage:
    """Tracks whether Redis is usable; after a failure, skips it for a back-off.

    Like a circuit breaker: while down, ``allows()`` is false until the back-off
    passes, then exactly one caller is let through as a probe. Its success ends
    the outage; its failure, if it timed out, doubles the back-off (up to ``cap``).
    A failure of anyone else while down (a command sent before Redis went away)
    changes nothing: the outage it belongs to has begun already (C54).
    """

    def __init__(
        self, first: float = 1.0, cap: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._first = first
        self._cap = cap
        self.clock = clock
        self._lock = threading.Lock()
        self._down = False
        self._retry_at = 0.0
        self._backoff = first
        #: The thread let through as this back-off period's probe (``None``: none is out).
        self._prober: int | None = None
        #: What the latest counted failure was: ``"redis"``, or ``"identity"`` when the
        #: store's identity (which names every key) could not be read from its database.
        self.cause = "redis"

    @property
    def down(self) -> bool:
        return self._down

    def allows(self) -> bool:
        """May this call use Redis? While down, only one probe per back-off period."""
        if not self._down:
            return True
        with self._lock:
            now = self.clock()
            if not self._down or now >= self._retry_at:
                self._retry_at = now + self._backoff  # the others skip while the probe runs
                self._prober = threading.get_ident()
                return True
            return False

    def failed(self, slow: bool = True, cause: str = "redis") -> bool:
        """Record a failure; ``True`` if it starts a new outage.

        While down, only the probe's failure counts: ``slow`` (it timed out, so its
        request paid for it) doubles the back-off, a quick one (refused) keeps it; the
        next probe follows one back-off later. Anyone else's failure is a command from
        before the outage and changes nothing.
        """
        with self._lock:
            if not self._down:
                self._down = True
                self._backoff = self._first
                self._retry_at = self.clock() + self._backoff
                self._prober = None
                self.cause = cause
                return True
            if self._prober != threading.get_ident():
                return False
            self._prober = None
            self.cause = cause
            if slow:
                self._backoff = min(self._backoff * 2, self._cap)
            self._retry_at = self.clock() + self._backoff
            return False

    def succeeded(self) -> bool:
        """Record a success; ``True`` if it ends an outage."""
        if not self._down:
            return False
        with self._lock:
            ended = self._down
            self._down = False
            self._backoff = self._first
            self._prober = None
            return ended


class ShardOutages:
    """One :class:`Outage` per cluster master, found from the client's slot map (no I/O)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._by_node: dict[str, Outage] = {}
        self._refreshed = 0.0
        self._refresh_lock = threading.Lock()

    def for_digest(self, key_digest: str, fallback: Outage) -> Outage:
        try:
            outage = self._outage_of(key_digest)
            if outage.down and self._refresh_slot_map():
                # A dead master's replica may have taken its slots: while that master is
                # in its back-off no command reaches it, so nothing else would ever tell
                # the client the slot map changed and its shard would stay dark.
                outage = self._outage_of(key_digest)
        except Exception:
            return fallback  # no slot map yet (the cluster is unreachable): the tier's own
        return outage

    def _outage_of(self, key_digest: str) -> Outage:
        name = str(self._client.get_node_from_key(f"{{{key_digest}}}").name)
        outage = self._by_node.get(name)
        if outage is None:
            outage = self._by_node.setdefault(name, Outage())
        return outage

    def _refresh_slot_map(self) -> bool:
        """Re-read the slot map at most once per topology check interval per process."""
        now = time.monotonic()
        if now - self._refreshed < redis_clients.TOPOLOGY_CHECK_INTERVAL:
            return False
        with self._refresh_lock:
            if now - self._refreshed < redis_clients.TOPOLOGY_CHECK_INTERVAL:
                return False
            self._refreshed = now
        self._client.nodes_manager.initialize()
        return True


# -- outage bookkeeping (shared by the cache and the notifier) ------------------------


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a timeout: the request waited for it, unlike
    a refused connection or an error reply, which cost nothing."""
    from redis.exceptions import TimeoutError as RedisTimeout

    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            return False
        if isinstance(seen, (RedisTimeout, TimeoutError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


_REDIS_UNAVAILABLE = (
    "idempotency: Redis unavailable (%s: %s); serving from the database and"
    " polling for wake-ups until it is back"
)
_IDENTITY_UNREADABLE = (
    "idempotency: the Redis tier waits for this store's identity (%s: %s); serving"
    " from the database until it can be read"
)
_REDIS_BACK = "idempotency: Redis is reachable again; cache and wake-ups resumed"
_IDENTITY_READ = "idempotency: this store's identity is read; cache and wake-ups resumed"


def report_failure(outage: Outage, exc: BaseException, action: str, key_digest: str | None) -> None:
    # Naming a key in Redis needs the store's identity, read from its database: a store
    # error here means that database is down or misconfigured, not Redis. The tier backs
    # off all the same (nothing it could name is known to be this store's), under that name.
    identity = isinstance(exc, StoreError)
    if not outage.failed(slow=timed_out(exc), cause="identity" if identity else "redis"):
        return
    log.warning(_IDENTITY_UNREADABLE if identity else _REDIS_UNAVAILABLE, type(exc).__name__, exc)
    if signals.store_error.receivers:
        signals.send(
            signals.store_error,
            current_app._get_current_object() if has_app_context() else None,  # type: ignore[attr-defined]
            key_digest=key_digest,
            scope=None,
            route=request.endpoint if has_request_context() else None,
            duration=0.0,
            tier="cache",
            error=f"{type(exc).__name__}: {exc}",
            action=action,
        )


def report_success(outage: Outage) -> None:
    if outage.succeeded():
        log.info(_IDENTITY_READ if outage.cause == "identity" else _REDIS_BACK)
