"""The cache tier in front of the durable store (CONTRACT C22–C24).

The cache holds completed records only, never absence or in-progress state, so
losing it changes latency and nothing else. :class:`NoCache` is the tier when no
Redis is configured; the Redis tier implements the same three calls.
"""

from __future__ import annotations

from typing import Protocol

from ..records import Completed


class ResponseCache(Protocol):
    """A cache of completed records, keyed by record digest. No method ever raises."""

    def get(self, key_digest: str) -> Completed | None:
        """The cached completed record, or ``None`` on a miss or any cache error."""

    def promote(self, key_digest: str, record: Completed, ttl_ms: int) -> None:
        """Cache ``record`` for ``ttl_ms``, the time it has left by the database's clock
        (C23, C42); nothing when that is not positive."""

    def probe(self, key_digest: str) -> Completed | None:
        """One read even while the cache is backing off after a failure: the database is
        down and a cached record could still answer a replay (15.6)."""

    def discard(self, key_digest: str) -> None:
        """Drop a cached copy: its durable record was replaced after expiry (R59)."""


class NoCache:
    """No cache tier: every read goes to the durable store."""

    def get(self, key_digest: str) -> Completed | None:
        return None

    def promote(self, key_digest: str, record: Completed, ttl_ms: int) -> None:
        return None

    def probe(self, key_digest: str) -> Completed | None:
        return None

    def discard(self, key_digest: str) -> None:
        return None
