"""SQLite: ``INSERT … ON CONFLICT DO NOTHING RETURNING`` and a millisecond clock.

Everything else is the plain SQL of :class:`~.base.Dialect`: no row locks to wait
for (one writer at a time), no retryable error codes, a prune without a cursor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.compiler import compiles

from ..clock import db_now_ms
from .base import Dialect


@compiles(db_now_ms, "sqlite")
def _now_ms_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    # strftime('%s') is whole seconds; '%f' is SS.SSS, whose last three digits are ms.
    return (
        "(CAST(strftime('%s', 'now') AS INTEGER) * 1000"
        " + CAST(substr(strftime('%f', 'now'), 4) AS INTEGER))"
    )


class SQLite(Dialect):
    """SQLite, through the standard library's sqlite3."""

    def largest_body(self, ask: Callable[[Callable[[Connection], Any]], Any]) -> int | None:
        """SQLite's default SQLITE_MAX_LENGTH (10^9 bytes a value; bound as a blob)."""
        return 1_000_000_000

    def claim_statement(self, table: Table, values: dict[str, Any]) -> Any:
        return (
            sqlite.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[table.c.key_digest])
            .returning(table.c.id, table.c.expires_at_ms)
        )
