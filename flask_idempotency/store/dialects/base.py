"""The rules every dialect starts from: plain SQL, and nothing a database may lack.

A database the store has no module for gets exactly these; its claim is refused
(:meth:`Dialect.claim_statement`), so every request on it answers 503.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Table, delete, select


class Dialect:
    """What the store does differently on one database (SQLAlchemy's ``dialect.name``)."""

    #: Whether ``UPDATE … RETURNING`` exists; without it the store checks the matched-row
    #: count and reads the row it now holds locked.
    returns_from_update = True

    def __init__(self, name: str) -> None:
        self.name = name

    # -- the claim ------------------------------------------------------------------

    def claim_statement(self, table: Table, values: dict[str, Any]) -> Any:
        """An INSERT that does nothing when the key is taken; with ``RETURNING`` where it
        exists (the winner learns it from the returned row)."""
        raise ValueError(
            f"the {self.name} dialect is not supported (PostgreSQL, MySQL/MariaDB or SQLite)"
        )

    def claim_or_read_statement(self, table: Table, values: dict[str, Any]) -> Any:
        """The claim and, when it meets a record, that record, in one statement; only
        where :meth:`autocommit_pool` is true."""
        raise NotImplementedError(f"no claim-or-read statement on {self.name}")

    def autocommit_pool(self, driver: str) -> bool:
        """Whether the request path's single statements get a pool of their own whose
        connections are born in autocommit (one round trip per statement)."""
        return False

    def async_claim_prefix(self, driver: str) -> str | None:
        """SQL that, sent before the claim in one simple query, lets its transaction
        commit without waiting for the flush (``IDEMPOTENCY_ASYNC_CLAIM``); ``None``
        where the driver cannot send both at once."""
        return None

    def commit_claim_asynchronously(self, conn: Connection) -> None:
        """Let the transaction of ``conn`` commit without waiting for the flush, where the
        database can (``IDEMPOTENCY_ASYNC_CLAIM``)."""

    # -- locks and errors -----------------------------------------------------------------

    @contextmanager
    def lock_wait_bounded(self, conn: Connection) -> Iterator[None]:
        """Let the transaction's statements wait at most a moment for another's row lock."""
        yield

    def largest_body(self, ask: Callable[[Callable[[Connection], Any]], Any]) -> int | None:
        """The largest response body a completion can carry on this database (C58);
        ``None``: no limit known. A body over it is stored as omitted (C33) without being
        sent: the database would refuse it for good, on MySQL/MariaDB by resetting the
        connection. A database that says it only when asked runs its query through
        ``ask`` (once per store); one whose limit is fixed answers without a connection,
        so no request pays a round trip or holds a pooled connection for it."""
        return None

    def is_retryable(self, exc: BaseException) -> bool:
        """A serialization failure, deadlock or lock-wait timeout of this database: the
        statement may succeed when run again in a fresh transaction (C26)."""
        return False

    def is_lock_unavailable(self, exc: BaseException | None) -> bool:
        """The guarded statement gave up waiting for another transaction's row lock."""
        return False

    # -- maintenance ------------------------------------------------------------------------

    def prune_batch(
        self,
        conn: Connection,
        table: Table,
        condition: Any,
        batch_size: int,
        from_expiry: int | None,
    ) -> tuple[int, int | None]:
        """Delete up to ``batch_size`` rows matching ``condition``, oldest expiry first:
        (rows deleted, the latest expiry deleted or ``None`` when not known).

        SQLite removes index entries as it deletes: no cursor needed, and no
        ``DELETE … RETURNING``, which only SQLite 3.35 and later understand.
        """
        stmt = delete(table).where(
            table.c.id.in_(oldest(table, condition, batch_size).scalar_subquery())
        )
        return int(conn.execute(stmt).rowcount), None


def oldest(table: Table, condition: Any, batch_size: int) -> Any:
    """The ids of up to ``batch_size`` rows matching ``condition``, oldest expiry first."""
    return select(table.c.id).where(condition).order_by(table.c.expires_at_ms).limit(batch_size)
