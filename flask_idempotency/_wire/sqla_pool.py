"""Statements run on a pooled DBAPI connection of SQLAlchemy's pool, without its checkout
proxy and execution layer: what the direct paths of both PostgreSQL drivers share
(:mod:`.psycopg2`, :mod:`.psycopg`; issues 11 and 21).

CONTRACT C8, C14, C26.

Private SQLAlchemy APIs this module touches (each a place a release can break;
:data:`_POOL_ENTRY_API` checks the pool methods' signatures once, at import, and a
mismatch makes every statement take the ordinary public ``pool.connect()`` checkout):

  * ``QueuePool._do_get()``: take a pool entry without the checked-out proxy.
  * ``sqlalchemy.pool.base._ConnectionRecord`` (the entry): ``get_connection()``,
    ``checkin(_fairy_was_created=False)``, ``_checkin_failed(err, _fairy_was_created=False)``,
    ``invalidate(exc)``, ``info``, ``dbapi_connection``.
  * ``Pool._invalidate(entry, exc, _checkin=False)``: every older connection of the
    pool is suspect after a disconnect, as SQLAlchemy decides
    (``invalidate_pool_on_disconnect``).
  * ``Pool._pre_ping``; ``pool.dispatch.checkout`` / ``.checkin`` / ``.reset``,
    ``engine.dispatch.before_cursor_execute`` / ``.after_cursor_execute`` and
    ``dialect.dispatch.handle_error``: whether anything listens (then the ordinary
    path runs).
  * ``DBAPIError.instance(sql, None, exc, error, hide_parameters=, connection_invalidated=,
    dialect=)``: a driver error wrapped exactly as SQLAlchemy wraps it;
    ``dialect.is_disconnect(exc, connection, cursor)``; ``dialect.loaded_dbapi``.

Tested with SQLAlchemy 2.0.0 and the newest release (2.1.9); the pool entry methods
have been the same since 2.0.0.

Nothing here is written on the wire (no bytes to compare with a library's): the checkout
is tested against SQLAlchemy's own in ``tests/test_store_direct.py`` (the ordinary
``pool.connect()`` checkout when the entry API differs, pool listeners, pre-ping, dead
connections invalidated, every connection returned).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import QueuePool

T = TypeVar("T")

#: The key of the set of statements prepared on a pooled connection, in the pool's
#: per-connection ``info`` (emptied by SQLAlchemy when the connection is replaced).
_PREPARED = "flask_idempotency.prepared"
#: "cached plan must not change result type": the table changed under a prepared statement.
_REPLANNED_RESULT = "0A000"
#: The key of a pooled connection's cursor, kept in its ``info`` for the next statement.
_CURSOR = "flask_idempotency.cursor"
#: A result with a value larger than this is not kept alive by a kept cursor.
_KEPT_RESULT_BYTES = 64 * 1024


def sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of a driver error: ``pgcode`` (psycopg2), ``sqlstate`` (psycopg 3)."""
    return getattr(exc, "pgcode", None) or getattr(exc, "sqlstate", None)


