"""The Redis tier: a cache of completed records and the cross-process wake-up channel.

Redis is never the source of truth (C22). It holds only completed records, under
``{prefix}:{<digest>}`` where the digest is SHA-256 of (scope, key), so neither the
raw key nor the scope ever reaches Redis (C30, R69), and each copy expires at the
durable record's own absolute expiry (``PXAT``), so a replay from Redis never
outlives the record. Absence and in-progress state are never cached: a miss
always falls through to the durable store. Completion promotes the record and
publishes ``{"k": <digest>, "e": "done"}`` on ``{prefix}:done`` in one round trip.

Losing Redis changes latency, not outcomes (C24). Commands run with short socket
timeouts and no retries; the first failure marks the tier down for a back-off
(1 s doubling to 10 s) during which Redis is skipped entirely: reads go to the
database, waiters poll. One probe at a time tests whether it came back. Each
outage is logged once as a warning, its end once, and ``store_error`` with
``tier="cache"`` is sent once per outage. No method raises.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from flask import current_app, has_app_context, has_request_context, request

from . import signals
from .listener import WakeupListener, listener_for
from .records import Completed

if TYPE_CHECKING:
    from .config import Settings
    from .wakeup import WakeupHub

log = logging.getLogger("flask_idempotency")

#: Suffix of the wake-up channel: ``{prefix}:done`` carries both ``done`` and ``released``.
CHANNEL_SUFFIX = "done"


class Outage:
    """Tracks whether Redis is usable; after a failure, skips it for a growing back-off.

    Like a circuit breaker: while down, ``allows()`` is false until the back-off
    passes, then exactly one caller is let through as a probe. Its success ends
    the outage; its failure doubles the back-off (up to ``cap``).
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
                return True
            return False

    def failed(self) -> bool:
        """Record a failure; ``True`` if it starts a new outage."""
        with self._lock:
            started = not self._down
            if started:
                self._backoff = self._first
            else:
                self._backoff = min(self._backoff * 2, self._cap)
            self._down = True
            self._retry_at = self.clock() + self._backoff
            return started

    def succeeded(self) -> bool:
        """Record a success; ``True`` if it ends an outage."""
        if not self._down:
            return False
        with self._lock:
            ended = self._down
            self._down = False
            self._backoff = self._first
            return ended


