"""The database's clock: the SQL that reads it, and its estimate in this process (C42, C52).

:class:`db_now_ms` is "now" by the database's clock in epoch milliseconds, as one SQL
expression. Each dialect module (:mod:`.dialects`) registers how its database
writes it, so that no session time zone or daylight saving change can shift it
(C52); the rule here is the SQL-standard fallback.

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
from typing import Any

from sqlalchemy import BigInteger
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class db_now_ms(FunctionElement[int]):
    """The database's current time in epoch milliseconds."""

    type = BigInteger()
    inherit_cache = True
    name = "db_now_ms"


@compiles(db_now_ms)
def _now_ms_default(element: Any, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM CURRENT_TIMESTAMP) * 1000 AS BIGINT)"


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
