"""The request path's statements on a pooled psycopg2 connection, without SQLAlchemy's
execution layer (issue 11).

CONTRACT C8, C14, C26.

A replay from PostgreSQL is one statement and a first execution two; on the
psycopg2 autocommit pool, SQLAlchemy's ``Connection`` (its checkout wrapper,
execution context, result and row machinery) cost about twice what psycopg2's own
``execute`` costs. Here the statement, compiled once to psycopg2's SQL, runs on a
cursor of a connection checked out of that same SQLAlchemy pool: the pool keeps
its checkout and return, pre-ping, recycling, its events and fork reset, and a
failure reaches the store as the very ``DBAPIError`` SQLAlchemy would have raised
(a dead connection invalidated, with the whole pool's older connections, as
SQLAlchemy does), so the store's retry and outage rules (C26) see no difference.

Used only where nothing else could observe the difference: the store's own
autocommit pool, whose engine has no ``before/after_cursor_execute`` or
``handle_error`` listeners (an app's instrumentation on every ``Engine`` keeps
the ordinary path). Every other driver and mode runs through SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

T = TypeVar("T")


class DirectStatements:
    """Run work on a cursor of a pooled DBAPI connection of ``engine`` (psycopg2, autocommit)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine  # its pool is replaced when a forked child disposes it
        self._dialect = engine.dialect
        self._error: type[Exception] = engine.dialect.loaded_dbapi.Error

    def usable(self) -> bool:
        """No listener on the engine would miss the statements run here."""
        dispatch = self._engine.dispatch
        return not (
            dispatch.before_cursor_execute
            or dispatch.after_cursor_execute
            or self._dialect.dispatch.handle_error
        )

    def compile(self, statement: Any) -> tuple[str, dict[str, Any]]:
        """The driver's SQL of ``statement`` and the values of its constant parameters."""
        compiled = statement.compile(dialect=self._dialect)
        return compiled.string, dict(compiled.params)

    def run(self, sql: str, work: Callable[[Any], T]) -> T:
        """``work(cursor)`` on one pooled connection; a driver error as SQLAlchemy raises it.

        ``sql`` is only for the error's message.
        """
        try:
            conn = self._engine.pool.connect()
        except self._error as exc:
            raise self._wrap(exc, sql, None, None) from exc
        try:
            cursor = conn.dbapi_connection.cursor()  # type: ignore[union-attr]
            try:
                return work(cursor)
            finally:
                cursor.close()
        except self._error as exc:
            raise self._wrap(exc, sql, conn, cursor) from exc
        except BaseException as exc:
            # Interrupted mid-statement (a timeout, an exit): the connection's state
            # is unknown, so it never returns to the pool as it is (as SQLAlchemy does).
            conn.invalidate(exc)
            raise
        finally:
            conn.close()  # back to the pool, or closed when invalidated

    def _wrap(self, exc: Exception, sql: str, conn: Any, cursor: Any) -> DBAPIError:
        dbapi_conn = None if conn is None else conn.dbapi_connection
        dead = bool(self._dialect.is_disconnect(exc, dbapi_conn, cursor))  # type: ignore[arg-type]
        if dead and conn is not None and conn.is_valid:
            # The server went away: every connection made before now is suspect, as
            # SQLAlchemy decides on a disconnect (``invalidate_pool_on_disconnect``).
            self._engine.pool._invalidate(conn, exc)  # invalidates ``conn`` too
        return DBAPIError.instance(  # type: ignore[return-value]
            sql,
            None,
            exc,
            self._error,
            hide_parameters=True,
            connection_invalidated=dead,
            dialect=self._dialect,
        )