def _pool_entry_api() -> bool:
    """Whether this SQLAlchemy's pool has the entry methods the lean checkout calls, with the
    arguments it passes (private API: a release that changes them gets the ordinary checkout)."""
    try:
        from sqlalchemy.pool.base import Pool, _ConnectionRecord

        wanted = (
            (QueuePool._do_get, ()),
            (_ConnectionRecord.get_connection, ()),
            (_ConnectionRecord.checkin, ("_fairy_was_created",)),
            (_ConnectionRecord._checkin_failed, ("err", "_fairy_was_created")),
            (_ConnectionRecord.invalidate, ()),
            (Pool._invalidate, ("_checkin",)),
        )
        return all(
            set(names) <= set(inspect.signature(method).parameters) for method, names in wanted
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


#: Checked once, at import.
_POOL_ENTRY_API = _pool_entry_api()


def no_listeners(engine: Engine) -> bool:
    """Nothing listens to the statements ``engine`` runs (``before/after_cursor_execute``,
    ``handle_error``): none would miss the statements run here."""
    dispatch = engine.dispatch
    return not (
        dispatch.before_cursor_execute
        or dispatch.after_cursor_execute
        or engine.dialect.dispatch.handle_error
    )


class PooledCursors:
    """Cursors of ``engine``'s pooled DBAPI connections (psycopg2 or psycopg 3, autocommit),
    one kept per connection, with failures raised as SQLAlchemy raises them."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine  # its pool is replaced when a forked child disposes it
        self._dialect = engine.dialect
        self._error: type[Exception] = engine.dialect.loaded_dbapi.Error

    def run(self, sql: str, work: Callable[[Any, dict[str, Any]], T]) -> T:
        """``work(cursor, info)`` on one pooled connection (``info``: the pool's dictionary
        for that connection); a driver error as SQLAlchemy raises it.

        ``sql`` is only for the error's message.
        """
        pool = self._engine.pool  # read each time: a forked child's engine has a new one
        lean = self._lean(pool)
        try:
            if lean:
                entry: Any = pool._do_get()
                try:
                    dbapi_connection = entry.get_connection()  # reconnects a stale one
                except BaseException as exc:
                    entry._checkin_failed(exc, _fairy_was_created=False)
                    raise
            else:
                entry = pool.connect()
                dbapi_connection = entry.dbapi_connection
        except self._error as exc:
            raise self._wrap(exc, sql, None, None) from exc
        info = entry.info
        cursor = None  # making it can fail too (a connection closed on the client side)
        try:
            # One cursor per pooled connection, kept for its next statement: making and
            # closing one per statement cost about 5 µs (issue 11). A reconnected entry
            # starts with an empty ``info``, so a cursor never outlives its connection.
            cursor = info.get(_CURSOR)
            if cursor is None:
                cursor = info[_CURSOR] = dbapi_connection.cursor()
            return work(cursor, info)
        except self._error as exc:
            info.pop(_CURSOR, None)  # after a failure, the next statement gets a new one
            wrapped = self._wrap(exc, sql, entry, cursor)
            if entry.dbapi_connection is not None and _PREPARED in info:
                # Which statements the server kept for this connection is unknown now:
                # start afresh on a new connection.
                entry.invalidate(exc)
                if sqlstate(exc) == _REPLANNED_RESULT:
                    wrapped.connection_invalidated = True  # a fresh connection will do: retried
            raise wrapped from exc
        except BaseException as exc:
            # Interrupted mid-statement (a timeout, an exit): the connection's state
            # is unknown, so it never returns to the pool as it is (as SQLAlchemy does).
            info.pop(_CURSOR, None)
            entry.invalidate(exc)
            raise
        finally:
            # Back to the pool (reconnected on its next use when invalidated).
            if lean:
                entry.checkin(_fairy_was_created=False)
            else:
                entry.close()

    @staticmethod
    def _lean(pool: Any) -> bool:
        """Whether a statement may take its connection's pool entry directly, without the
        proxy object SQLAlchemy wraps around a checked-out connection.

        The proxy's checkout and return cost more CPU than the statement's own work
        in psycopg2 (issue 11); what they add is needed only for a pre-ping, for
        checkout, checkin or reset listeners, and for the rollback on return, which
        in this pool's autocommit mode has no transaction to end. The entry itself
        still reconnects a recycled, invalidated or dead connection, and the pool
        keeps its size, overflow and timeout. Any other pool class takes the
        ordinary checkout. (``_do_get``, ``get_connection``, ``checkin`` and
        ``_checkin_failed`` are what the proxy itself calls, the same since SQLAlchemy 2.0.0.)
        """
        if not _POOL_ENTRY_API or type(pool) is not QueuePool or pool._pre_ping:
            return False
        dispatch = pool.dispatch
        return not (dispatch.checkout or dispatch.checkin or dispatch.reset)

    def _wrap(self, exc: Exception, sql: str, entry: Any, cursor: Any) -> DBAPIError:
        """``exc`` as SQLAlchemy raises it; ``entry``: the connection it came from (a pool
        entry or a checked-out connection), or ``None``."""
        dbapi_conn = None if entry is None else entry.dbapi_connection
        dead = bool(self._dialect.is_disconnect(exc, dbapi_conn, cursor))  # type: ignore[arg-type]
        if dead and dbapi_conn is not None:
            # The server went away: every connection made before now is suspect, as
            # SQLAlchemy decides on a disconnect (``invalidate_pool_on_disconnect``).
            self._engine.pool._invalidate(entry, exc, _checkin=False)
            entry.invalidate(exc)
        return DBAPIError.instance(  # type: ignore[return-value]
            sql,
            None,
            exc,
            self._error,
            hide_parameters=True,
            connection_invalidated=dead,
            dialect=self._dialect,
        )
