"""PostgreSQL: ``INSERT … ON CONFLICT DO NOTHING RETURNING``, ``lock_timeout``, SQLSTATEs.

With psycopg2 the request path has a pool of its own whose connections are born in
autocommit: its claim and the record in its way come back from one statement
(:meth:`PostgreSQL.claim_or_read_statement`), in one round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Table,
    bindparam,
    delete,
    exists,
    literal,
    select,
    true,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles

from ..clock import db_now_ms
from ..errors import sqlstate
from .base import Dialect, oldest

#: SQLSTATEs that mean "run it again": serialization failure, deadlock (C26, R96).
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
#: SQLSTATE of ``lock_timeout``: a live transaction holds the row (atomic mode, R38).
_LOCK_NOT_AVAILABLE = "55P03"
#: Put before the claim: it commits without waiting for the WAL flush (``async_claim``).
_ASYNC_PREFIX = "SET LOCAL synchronous_commit = off; "


@compiles(db_now_ms, "postgresql")
def _now_ms_postgresql(element: Any, compiler: Any, **kw: Any) -> str:
    return "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)"


#: PostgreSQL's limit on one field's value and on one protocol message: 1 GB.
_FIELD_LIMIT = 1024 * 1024 * 1024 - 1
#: What a completion's statement holds besides its body.
_STATEMENT_ROOM = 1024 * 1024


class PostgreSQL(Dialect):
    """PostgreSQL, with psycopg2 or psycopg 3."""

    def claim_statement(self, table: Table, values: dict[str, Any]) -> Any:
        return (
            postgresql.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[table.c.key_digest])
            .returning(table.c.id, table.c.expires_at_ms)
        )

    def claim_or_read_statement(self, table: Table, values: dict[str, Any]) -> Any:
        """``WITH ins AS (INSERT … SELECT … WHERE NOT EXISTS (the key) … RETURNING) SELECT
        ins.*, r.*, now FROM one LEFT JOIN ins LEFT JOIN table AS r ON r.key_digest = …``.

        The INSERT is not even attempted when the statement's snapshot already holds
        the key (a replay): no sequence value is drawn and no speculative insertion
        is checked against the unique index.
        """
        ins = _insert_unless_present(table, values).cte("ins")
        r = table.alias("r")
        one = select(literal(1).label("one")).subquery("one")
        return select(
            ins.c.id.label("claimed_id"),
            ins.c.expires_at_ms.label("claimed_expires_at_ms"),
            *r.c,
            db_now_ms().label("now_ms"),
        ).select_from(
            one.outerjoin(ins, true()).outerjoin(
                r, r.c.key_digest == bindparam("p_key_digest", type_=r.c.key_digest.type)
            )
        )

    def autocommit_pool(self, driver: str) -> bool:
        return driver in ("psycopg2", "psycopg")

    def async_claim_prefix(self, driver: str) -> str | None:
        """psycopg2 sends ``SET LOCAL`` and the claim in one simple query inside the
        transaction it opened, so it applies to the INSERT and to that COMMIT."""
        return _ASYNC_PREFIX if driver == "psycopg2" else None

    def commit_claim_asynchronously(self, conn: Connection) -> None:
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")

    @contextmanager
    def lock_wait_bounded(self, conn: Connection) -> Iterator[None]:
        """``SET LOCAL lock_timeout``, undone by the transaction's end."""
        conn.exec_driver_sql("SET LOCAL lock_timeout = '500ms'")
        yield

    def largest_body(self, ask: Callable[[Callable[[Connection], Any]], Any]) -> int | None:
        """Half of the 1 GB field and message limit less 1 MiB: psycopg2 sends ``bytea``
        as hex text in the statement, two characters a byte (psycopg 3 sends it as is)."""
        return (_FIELD_LIMIT - _STATEMENT_ROOM) // 2

    def is_retryable(self, exc: BaseException) -> bool:
        return sqlstate(exc) in _RETRYABLE_SQLSTATES

    def is_lock_unavailable(self, exc: BaseException | None) -> bool:
        return sqlstate(exc) == _LOCK_NOT_AVAILABLE

    def prune_batch(
        self,
        conn: Connection,
        table: Table,
        condition: Any,
        batch_size: int,
        from_expiry: int | None,
    ) -> tuple[int, int | None]:
        """The rows are picked with ``FOR UPDATE SKIP LOCKED``: prunes running on several
        hosts pick disjoint rows instead of queueing on each other, and a row a request
        is replacing right now is simply left for the next run. The lock re-checks the
        condition on the row's newest version, so a record renewed meanwhile is not
        deleted."""
        doomed = oldest(table, condition, batch_size).with_for_update(skip_locked=True)
        returning = (
            delete(table)
            .where(table.c.id.in_(doomed.scalar_subquery()))
            .returning(table.c.expires_at_ms)
        )
        expiries = conn.execute(returning).scalars().all()
        return len(expiries), max(expiries, default=from_expiry)


def _insert_unless_present(table: Table, values: dict[str, Any]) -> Any:
    """``INSERT … SELECT <values> WHERE NOT EXISTS (the key) ON CONFLICT DO NOTHING
    RETURNING``: a key the statement's snapshot already holds is not inserted at all;
    one committed after that snapshot still meets the unique index."""
    present = table.alias("present")
    row = select(
        *(
            (value if isinstance(value, ColumnElement) else literal(value)).label(name)
            for name, value in values.items()
        )
    ).where(~exists().where(present.c.key_digest == values["key_digest"]))
    return (
        postgresql.insert(table)
        .from_select(list(values), row)
        .on_conflict_do_nothing(index_elements=[table.c.key_digest])
        .returning(table.c.id, table.c.expires_at_ms)
    )
