"""The database's clock as this process sees it, without trusting the host's clock (C42).

Expiry is decided by the database. To cache a completed record for exactly the
time it has left, we need "now" by the database's clock; every answer of the store
carries it (a read's ``now_ms``, a fresh claim's ``expires_at_ms - ttl``). The offset
to this host's *monotonic* clock is kept from the latest answer, measured from the
moment the statement was sent, so the estimate errs towards "later" by at most one
round trip: a cached copy may vanish a little early, never outlive its record. The
wall clock (``time.time``) is never read, so a host an hour off changes nothing.
"""

from __future__ import annotations

import time


class DatabaseClock:
    """Database time estimated from the store's answers and this host's monotonic clock."""

    __slots__ = ("_offset_ms",)

    def __init__(self) -> None:
        self._offset_ms: float | None = None

    @staticmethod
    def mark() -> float:
        """The moment a statement is sent; pass it to :meth:`observe` with the answer."""
        return time.monotonic()

    def observe(self, db_now_ms: int, sent_at: float) -> None:
        """The database said "now" is ``db_now_ms``, answering a statement sent at ``sent_at``."""
        self._offset_ms = db_now_ms - sent_at * 1000.0

    def remaining_ms(self, expires_at_ms: int) -> int:
        """Time left for a record expiring at ``expires_at_ms`` (database time); 0 if unknown."""
        offset = self._offset_ms
        if offset is None:
            return 0
        return int(expires_at_ms - (time.monotonic() * 1000.0 + offset))
