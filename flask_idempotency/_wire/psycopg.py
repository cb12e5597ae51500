"""The request path's statements on a pooled psycopg 3 connection, by psycopg's own means
(issue 21).

CONTRACT C8, C14, C26, C51.

What the library does, and nothing is written by hand: the statement, compiled once by
SQLAlchemy, is run by psycopg's own cursor with its values as parameters
(extended protocol, server-side binding), prepared on the server by psycopg itself
(``execute(..., prepare=True)``: its per-connection cache names and keeps them) on a
connection that reaches PostgreSQL itself, never behind a transaction pooler
(:func:`behind_pooler`: psycopg's names are a counter of each connection, ``_pg3_0``…,
so there such a name could reach a server connection where another client prepared
*its* statement under it), with
results in binary (``binary=True``: a stored body comes back as its bytes, not as
hex text to decode). ``IDEMPOTENCY_ASYNC_CLAIM``'s ``SET LOCAL`` and the claim go as
one simple query through psycopg's :class:`~psycopg.ClientCursor` (client-side
binding, psycopg's own quoting). The pool checkout is :mod:`.sqla_pool`'s.

Private psycopg APIs this module touches: none. Public ones it relies on, checked once
at import (:data:`USABLE`; without them the store keeps SQLAlchemy's ordinary path):
``Cursor.execute(query, params, prepare=, binary=)``, ``Connection.prepare_threshold``
(``None`` switches every preparation off, even ``prepare=True``: the store's engines
set it for PgBouncer, so a connection of the request path's pool gets a threshold no
statement reaches, and only ``prepare=True`` prepares), ``ClientCursor``,
``Cursor.nextset()``, ``Error.sqlstate``, ``Connection.pipeline()`` and
``Pipeline.is_supported()`` (a statement's first run on a connection sends psycopg's
Parse with its Bind/Execute in one round trip), ``ConnectionInfo.backend_pid``.

The one thing not left to psycopg is the statement text's encoding: once, as UTF-8
bytes (so the store keeps a table name that is not ASCII off the direct path). The
differential test, ``tests/test_wire_differential.py`` (issue 21 item 3): fuzzed values
run plain, prepared, pipelined and prefixed give what psycopg's own cursors give, in
every client encoding and ``standard_conforming_strings`` setting.

Tested with psycopg 3.1.8 and the newest release (3.3.9 when this was written),
SQLAlchemy 2.0.0 and 2.1.9.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from typing import Any

from .compiled import PLACEHOLDER, CompiledSQL
from .sqla_pool import _PREPARED

#: The key of a pooled connection's client-side-binding cursor (the asynchronous claim).
_CLIENT_CURSOR = "flask_idempotency.client_cursor"
#: A connection's ``prepare_threshold`` on the request path's pool: a count no statement
#: reaches, so psycopg prepares exactly the statements run with ``prepare=True``.
_ONLY_WHEN_ASKED = 2**31 - 1


def _execute_api() -> bool:
    try:
        import psycopg

        wanted = {"prepare", "binary"}
        return (
            wanted <= set(inspect.signature(psycopg.Cursor.execute).parameters)
            and hasattr(psycopg.Connection, "prepare_threshold")
            and hasattr(psycopg, "ClientCursor")
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


#: Checked once, at import: whether this psycopg has what this module uses.
USABLE = _execute_api()


def _pipeline() -> bool:
    try:
        import psycopg

        return bool(psycopg.Pipeline.is_supported())
    except (ImportError, AttributeError):
        return False


#: Whether this psycopg's libpq has pipeline mode (libpq 14+; the binary wheels have it).
_PIPELINE = USABLE and _pipeline()


class PsycopgSQL(CompiledSQL):
    """A statement compiled once for psycopg: its text with positional placeholders, its
    values taken in that order (a statement's own constants included)."""

    __slots__ = ("_values", "prefixed", "query")

    def __init__(
        self,
        compiled: Any,
        record_values: Callable[[Any], Any] | None,
        prefix: str,
        body_at: int | None = None,
    ) -> None:
        super().__init__(compiled, record_values, prefix, body_at)
        names = self.names
        positional = PLACEHOLDER.sub("%s", compiled.string)
        #: The query psycopg runs (bytes: nothing to encode per run).
        self.query = positional.encode()
        #: The asynchronous claim: the setting and the statement in one simple query.
        self.prefixed = (prefix.replace("%", "%%") + positional).encode() if prefix else None
        getter = operator.itemgetter(*names) if names else (lambda params: ())
        self._values: Callable[[dict[str, Any]], Any] = (
            getter if len(names) > 1 else (lambda params: (getter(params),) if names else ())
        )

    def values(self, params: dict[str, Any]) -> Any:
        """The statement's values, in placeholder order, for a run with ``params``."""
        return self._values(self.with_constants(params))


def behind_pooler(cursor: Any) -> bool:
    """Whether ``cursor``'s connection reaches PostgreSQL through a pooler (one more round
    trip, once per pooled connection, before its first prepared statement).

    A pooler that shares server connections between clients must route a client's
    cancel request itself, so it hands each client a backend key of its own (PgBouncer,
    Odyssey, PgCat do): the process id the connection was given at its start is then
    not the one of the server process that runs its statements.
    """
    cursor.execute("SELECT pg_backend_pid()", prepare=False)
    row = cursor.fetchone()
    return row is None or row[0] != cursor.connection.info.backend_pid


def fetchone(
    cursor: Any, info: dict[str, Any], statement: PsycopgSQL, params: dict[str, Any], prepare: bool
) -> Any:
    """Run ``statement`` on ``cursor`` (with its pooled connection's ``info``); its first row.

    ``prepare``: prepared on the server by psycopg (once per connection, then each run is
    a Bind/Execute of the prepared statement), unless a transaction pooler was seen.
    """
    values = statement.values(params)
    if statement.prefixed is not None:
        client = info.get(_CLIENT_CURSOR)
        if client is None:
            import psycopg

            client = info[_CLIENT_CURSOR] = psycopg.ClientCursor(cursor.connection)
        client.execute(statement.prefixed, values)
        client.nextset()  # past the SET's empty result
        return client.fetchone()
    if not prepare:
        cursor.execute(statement.query, values, prepare=False, binary=True)
        row = cursor.fetchone()
    else:
        prepared = info.get(_PREPARED)
        if prepared is None:
            # The mark also tells the pool checkout to replace the connection after a
            # failure (which statements the server kept is unknown then).
            prepared = info[_PREPARED] = set()
            cursor.connection.prepare_threshold = _ONLY_WHEN_ASKED
        if statement.query in prepared or not _PIPELINE:
            cursor.execute(statement.query, values, prepare=True, binary=True)
            row = cursor.fetchone()
        else:
            # First use on this connection: psycopg's Parse and the Bind/Execute in one
            # round trip (outside a pipeline the Parse waits for its own answer).
            with cursor.connection.pipeline():
                cursor.execute(statement.query, values, prepare=True, binary=True)
                row = cursor.fetchone()
            prepared.add(statement.query)
    statement.let_go_of_big_body(info, row)
    return row