class RedisTier:
    """:class:`~flask_idempotency.cache.ResponseCache` and
    :class:`~flask_idempotency.wakeup.CrossProcessChannel` on one Redis."""

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "idem",
        listener_key: Hashable | None = None,
        listener_connect: Callable[[], Any] | None = None,
        first_wait: float = 0.5,
    ) -> None:
        self._client = client
        self.prefix = prefix
        self.channel = f"{prefix}:{CHANNEL_SUFFIX}"
        self.outage = Outage()
        connect = listener_connect or (lambda: client)
        # Keyed by the client object itself, not id(client): the registry then holds it,
        # so a later client can never reuse its id and be handed this listener.
        self._listener_key = (listener_key or ("client", client), self.channel)
        self._new_listener = lambda: WakeupListener(connect, self.channel, first_wait=first_wait)

    @classmethod
    def from_settings(cls, settings: Settings, client: Any = None) -> RedisTier:
        """The tier for an app: from a ready ``client`` (e.g. fakeredis) or the URL."""
        timeout = settings.redis_socket_timeout
        first_wait = min(1.0, max(0.25, 5 * timeout))
        if client is not None:
            return cls(client, prefix=settings.redis_prefix, first_wait=first_wait)
        url = settings.redis_url
        assert url, "RedisTier needs IDEMPOTENCY_REDIS_URL or a client"
        command_client = _client_from_url(url, socket_timeout=timeout, connect_timeout=timeout)
        subscriber: list[Any] = []

        def subscriber_client() -> Any:
            # Built in the listener thread on first need; a blocking read must not be
            # cut short by the command timeout, so it gets its own, longer one.
            if not subscriber:
                subscriber.append(
                    _client_from_url(url, socket_timeout=10.0, connect_timeout=max(1.0, timeout))
                )
            return subscriber[0]

        return cls(
            command_client,
            prefix=settings.redis_prefix,
            listener_key=("url", url),
            listener_connect=subscriber_client,
            first_wait=first_wait,
        )

    # -- names ---------------------------------------------------------------------

    def record_name(self, key_digest: str) -> str:
        """The Redis key of a completed record: the digest only, in a hash tag (R70)."""
        return f"{self.prefix}:{{{key_digest}}}"

    @staticmethod
    def wakeup_payload(key_digest: str, event: str) -> str:
        return json.dumps({"k": key_digest, "e": event}, separators=(",", ":"))

    # -- ResponseCache -------------------------------------------------------------

    def get(self, key_digest: str) -> Completed | None:
        if not self.outage.allows():
            return None
        try:
            raw = self._client.get(self.record_name(key_digest))
        except Exception as exc:
            self._failed(exc, "get", key_digest)
            return None
        self._succeeded()
        if raw is None:
            return None
        try:
            record = Completed.from_json(raw)
        except Exception:
            record = None
        if record is None:
            # Not ours or corrupt: ignore it; the durable read that follows overwrites it.
            log.debug("idempotency: ignored an unreadable cached record %s", key_digest[:16])
        return record

    def promote(self, key_digest: str, record: Completed, *, publish: bool) -> None:
        cacheable = record.expires_at_ms > int(time.time() * 1000)
        if not (cacheable or publish) or not self.outage.allows():
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            if cacheable:
                pipe.set(self.record_name(key_digest), record.to_json(), pxat=record.expires_at_ms)
            if publish:
                pipe.publish(self.channel, self.wakeup_payload(key_digest, "done"))
            pipe.execute()
        except Exception as exc:
            self._failed(exc, "promote", key_digest)
            return
        self._succeeded()

    def discard(self, key_digest: str) -> None:
        if not self.outage.allows():
            return
        try:
            self._client.delete(self.record_name(key_digest))
        except Exception as exc:
            self._failed(exc, "discard", key_digest)
            return
        self._succeeded()

    # -- CrossProcessChannel ---------------------------------------------------------

    def ensure_listening(self, hub: WakeupHub) -> bool:
        try:
            return self.listener.ensure(hub)
        except Exception as exc:
            log.warning("idempotency: could not start the wake-up listener: %s", exc)
            return False

    def publish(self, key_digest: str, event: str) -> None:
        if not self.outage.allows():
            return
        try:
            self._client.publish(self.channel, self.wakeup_payload(key_digest, event))
        except Exception as exc:
            self._failed(exc, "publish", key_digest)
            return
        self._succeeded()

    # -- operations ----------------------------------------------------------------

    @property
    def listener(self) -> WakeupListener:
        """This process's subscriber for this Redis and channel."""
        return listener_for(self._listener_key, self._new_listener)

    def ping(self) -> bool:
        """Whether Redis answers now (respects the outage back-off); for health checks."""
        if not self.outage.allows():
            return False
        try:
            self._client.ping()
        except Exception as exc:
            self._failed(exc, "ping", None)
            return False
        self._succeeded()
        return True

    def close(self) -> None:
        """Stop this process's listener for this Redis (tests, shutdown)."""
        self.listener.stop()

    # -- outage bookkeeping --------------------------------------------------------

    def _failed(self, exc: BaseException, action: str, key_digest: str | None) -> None:
        if not self.outage.failed():
            return
        log.warning(
            "idempotency: Redis unavailable (%s: %s); serving from the database and"
            " polling for wake-ups until it is back",
            type(exc).__name__,
            exc,
        )
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

    def _succeeded(self) -> None:
        if self.outage.succeeded():
            log.info("idempotency: Redis is reachable again; cache and wake-ups resumed")


def _client_from_url(url: str, *, socket_timeout: float, connect_timeout: float) -> Any:
    """A client that fails fast: short timeouts, and the back-off is ours.

    One immediate retry on a broken connection only: after a Redis restart the pool
    still holds sockets to the old server, and the first command on each would
    otherwise count as a new outage. A server that is really down refuses the
    retry at once; a timeout is never retried.
    """
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise RuntimeError(
            "IDEMPOTENCY_REDIS_URL needs the redis package: pip install 'Flask-Idempotency[redis]'"
        ) from None

    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        socket_keepalive=True,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        retry_on_timeout=False,
    )
