"""Statements written and sent on a pooled psycopg2 connection by hand (issue 11).

CONTRACT C8, C14, C26.

Private library APIs this module touches (the pool checkout it runs on is
:mod:`.sqla_pool`'s, with the private SQLAlchemy pool APIs listed there):

SQLAlchemy
  * Compiled statements: ``compiled.string``, ``compiled.binds[name].required`` / ``.type``,
    ``compiled.params``; ``dialect.type_compiler_instance.process(type)``.

psycopg2 (public API, relied on for exact behaviour)
  * ``cursor.mogrify("%s", (value,))`` writes a literal exactly as ``execute`` would
    for that connection (its encoding, ``standard_conforming_strings``);
    ``_literal`` must give the same bytes. The differential tests are
    ``tests/test_wire_differential.py`` (issue 21 item 3): ``_literal`` and every
    statement's ``executed``/``plain`` against ``mogrify`` for fuzzed values, in every
    client encoding and ``standard_conforming_strings`` setting, and a server round trip.
  * A statement run without parameters is sent as it is (``%%`` is not unescaped);
    several statements in one ``execute`` go as one simple query; a negative integer
    is written with a space before its sign; ``Error.pgcode`` is the SQLSTATE.

Tested with the versions the project's test matrix installs (``noxfile.py``):
SQLAlchemy 2.0.0 and the newest release (2.1.9 when this module was written),
psycopg2 2.9.5 and the newest (2.9.13). The pool entry methods have been the same
since SQLAlchemy 2.0.0.

What it is for: a replay from PostgreSQL is one statement and a first execution two; on
the psycopg2 autocommit pool, SQLAlchemy's ``Connection`` (its checkout wrapper,
execution context, result and row machinery) cost about twice what psycopg2's own
``execute`` costs. Here the statement, compiled once to psycopg2's SQL, runs on a
cursor of a connection checked out of that same SQLAlchemy pool: the pool keeps
its checkout and return, pre-ping, recycling, its events and fork reset, and a
failure reaches the store as the very ``DBAPIError`` SQLAlchemy would have raised
(a dead connection invalidated, with the whole pool's older connections, as
SQLAlchemy does), so the store's retry and outage rules (C26) see no difference.
When the store uses it, and what falls back, is
:class:`flask_idempotency.store.direct.DirectStatements`.
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

from .sqla_pool import _CURSOR, _KEPT_RESULT_BYTES, _PREPARED

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class DirectSQL:
    """A statement compiled once for the direct path.

    ``sql`` is the statement as SQLAlchemy would run it (error messages name it). It
    runs as :meth:`plain`, or as a server-side prepared statement: ``prepare`` (once
    per pooled connection), then :meth:`executed`, named by a hash of its text so
    that a name always means this very statement. Its own constant values are
    written in once; ``arguments`` names the values each run passes.
    ``record_values``: a row's values in
    :data:`~flask_idempotency.records.RECORD_COLUMNS` order (statements that read a record);
    ``body_at``: where a row holds a stored body, if it does.
    """

    __slots__ = (
        "_execute",
        "_plain",
        "arguments",
        "body_at",
        "name",
        "prepare",
        "record_values",
        "sql",
    )

    def __init__(
        self,
        compiled: Any,
        dialect: Any,
        record_values: Callable[[Any], Any] | None,
        prefix: str,
        body_at: int | None = None,
    ) -> None:
        sql: str = compiled.string
        self.sql = prefix + sql
        self.record_values = record_values
        self.body_at = body_at
        names: list[str] = []
        for name in _PLACEHOLDER.findall(sql):
            if name not in names:
                names.append(name)
        types = ", ".join(
            dialect.type_compiler_instance.process(compiled.binds[name].type) for name in names
        )
        numbered = _PLACEHOLDER.sub(lambda m: f"${names.index(m.group(1)) + 1}", sql)
        digest = hashlib.sha256(f"{types}|{numbered}".encode()).hexdigest()[:24]
        self.name = f"flask_idempotency_{digest}"
        # Run without parameters, the driver leaves the text as it is: ``%%`` is ``%``.
        self.prepare = f"PREPARE {self.name} ({types}) AS {numbered}".replace("%%", "%").encode()
        # The texts to run, as %-templates: a slot for each value a run passes, and the
        # statement's own constants (SQLAlchemy's literal parameters) written in.
        constants: dict[str, str] = {}
        kinds: dict[str, type] = {}
        for name in names:
            given = compiled.binds[name].required  # a bindparam() without a value
            literal = None if given else _plain_literal(compiled.params[name])
            if literal is None:
                kinds[name] = _python_type(compiled.binds[name].type)
            else:
                constants[name] = literal.decode().replace("%", "%%")
        #: The names of the values each run passes, in the order :meth:`executed` wants.
        self.arguments = tuple(name for name in names if name not in constants)
        escaped_prefix = prefix.replace("%", "%%")
        parts = _PLACEHOLDER.split(sql)  # text, name, text, name, ..., text (``%%`` kept)

        def template(slot: Callable[[str], str]) -> tuple[str, str]:
            """The EXECUTE and the plain statement, each value's slot written by ``slot``."""
            fill = {name: constants[name] if name in constants else slot(name) for name in names}
            listed = ", ".join(fill[name] for name in names)
            plain = "".join(fill[part] if i % 2 else part for i, part in enumerate(parts))
            return f"{escaped_prefix}EXECUTE {self.name} ({listed})", escaped_prefix + plain

        execute, plain = template(lambda name: "%s")
        # Used only when every value's type is one of these two (see _Filled).
        typed_execute, typed_plain = template(lambda name: "'%s'" if kinds[name] is str else "%d")
        plain_arguments = tuple(name for name in parts[1::2] if name not in constants)
        self._execute = _Filled(execute, typed_execute, self.arguments, kinds)
        self._plain = _Filled(plain, typed_plain, plain_arguments, kinds)

    def executed(self, cursor: Any, params: dict[str, Any]) -> bytes:
        """``EXECUTE`` of the prepared statement with ``params`` (:attr:`arguments`) as literals."""
        return self._execute.written(cursor, params)

    def plain(self, cursor: Any, params: dict[str, Any]) -> bytes:
        """The statement itself with ``params`` as literals (no statement prepared)."""
        return self._plain.written(cursor, params)


