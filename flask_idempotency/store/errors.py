"""The store's errors, and what a driver error says (CONTRACT C25, C26, C45, C55, C58).

Every failure of the durable store reaches the lifecycle as :class:`StoreError` (an
outage: 503), :class:`StoreMisconfigured` (a deployment error: never failed open) or
:class:`StoreRefused` (a write refused for good, C58).
The helpers here read a driver's error the same way whichever database raised it.
"""

from __future__ import annotations

import re

from sqlalchemy.exc import DBAPIError


class StoreError(Exception):
    """The durable store could not answer; the request gets 503 (C25, C26)."""


class StoreMisconfigured(StoreError):
    """The records table is missing or does not match the code: a deployment error (C45).

    Not an outage: waiting does not fix it, and failing open for it would run
    every protected view unprotected. The message says what to run.
    """


class StoreRefused(StoreError):
    """The database refused the write for good: the statement or a value is over one of
    its limits, or a value it cannot hold (C58). Not an outage: no retry will change
    the answer, so a refused completion is never kept to be tried again."""


#: The refusals no retry changes (C58): SQLSTATE classes and codes, MySQL/MariaDB error
#: numbers. ``54``: program_limit_exceeded and kin (PostgreSQL); ``22``: data exceptions
#: (a value out of range, too long, a NUL byte in text, bad encoding).
_REFUSAL_SQLSTATE_CLASSES = frozenset({"22", "54"})
_REFUSAL_MYSQL_ERRNOS = frozenset(
    {
        1153,  # ER_NET_PACKET_TOO_LARGE: the statement is over max_allowed_packet
        1264,  # ER_WARN_DATA_OUT_OF_RANGE
        1366,  # ER_TRUNCATED_WRONG_VALUE_FOR_FIELD (a string it cannot hold)
        1406,  # ER_DATA_TOO_LONG: a value over its column's limit
    }
)


def is_refusal(exc: BaseException | None) -> bool:
    """A write the database refuses for good (C58); everything else a store error can
    be (cannot connect, connection lost, read-only, a deadline) is an outage."""
    if mysql_errno(exc) in _REFUSAL_MYSQL_ERRNOS:
        return True
    state = sqlstate(exc)
    return state is not None and state[:2] in _REFUSAL_SQLSTATE_CLASSES


#: The SQLSTATEs MySQL documents for error numbers, for drivers that report none
#: (mysqlclient; PyMySQL keeps the one the server sends only in recent releases).
_MYSQL_SQLSTATES = {1213: "40001", 1146: "42S02", 1054: "42S22", 1792: "25006"}


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


#: SQLSTATEs / messages of "no such table" and "no such column" (C45).
_SCHEMA_SQLSTATES = frozenset({"42P01", "42703", "42S02", "42S22"})
_SCHEMA_MYSQL_ERRNOS = frozenset({1146, 1054})
_SCHEMA_MESSAGES = ("no such table", "no such column", "has no column named")


def is_schema_error(exc: DBAPIError) -> bool:
    """The table or one of its columns is missing: a deployment error (C45)."""
    if sqlstate(exc) in _SCHEMA_SQLSTATES:
        return True
    if mysql_errno(exc) in _SCHEMA_MYSQL_ERRNOS:
        return True
    message = str(exc.orig).lower()
    return any(m in message for m in _SCHEMA_MESSAGES)


def schema_help(table_name: str, exc: BaseException) -> str:
    """What :class:`StoreMisconfigured` says: the table, the error, and what to run."""
    return (
        f"the table {table_name!r} is missing or does not match Flask-Idempotency"
        f" ({describe(exc)}). This is a deployment error, not an outage: run"
        " `flask db upgrade` (Flask-Migrate), or `flask idempotency create-table`,"
        " or `db.create_all()`; `flask idempotency check` compares the table"
    )


#: SQLSTATE ``read_only_sql_transaction``: the connection reached a server that takes no
#: writes (a standby, a demoted primary, ``default_transaction_read_only``; on MySQL and
#: MariaDB, error 1792, a read-only transaction).
_READ_ONLY = "25006"
#: MySQL/MariaDB ER_OPTION_PREVENTS_STATEMENT (SQLSTATE HY000): a server option refused
#: the statement. Only the read-only options (``--read-only``, ``--super-read-only``) mean
#: a demoted server; the same number names ``--secure-file-priv`` and others.
_MYSQL_OPTION_PREVENTS_STATEMENT = 1290
_MYSQL_READ_ONLY_OPTIONS = ("read-only", "read_only")


def is_read_only(exc: BaseException | None) -> bool:
    """A write refused because the server is read-only: the store is unavailable there
    (C25, C55), and the connection must not be used again (a standby stays one)."""
    if sqlstate(exc) == _READ_ONLY:
        return True
    if mysql_errno(exc) != _MYSQL_OPTION_PREVENTS_STATEMENT:
        return False
    message = str(getattr(exc, "orig", exc)).lower()
    return any(option in message for option in _MYSQL_READ_ONLY_OPTIONS)


#: The start of libpq's message for one host of a multi-host connection string.
_HOST_FAILURE = ("connection to server at ", "connection to server on socket ")
#: psycopg 3's line for one host it tried: ``- host: 'h', port: 'p', hostaddr: 'a':
#: connection failed: <libpq's message>``; what follows the prefix is libpq's own.
_PSYCOPG_ATTEMPT = re.compile(r"^- host: .*?: connection failed: ")


def describe(exc: BaseException) -> str:
    """A driver error in one line: its type and the first line of its message, or, when
    a multi-host connection string failed, every host's error in the order they were
    tried (libpq writes one line per host; psycopg 3 lists them after
    ``All failures were:``).

    Nothing else of a multi-line message is kept: libpq's hints (indented lines) add
    nothing to a log line, and a server's ``DETAIL`` may quote the values of a row.
    """
    orig = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(orig).strip().splitlines() if line.strip()]
    if not lines:
        return type(orig).__name__
    # psycopg 3 lists each host it tried, in order (its first line repeats the last one).
    attempts = [_PSYCOPG_ATTEMPT.sub("", line) for line in lines if _PSYCOPG_ATTEMPT.match(line)]
    if attempts:
        parts = list(dict.fromkeys(attempts))
    else:
        parts = [lines[0]]
        parts += [line for line in lines[1:] if line.startswith(_HOST_FAILURE)]
    return f"{type(orig).__name__}: {'; '.join(dict.fromkeys(parts))}"
