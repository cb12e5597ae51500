"""MySQL and MariaDB: no ``ON CONFLICT``, no ``UPDATE … RETURNING``, error numbers.

The claim is ``INSERT … ON DUPLICATE KEY UPDATE id = id`` (a no-op on the duplicate,
which stays untouched) followed, in the same transaction, by the ``SELECT`` the
store makes anyway; the row carries the claimer's lock token, so the winner
recognises its own row. The unique index still lets exactly one of any number of
inserters win, at READ COMMITTED and at REPEATABLE READ: InnoDB takes the read view
of a transaction at its first plain read, which comes after the INSERT has waited
for any competitor's commit. Without ``UPDATE … RETURNING`` the store checks the
matched-row count (SQLAlchemy connects with ``CLIENT_FOUND_ROWS``) and reads the
row it now holds locked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Table, delete, select
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles

from ..clock import db_now_ms
from ..errors import mysql_errno
from .base import Dialect

#: MySQL-family dialect names as SQLAlchemy reports them.
MYSQL_FAMILY = frozenset({"mysql", "mariadb"})
#: MySQL/MariaDB error numbers: deadlock, and "record has changed since last read"
#: (MariaDB's snapshot-isolation conflict); both roll the transaction back.
_MYSQL_RETRYABLE = frozenset({1213, 1020})
#: MySQL/MariaDB ``innodb_lock_wait_timeout`` expired.
_MYSQL_LOCK_WAIT_TIMEOUT = 1205


@compiles(db_now_ms, "mysql")
@compiles(db_now_ms, "mariadb")
def _now_ms_mysql(element: Any, compiler: Any, **kw: Any) -> str:
    # The statement's start in UTC, counted from the epoch as plain DATETIME arithmetic.
    # Not UNIX_TIMESTAMP(NOW(3)): that goes through the session's time zone, and with
    # time_zone=SYSTEM in a zone with daylight saving the repeated autumn hour maps to
    # its later instant, an hour ahead, which made every live lease look expired (C52).
    return (
        "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000"
        " AS SIGNED)"
    )


#: What a completion's statement holds besides its body (headers, SQL, the other values).
_STATEMENT_ROOM = 64 * 1024


class MySQL(Dialect):
    """MySQL 8 and MariaDB, with PyMySQL or mysqlclient."""

    returns_from_update = False

    def claim_statement(self, table: Table, values: dict[str, Any]) -> Any:
        # Not INSERT IGNORE: IGNORE also turns data errors into warnings.
        stmt = mysql.insert(table).values(**values)
        return stmt.on_duplicate_key_update(id=table.c.id)

    @contextmanager
    def lock_wait_bounded(self, conn: Connection) -> Iterator[None]:
        """``innodb_lock_wait_timeout`` (whole seconds) has no transaction scope, so the
        session value is set and put back before the connection returns to the pool."""
        conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
        try:
            yield
        finally:
            try:
                conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = DEFAULT")
            except Exception:  # a dead connection is discarded by the pool anyway
                pass

    def largest_body(self, ask: Callable[[Callable[[Connection], Any]], Any]) -> int | None:
        """Half of ``@@max_allowed_packet`` less 64 KiB for the rest of the statement: a
        binary value is sent escaped, each byte as one or two (the worst case counts)."""
        packet = ask(lambda conn: conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar())
        return None if packet is None else max(0, (int(packet) - _STATEMENT_ROOM) // 2)

    def is_retryable(self, exc: BaseException) -> bool:
        errno = mysql_errno(exc)
        return errno in _MYSQL_RETRYABLE or errno == _MYSQL_LOCK_WAIT_TIMEOUT

    def is_lock_unavailable(self, exc: BaseException | None) -> bool:
        return mysql_errno(exc) == _MYSQL_LOCK_WAIT_TIMEOUT

    def prune_batch(
        self,
        conn: Connection,
        table: Table,
        condition: Any,
        batch_size: int,
        from_expiry: int | None,
    ) -> tuple[int, int | None]:
        """No ``LIMIT`` in an ``IN`` subquery, no ``DELETE … RETURNING``.

        The batch's rows are picked and locked with ``FOR UPDATE SKIP LOCKED`` (rows
        a request or another prune holds are left for the next run), then deleted
        by primary key with the condition checked again, in one short transaction.
        """
        t = table
        picked = conn.execute(
            select(t.c.id, t.c.expires_at_ms)
            .where(condition)
            .order_by(t.c.expires_at_ms)
            .limit(batch_size)
            .with_for_update(skip_locked=True)
        ).all()
        if not picked:
            return 0, None
        ids = [row.id for row in picked]
        deleted = conn.execute(delete(t).where(t.c.id.in_(ids), condition)).rowcount
        return int(deleted), max(row.expires_at_ms for row in picked)
