"""The direct path: the request path's statements on a pooled psycopg2 or psycopg 3
connection, without SQLAlchemy's execution layer (issues 11, 21), and when it is taken.

CONTRACT C8, C14, C26.

How a statement is sent is :mod:`flask_idempotency._wire.psycopg2` (psycopg2's own
quoting, ``PREPARE``/``EXECUTE`` written by hand) or :mod:`flask_idempotency._wire.psycopg`
(psycopg 3's own cursor, binding and preparation), both on the pool checkout of
:mod:`flask_idempotency._wire.sqla_pool`. Here is the switch:

* Used only where nothing else could observe the difference: the store's own
  autocommit pool (PostgreSQL with either driver), whose engine has no
  ``before/after_cursor_execute`` or ``handle_error`` listeners (an app's
  instrumentation on every ``Engine`` keeps the ordinary path, :meth:`usable`).
  Every other driver and mode runs through SQLAlchemy.
* The statements are prepared on the server once per pooled connection, until a
  transaction pooler shows: then every statement is sent plain, for good (:meth:`run`).
  psycopg 3's are prepared only on a connection seen to reach PostgreSQL itself
  (:meth:`DirectStatements.fetchone`).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from .._wire import psycopg as wire_psycopg
from .._wire import psycopg2 as wire_psycopg2
from .._wire.sqla_pool import PooledCursors, no_listeners, sqlstate
from ..records import RECORD_COLUMNS
from .dialects import of

T = TypeVar("T")

#: A statement compiled for the direct path of either driver.
DirectSQL = wire_psycopg2.DirectSQL | wire_psycopg.PsycopgSQL

log = logging.getLogger("flask_idempotency")

#: Set in a pooled connection's ``info`` once it was seen to reach PostgreSQL itself.
_NO_POOLER = "flask_idempotency.no_pooler"
#: "prepared statement does not exist" / "already exists": the statements of one
#: pooled connection are not on one server connection (a transaction pooler between).
_NOT_ONE_SERVER_CONNECTION = frozenset({"26000", "42P05"})


def supported(engine: Engine) -> bool:
    """Whether the direct path can run on ``engine``'s driver."""
    driver = engine.dialect.driver
    return driver == "psycopg2" or (driver == "psycopg" and wire_psycopg.USABLE)


class DirectStatements:
    """Run work on a cursor of a pooled DBAPI connection of ``engine`` (psycopg2 or
    psycopg 3, autocommit; :func:`supported`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine  # its pool is replaced when a forked child disposes it
        self._dialect = engine.dialect
        self._psycopg3 = engine.dialect.driver == "psycopg"
        self._fetchone = wire_psycopg.fetchone if self._psycopg3 else wire_psycopg2.fetchone
        self._cursors = PooledCursors(engine)
        # psycopg 3 sends the asynchronous claim as one simple query (its ClientCursor),
        # as psycopg2 does: the prefix is the one for a driver that can.
        sender = "psycopg2" if self._psycopg3 else self._dialect.driver
        prefix = of(engine).async_claim_prefix(sender)
        #: Put before the claim for ``IDEMPOTENCY_ASYNC_CLAIM`` (see :mod:`.dialects`).
        self.async_claim_prefix = "" if prefix is None else prefix
        #: Prepare statements on the server; off for good once a pooler is seen. psycopg 3
        #: names them by a counter of each connection (``_pg3_0``…): behind a transaction
        #: pooler such a name can reach a server connection where another client prepared
        #: *its* statement under it, which would run in place of ours, silently when the
        #: parameter types agree (another app's claim, in another table). So a psycopg 3
        #: connection is checked before its first prepared statement. psycopg2's are named
        #: by a hash of their text: one name, one statement, wherever it lands.
        self.prepare = True

    def usable(self) -> bool:
        """No listener on the engine would miss the statements run here."""
        return no_listeners(self._engine)

    def compile(
        self,
        statement: Any,
        record_values: Callable[[Any], Any] | None = None,
        prefix: str = "",
        body_at: int | None = None,
    ) -> DirectSQL:
        """``statement`` compiled for the direct path (``prefix``: SQL run before it;
        ``body_at``: the result column of a stored body)."""
        compiled = statement.compile(dialect=self._dialect)
        if self._psycopg3:
            return wire_psycopg.PsycopgSQL(compiled, record_values, prefix, body_at)
        return wire_psycopg2.DirectSQL(compiled, self._dialect, record_values, prefix, body_at)

    def compile_for_store(self, statement: Any, prefix: str = "") -> DirectSQL:
        """:meth:`compile`, told where the statement's result holds a record's columns
        and its stored body (statements that read a record)."""
        names = [c.key for c in statement.exported_columns]
        at = [names.index(column) for column in RECORD_COLUMNS if column in names]
        getter = operator.itemgetter(*at) if len(at) == len(RECORD_COLUMNS) else None
        body_at = names.index("response_body") if "response_body" in names else None
        return self.compile(statement, getter, prefix, body_at)

    def fetchone(
        self, cursor: Any, info: dict[str, Any], statement: DirectSQL, params: dict[str, Any]
    ) -> Any:
        """Run ``statement`` on ``cursor`` (in :meth:`run`'s ``work``, with its connection's
        ``info``); its first row. Prepared on the server unless a pooler was seen."""
        if self._psycopg3 and self.prepare and _NO_POOLER not in info:  # (see prepare)
            if wire_psycopg.behind_pooler(cursor):
                self._stop_preparing()
            else:
                info[_NO_POOLER] = True
        return self._fetchone(cursor, info, statement, params, self.prepare)  # type: ignore[arg-type]

    def _stop_preparing(self) -> None:
        if self.prepare:
            self.prepare = False
            log.info("idempotency: a connection pooler is in use; statements are not prepared")

    def run(self, sql: str, work: Callable[[Any, dict[str, Any]], T]) -> T:
        """``work(cursor, info)`` on one pooled connection (``info``: the pool's dictionary
        for that connection); a driver error as SQLAlchemy raises it.

        ``sql`` is only for the error's message.
        """
        try:
            return self._cursors.run(sql, work)
        except DBAPIError as exc:
            if sqlstate(exc.orig) not in _NOT_ONE_SERVER_CONNECTION:
                raise  # those two only ever come from our PREPARE or EXECUTE
        # The statement did not run: its connection's prepared statements are not on
        # the server connection it reached (PgBouncer in transaction mode).
        self._stop_preparing()
        return self._cursors.run(sql, work)
