"""The cache's Cluster-only path: a completion's promote and wake-up in one round trip (C23).

On one node the record's ``SET`` and the check for a waiter go together on one
connection (:meth:`~.redis.RedisCache.promote_and_publish`). On a Cluster the same
holds only on the master that owns the record's slot, and only while the slot map
still puts the record's shard channel there; this is that path. The routing itself
is :class:`~flask_idempotency._wire.redis.DirectCluster`'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from ..records import Completed
from .outage import Outage, report_failure, report_success

if TYPE_CHECKING:
    from ..notify.cluster import ClusterNotifier


class _ShardedCache(Protocol):
    """What this path uses of :class:`~.redis.RedisCache` (named here, not imported: the
    cache module imports this one)."""

    _client: Any

    def outage_for(self, key_digest: str | None) -> Outage: ...

    def record_name(self, key_digest: str) -> str: ...

    def _encoded_with_ttl(
        self, name: str, record: Completed, ttl_ms: int, called: float
    ) -> tuple[bytes, int, float]: ...

    def _expire_again_if_late(self, name: str, px: int, read_at: float) -> None: ...


def promote_and_publish_on_shard(
    cache: _ShardedCache,
    key_digest: str,
    record: Completed,
    ttl_ms: int,
    notifier: ClusterNotifier,
    event: str,
) -> bool:
    """The record's ``SET`` and the check for a waiter in one write on the slot owner's
    connection (the waiting key shares the record's hash tag), then, if a waiter
    asked, its shard's ``SPUBLISH`` on the same connection: the shard channel is
    tagged onto the same master. ``ttl_ms`` is what the record has left now; the
    ``PX`` is read after encoding, as on one node (C53). ``False`` (the commands
    follow one by one, each routed and checked on its own) when the shard is in its
    back-off, the slot map no longer puts the channel on the record's master, or a
    reply says the slot moved (``DirectCluster.set_and_wake``); whatever went through
    already is sent again in the same order (C23), which is harmless.
    """
    called = time.monotonic()
    outage = cache.outage_for(key_digest)
    if ttl_ms <= 0 or outage.down:
        return False
    try:
        together = cache._client.set_and_wake
        route = notifier.route(key_digest)
    except Exception:
        return False  # no slot map yet: the two commands report the outage
    if route is None:
        return False
    name = cache.record_name(key_digest)
    try:
        value, px, read_at = cache._encoded_with_ttl(name, record, ttl_ms, called)
        if px <= 0:
            return False  # nothing to cache: the wake-up goes alone
        done = together(
            name,
            value,
            px,
            notifier.waiting_name(key_digest),
            *route,
            notifier.wakeup_payload(key_digest, event),
        )
        if done:
            cache._expire_again_if_late(name, px, read_at)
    except Exception as exc:
        notifier.forget_tags()
        report_failure(outage, exc, "promote", key_digest)
        return True
    if done:
        report_success(outage)
    return bool(done)