def _python_type(sql_type: Any) -> type:
    """The Python type a bound value of ``sql_type`` has (``object`` when unknown)."""
    try:
        python_type: type = sql_type.python_type
    except NotImplementedError:
        return object
    return python_type


class _Filled:
    """A statement's %-template and the names of the values each run writes into it.

    Nearly every value the store sends is plain text (hex digests, a method, a plain
    path and scope) or a non-negative integer: when every value of a run is one of
    those, of the type its column takes, the whole statement is written in one step
    from a template with each slot already typed (``'%s'``, ``%d``), after one check of
    all its texts at once (issue 11). Any other run writes each value as
    :func:`_literal` does. Both give the same bytes.
    """

    __slots__ = ("_any", "_get", "_ints", "_kinds", "_texts", "_typed")

    def __init__(
        self, template: str, typed: str, names: tuple[str, ...], kinds: dict[str, type]
    ) -> None:
        self._any = template.encode()
        self._get = _tuple_of(names)
        wanted = tuple(kinds[name] for name in names)
        # (Value by value is as quick for one or two values.)
        typed_fits = len(wanted) > 2 and all(kind in (str, int) for kind in wanted)
        #: The types the values must have for the typed template, or ``None`` (never).
        self._kinds = wanted if typed_fits else None
        self._typed = typed
        self._texts = _tuple_of([i for i, kind in enumerate(wanted) if kind is str])
        self._ints = _tuple_of([i for i, kind in enumerate(wanted) if kind is int])

    def written(self, cursor: Any, params: dict[str, Any]) -> bytes:
        values = self._get(params)
        if (
            self._kinds is not None
            and tuple(map(type, values)) == self._kinds
            # Plain text joined is plain exactly when each part is: one match checks all.
            and _PLAIN_TEXT("".join(self._texts(values)))
            # (psycopg2 writes a negative number with a space before its sign)
            and min(self._ints(values), default=0) >= 0
        ):
            return (self._typed % values).encode()
        return self._any % tuple([_literal(cursor, value) for value in values])


def _tuple_of(keys: Sequence[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """``lambda container: tuple(container[key] for key in keys)``, in one C call where it can."""
    if len(keys) > 1:
        return operator.itemgetter(*keys)
    if len(keys) == 1:
        only = keys[0]
        return lambda container: (container[only],)
    return lambda container: ()


#: Text that is a valid SQL string literal between single quotes whatever the server's
#: ``standard_conforming_strings``, and that every client encoding's Python codec writes
#: as ASCII: printable ASCII without ``'`` or ``\``, nor ``~`` (psycopg2 writes it 0x81B0
#: in SHIFT_JIS_2004, as Python's codec does; tests/test_wire_differential.py).
_PLAIN_TEXT = re.compile(r"[ -&(-\[\]-}]*").fullmatch


def _plain_literal(value: Any) -> bytes | None:
    """``value`` as an SQL literal when it needs no quoting rules of a connection; else ``None``."""
    kind = type(value)
    if kind is str:
        if _PLAIN_TEXT(value):
            ascii_text: bytes = value.encode("ascii")
            return b"'" + ascii_text + b"'"
    elif kind is int:
        if value >= 0:  # psycopg2 writes a space before a minus sign
            return b"%d" % value
    elif value is None:
        return b"NULL"
    elif kind is bool:
        return b"true" if value else b"false"
    return None


def _literal(cursor: Any, value: Any) -> bytes:
    """``value`` as an SQL literal, as psycopg2 would write it for this cursor.

    psycopg2 builds an adapter object per parameter (about 1.3 µs each, 8 per claim);
    the values of our statements are mostly hex digests, plain ASCII and small
    integers, written here directly. Anything else goes through psycopg2's own
    quoting for the cursor's connection (its encoding, its escaping rules).
    """
    literal = _plain_literal(value)
    if literal is None:
        literal = cursor.mogrify("%s", (value,))
    return literal


def fetchone(
    cursor: Any, info: dict[str, Any], statement: DirectSQL, params: dict[str, Any], prepare: bool
) -> Any:
    """Run ``statement`` on ``cursor`` (with its pooled connection's ``info``); its first row.

    ``prepare``: parsing and planning the claim's statement cost the server more than
    running it, so it is prepared once per pooled connection: the first use sends
    ``PREPARE`` and ``EXECUTE`` in one round trip, later ones ``EXECUTE``.
    """
    if not prepare:
        cursor.execute(statement.plain(cursor, params))
    else:
        prepared = info.get(_PREPARED)
        if prepared is None:
            prepared = info[_PREPARED] = set()
        if statement.name in prepared:
            cursor.execute(statement.executed(cursor, params))
        else:
            cursor.execute(statement.prepare + b"; " + statement.executed(cursor, params))
            prepared.add(statement.name)
    row = cursor.fetchone()
    at = statement.body_at
    if at is not None and row is not None:
        body = row[at]
        if body is not None and len(body) > _KEPT_RESULT_BYTES:
            # The cursor holds its last result until its next statement: a big one
            # is let go with this cursor rather than kept by the pooled connection.
            info.pop(_CURSOR, None)
    return row
