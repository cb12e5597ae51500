"""What differs between the databases the store speaks, in one place.

CONTRACT C8, C13, C14, C26, C42.

The store's statements are the same everywhere except for three things:

* The claim. PostgreSQL and SQLite have ``INSERT … ON CONFLICT DO NOTHING
  RETURNING``: the winner learns it from the returned row. MySQL and MariaDB have
  neither ``ON CONFLICT`` nor (MySQL 8) ``RETURNING``: the claim is ``INSERT … ON
  DUPLICATE KEY UPDATE id = id`` (a no-op on the duplicate, which stays untouched)
  followed, in the same transaction, by the ``SELECT`` the store makes anyway; the
  row carries the claimer's lock token, so the winner recognises its own row. The
  unique index still lets exactly one of any number of inserters win, at READ
  COMMITTED and at REPEATABLE READ: InnoDB takes the read view of a transaction
  at its first plain read, which comes after the INSERT has waited for any
  competitor's commit.
* ``UPDATE … RETURNING``: MySQL and MariaDB have none; the store checks the
  matched-row count (SQLAlchemy connects with ``CLIENT_FOUND_ROWS``) and reads the
  row it now holds locked.
* Which errors mean "run it again" (C26) and "a live transaction holds the row".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, exists, literal, select
from sqlalchemy.dialects import mysql, postgresql, sqlite

#: SQLSTATEs that mean "run it again": serialization failure, deadlock (C26, R96).
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
#: SQLSTATE of ``lock_timeout``: a live transaction holds the row (atomic mode, R38).
_LOCK_NOT_AVAILABLE = "55P03"
#: MySQL/MariaDB error numbers: deadlock, and "record has changed since last read"
#: (MariaDB's snapshot-isolation conflict); both roll the transaction back.
_MYSQL_RETRYABLE = frozenset({1213, 1020})
#: MySQL/MariaDB ``innodb_lock_wait_timeout`` expired.
_MYSQL_LOCK_WAIT_TIMEOUT = 1205
#: MySQL-family dialect names as SQLAlchemy reports them.
MYSQL_FAMILY = frozenset({"mysql", "mariadb"})


#: The SQLSTATEs MySQL documents for error numbers whose drivers report no SQLSTATE.
_MYSQL_SQLSTATES = {1213: "40001", 1146: "42S02", 1054: "42S22"}


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of a driver error; for PyMySQL/mysqlclient, the one MySQL documents
    for its error number (a deadlock is ``40001`` there, as on PostgreSQL)."""
    orig = getattr(exc, "orig", exc)
    state = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    if state is None:
        errno = mysql_errno(exc)
        state = None if errno is None else _MYSQL_SQLSTATES.get(errno)
    return state


def mysql_errno(exc: BaseException | None) -> int | None:
    """The server's error number of a PyMySQL or mysqlclient error."""
    orig = getattr(exc, "orig", exc)
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def is_retryable(exc: BaseException) -> bool:
    """A serialization failure, deadlock or lock-wait timeout: the statement may succeed
    when run again in a fresh transaction (C26)."""
    if sqlstate(exc) in _RETRYABLE_SQLSTATES:
        return True
    errno = mysql_errno(exc)
    return errno in _MYSQL_RETRYABLE or errno == _MYSQL_LOCK_WAIT_TIMEOUT


def is_lock_unavailable(exc: BaseException | None) -> bool:
    """The guarded statement gave up waiting for another transaction's row lock."""
    return sqlstate(exc) == _LOCK_NOT_AVAILABLE or mysql_errno(exc) == _MYSQL_LOCK_WAIT_TIMEOUT


def returns_from_update(name: str) -> bool:
    """Whether ``UPDATE … RETURNING`` exists (not on MySQL, not on MariaDB)."""
    return name not in MYSQL_FAMILY


def insert_or_nothing(name: str, table: Table, values: dict[str, Any]) -> Any:
    """An INSERT that does nothing when the key is taken; with ``RETURNING`` where it exists."""
    if name == "postgresql":
        return (
            postgresql.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[table.c.key_digest])
            .returning(table.c.id, table.c.expires_at_ms)
        )
    if name == "sqlite":
        return (
            sqlite.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=[table.c.key_digest])
            .returning(table.c.id, table.c.expires_at_ms)
        )
    if name in MYSQL_FAMILY:
        # Not INSERT IGNORE: IGNORE also turns data errors into warnings.
        stmt = mysql.insert(table).values(**values)
        return stmt.on_duplicate_key_update(id=table.c.id)
    raise ValueError(f"the {name} dialect is not supported (PostgreSQL, MySQL/MariaDB or SQLite)")


def insert_unless_present(table: Table, values: dict[str, Any]) -> Any:
    """PostgreSQL: ``INSERT … SELECT <values> WHERE NOT EXISTS (the key) ON CONFLICT DO
    NOTHING RETURNING``: a key the statement's snapshot already holds is not inserted at
    all; one committed after that snapshot still meets the unique index."""
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


@contextmanager
def lock_wait_bounded(conn: Connection) -> Iterator[None]:
    """Let the transaction's statements wait at most a moment for another's row lock.

    PostgreSQL: ``SET LOCAL lock_timeout``, undone by the transaction's end.
    MySQL/MariaDB: ``innodb_lock_wait_timeout`` (whole seconds) has no transaction
    scope, so the session value is set and put back before the connection returns
    to the pool.
    """
    name = conn.dialect.name
    if name == "postgresql":
        conn.exec_driver_sql("SET LOCAL lock_timeout = '500ms'")
        yield
    elif name in MYSQL_FAMILY:
        conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = 1")
        try:
            yield
        finally:
            try:
                conn.exec_driver_sql("SET SESSION innodb_lock_wait_timeout = DEFAULT")
            except Exception:  # a dead connection is discarded by the pool anyway
                pass
    else:
        yield
