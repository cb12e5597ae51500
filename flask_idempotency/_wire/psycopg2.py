"""Statements sent on a pooled psycopg2 connection without SQLAlchemy's execution layer,
and prepared on the server by hand (issues 11, 21).

CONTRACT C8, C14, C26.

Private library APIs this module touches (the pool checkout it runs on is
:mod:`.sqla_pool`'s, with the private SQLAlchemy pool APIs listed there):

SQLAlchemy
  * Compiled statements: ``compiled.string``, ``compiled.binds[name].required`` / ``.type``,
    ``compiled.params``; ``dialect.type_compiler_instance.process(type)``.

psycopg2 (public API only)
  * ``cursor.execute(sql, params)`` with named ``%(name)s`` slots writes every value
    (psycopg2's own quoting for the connection); several statements in one ``execute``
    go as one simple query; ``Error.pgcode`` is the SQLSTATE. psycopg2 has no API for
    server-side prepared statements, so ``PREPARE``/``EXECUTE`` are written here:
    the statement's text with ``$n`` for its slots and the parameter types SQLAlchemy
    compiles. ``tests/test_wire_differential.py`` checks, for fuzzed values in every
    client encoding and ``standard_conforming_strings`` setting, that the prepared and
    the plain runs give what SQLAlchemy's own execution of the statement gives.

Until issue 21 the values were written into the text by a hand-written literal writer
(psycopg2 builds an adapter per value); measured on the whole request it saved less
than the run's noise (``bench/handwritten.py``: 0.96–1.00× with it), so psycopg2
quotes them again.

Tested with the versions the project's test matrix installs (``noxfile.py``):
SQLAlchemy 2.0.0 and the newest release (2.1.9 when this module was written),
psycopg2 2.9.5 and the newest (2.9.13).

What it is for: a replay from PostgreSQL is one statement and a first execution two; on
the psycopg2 autocommit pool, SQLAlchemy's ``Connection`` (its checkout wrapper,
execution context, result and row machinery) cost about twice what psycopg2's own
``execute`` costs, and preparing the claim saves the server its parse and plan (a
replay from PostgreSQL takes 0.68–0.70 and a first execution 0.78–0.82 of the time it
takes unprepared, ``bench/results/handwritten.md``). Here the statement, compiled once
to psycopg2's SQL, runs on a cursor of a connection checked out of that same SQLAlchemy
pool: the pool keeps its checkout and return, pre-ping, recycling, its events and fork
reset, and a failure reaches the store as the very ``DBAPIError`` SQLAlchemy would have
raised (a dead connection invalidated, with the whole pool's older connections, as
SQLAlchemy does), so the store's retry and outage rules (C26) see no difference. When
the store uses it, and what falls back, is
:class:`flask_idempotency.store.direct.DirectStatements`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .compiled import PLACEHOLDER, CompiledSQL
from .sqla_pool import _PREPARED


class DirectSQL(CompiledSQL):
    """A statement compiled once for the direct path.

    ``sql`` is the statement as SQLAlchemy would run it (error messages name it). It
    runs as :attr:`plain` (that very text), or as a server-side prepared statement:
    ``PREPARE`` once per pooled connection, sent with the first :attr:`execute` in
    one round trip (:attr:`prepare_and_execute`), named by a hash of its text so that a
    name always means this very statement. psycopg2 writes every value, by its own
    quoting for the connection (its encoding, ``standard_conforming_strings``): the
    texts are %-templates with SQLAlchemy's own named placeholders, run with
    :meth:`values`.
    """

    __slots__ = ("execute", "name", "plain", "prepare_and_execute")

    def __init__(
        self,
        compiled: Any,
        dialect: Any,
        record_values: Callable[[Any], Any] | None,
        prefix: str,
        body_at: int | None = None,
    ) -> None:
        super().__init__(compiled, record_values, prefix, body_at)
        sql: str = compiled.string
        names = list(dict.fromkeys(self.names))  # each value once, in order
        types = ", ".join(
            dialect.type_compiler_instance.process(compiled.binds[name].type) for name in names
        )
        numbered = PLACEHOLDER.sub(lambda m: f"${names.index(m.group(1)) + 1}", sql)
        digest = hashlib.sha256(f"{types}|{numbered}".encode()).hexdigest()[:24]
        self.name = f"flask_idempotency_{digest}"
        escaped_prefix = prefix.replace("%", "%%")  # run with parameters, ``%%`` is ``%``
        listed = ", ".join(f"%({name})s" for name in names)
        #: The prepared statement's ``EXECUTE``, a slot per value.
        self.execute = f"{escaped_prefix}EXECUTE {self.name} ({listed})"
        #: ``PREPARE`` and the first ``EXECUTE``, in one round trip.
        self.prepare_and_execute = f"PREPARE {self.name} ({types}) AS {numbered}; {self.execute}"
        #: The statement itself (no statement prepared: behind a transaction pooler).
        self.plain = escaped_prefix + sql

    #: What a run of the statement passes with its text (named slots).
    values = CompiledSQL.with_constants


def fetchone(
    cursor: Any, info: dict[str, Any], statement: DirectSQL, params: dict[str, Any], prepare: bool
) -> Any:
    """Run ``statement`` on ``cursor`` (with its pooled connection's ``info``); its first row.

    ``prepare``: parsing and planning the claim's statement cost the server more than
    running it, so it is prepared once per pooled connection: the first use sends
    ``PREPARE`` and ``EXECUTE`` in one round trip, later ones ``EXECUTE``.
    """
    values = statement.values(params)
    if not prepare:
        cursor.execute(statement.plain, values)
    else:
        prepared = info.get(_PREPARED)
        if prepared is None:
            prepared = info[_PREPARED] = set()
        if statement.name in prepared:
            cursor.execute(statement.execute, values)
        else:
            cursor.execute(statement.prepare_and_execute, values)
            prepared.add(statement.name)
    row = cursor.fetchone()
    statement.let_go_of_big_body(info, row)
    return row
