"""The durable store's engines, and how its statements run: retries and the outage rule.

CONTRACT C25, C26, C45, C47, C55.

Every statement runs in one short transaction of its own (C26), or on the request
path's autocommit pool where there is one. No pooled connection has its isolation
level switched for us: a switch is undone when the connection returns to the pool,
and undoing it on a connection the network has cut raises outside SQLAlchemy's
error handling and loses the pool slot.

Every statement, with its COMMIT, runs under a deadline (:mod:`.deadline`): a server
that stops answering costs a request :data:`~.deadline.STATEMENT_DEADLINE` seconds
and a 503, never a thread held until TCP gives up. A statement refused because the
server is read-only (SQLSTATE 25006: a standby reached after a failover, a demoted
primary) is an outage too (C25, C55); the connections that reached it leave the
pool, and the statement is tried once more on a fresh connection, which a multi-host
URL with ``target_session_attrs=read-write`` opens on the new primary.
"""

from __future__ import annotations

import functools
import random
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Engine, Table, create_engine, inspect
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .. import process
from .connect import OWN_POOLS
from .deadline import STATEMENT_DEADLINE, Deadline, watchdog
from .dialects import is_lock_unavailable, is_retryable, of
from .direct import DirectSQL, DirectStatements, supported
from .errors import (
    StoreError,
    StoreMisconfigured,
    StoreRefused,
    describe,
    is_read_only,
    is_refusal,
    is_schema_error,
    schema_help,
)

T = TypeVar("T")


class Unanswered(StoreError):
    """A statement whose reply never came: not even a cancel was answered and its socket
    was shut down (:attr:`.deadline.Deadline.cut`). It may still have been applied (C58)."""


#: Attempts of one statement, and of one claim, before the store gives up (C26).
ATTEMPTS = 4


class StoreEngines:
    """The engines of one records table, set up once per process, and the running of its
    statements with bounded retries (the base of
    :class:`~flask_idempotency.store.sql.DurableStore`)."""

    def __init__(
        self, engine_factory: Callable[[], Engine], table: Table, create_table: bool
    ) -> None:
        self._engine_factory = engine_factory
        self.table = table
        self._create_table = create_table
        self._engines: tuple[Engine, Engine, Engine | None] | None = None
        self._single_slot: dict[str, tuple[Engine | None]] = {}
        self._direct_runner: DirectStatements | None = None
        #: The direct path's statements as the driver's SQL, by name (:meth:`_direct_sql`).
        self._direct_cache: dict[str, DirectSQL] = {}
        self._setup_lock = process.lazy_lock()
        #: Seconds each statement may wait for its answer (:mod:`.deadline`); 0: no limit.
        self.statement_deadline = STATEMENT_DEADLINE

    # -- engines -----------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine for transactions (prune batches, takeover with a lock timeout)."""
        return self._resolve()[0]

    @property
    def autocommit(self) -> Engine:
        """The same pool in autocommit, for tests and tools that inspect or seed rows.

        The request path never uses it (see the module docstring).
        """
        return self._resolve()[1]

    def _resolve(self) -> tuple[Engine, Engine, Engine | None]:
        """The engines, set up once per process on first use.

        One caller sets up (builds the engines, creates the table) while racing first
        requests wait for it: a storm of them must not each open a connection to
        create the same table (under gevent that ran PostgreSQL out of connections).
        The lock that makes them wait is made on first use and forgotten in a forked
        child (:func:`process.lazy_lock`), so it is always a lock of the running
        process, patched by gevent when gevent runs: never a lock from ``init_app``
        or the ``--preload`` master, which would stall a gevent worker (issue 10).
        A failed setup is a store outage (503), tried again by the next request.
        """
        engines = self._engines
        if engines is None:
            with self._setup_lock:
                engines = self._engines
                if engines is None:
                    engines = self._engines = self._set_up()
        return engines

    def _set_up(self) -> tuple[Engine, Engine, Engine | None]:
        engine = self._engine_factory()
        single = process.once(self._single_slot, lambda: (self._sibling_of(engine),))[0]
        if self._create_table:
            try:  # on the request path's own pool where there is one
                self._create_if_missing(single or engine)
            except SQLAlchemyError as exc:
                raise StoreError(f"could not create the table: {describe(exc)}") from exc
        name = self.table.fullname
        if single is not None and "%" not in name and name.isascii() and supported(single):
            # (A literal % in the table name would read as a placeholder in its SQL; the
            # direct path sends its SQL as UTF-8 whatever the connection's client encoding.)
            self._direct_runner = DirectStatements(single)
        return engine, engine.execution_options(isolation_level="AUTOCOMMIT"), single

    def _sibling_of(self, engine: Engine) -> Engine | None:
        sibling = _autocommit_sibling(engine)
        if sibling is not None:  # its connections close with this store (C47)
            weakref.finalize(self, sibling.dispose)
        return sibling

    def _single(self) -> Engine | None:
        """The pool for the request path's single statements, or ``None`` (run each in a
        transaction of the main engine instead).

        On PostgreSQL with psycopg2 every statement there is its own transaction in one
        round trip, where a transaction on the main engine costs three (BEGIN, the
        statement, COMMIT). Its connections are born in autocommit, in a pool of their
        own built on the main engine's connect function (same server, arguments, sizes
        and events): no pooled connection ever has its mode switched and switched back
        (see the module docstring), and the app's own sessions never see this mode.
        """
        return self._resolve()[2]

    def _create_if_missing(self, engine: Engine) -> None:
        """Create the table; another process creating it at the same moment is fine."""
        try:
            self.table.create(engine, checkfirst=True)
        except SQLAlchemyError:
            if not inspect(engine).has_table(self.table.name, schema=self.table.schema):
                raise

    def engine_without_setup(self) -> Engine:
        """The engine, without the create-on-first-use step: operator commands must
        only ever report a missing table, never create one."""
        engines = self._engines
        return engines[0] if engines is not None else self._engine_factory()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    # -- the direct path -------------------------------------------------------------------

    def _direct(self) -> DirectStatements | None:
        """The direct runner of the autocommit pool, if nothing would miss its statements."""
        if self._engines is None:
            self._resolve()
        runner = self._direct_runner
        return runner if runner is not None and runner.usable() else None

    def _direct_sql(self, name: str, build: Callable[[], Any], *, prefix: str = "") -> DirectSQL:
        """The statement ``build()`` compiled once for the direct path, cached by ``name``."""
        cached = self._direct_cache.get(name)
        if cached is None:
            runner = self._direct_runner
            assert runner is not None
            compiled = runner.compile_for_store(build(), prefix)
            cached = self._direct_cache.setdefault(name, compiled)
        return cached

    # -- running statements --------------------------------------------------------------

    def _run(
        self,
        work: Callable[[Connection], T],
        single: Engine | None = None,
        *,
        lock_wait_is_final: bool = False,
    ) -> T:
        """Run ``work`` with bounded retries of transient failures; else raise :class:`StoreError`.

        Retried: serialization failures, deadlocks and lock-wait timeouts (C26),
        and a pooled connection that turned out to be dead (the database
        restarted). Anything else, or running out of attempts, is a store outage
        for the caller. ``lock_wait_is_final``: a lock wait that timed out is an
        answer for the caller (:meth:`_run_locked`), not retried.
        """
        deadline = self._new_deadline()

        def once() -> T:
            if single is not None:  # autocommit: each statement commits by itself
                with single.connect() as conn:
                    return watched(conn, deadline, functools.partial(work, conn))
            with self.engine.connect() as conn:
                return watched(conn, deadline, functools.partial(_in_transaction, conn, work))

        return self._retrying(once, deadline, lock_wait_is_final=lock_wait_is_final)

    def _run_direct(
        self, direct: DirectStatements, sql: str, work: Callable[[Any, dict[str, Any]], T]
    ) -> T:
        """:meth:`_run` for ``work`` on a cursor of the direct path (:mod:`.direct`)."""
        deadline = self._new_deadline()
        if deadline is None:
            return self._retrying(functools.partial(direct.run, sql, work))
        dog = watchdog()

        def watched(cursor: Any, info: dict[str, Any]) -> T:
            watching = dog.watch(deadline, cursor.connection)
            try:
                return work(cursor, info)
            finally:
                if watching:
                    dog.unwatch(deadline)

        return self._retrying(functools.partial(direct.run, sql, watched), deadline)

    def _new_deadline(self) -> Deadline | None:
        seconds = self.statement_deadline
        return Deadline(seconds) if seconds else None

    def _retrying(
        self,
        once: Callable[[], T],
        deadline: Deadline | None = None,
        *,
        lock_wait_is_final: bool = False,
    ) -> T:
        """``once()``, with the retries and the outage rule of :meth:`_run`.

        ``deadline``: the one each attempt runs under; a statement it cut off is an
        outage at once (a server that did not answer within it is not asked again).
        A read-only server's refusal sends the pools' connections away (they all
        reached that server) and counts as a dead connection: tried once more.
        """
        for attempt in range(ATTEMPTS):
            try:
                return once()
            except DBAPIError as exc:
                if deadline is not None and deadline.fired:
                    raise _cut_off(deadline, exc) from exc
                if is_schema_error(exc):
                    raise StoreMisconfigured(self._schema_help(exc)) from exc
                if lock_wait_is_final and is_lock_unavailable(exc):
                    raise StoreError(describe(exc)) from exc
                if is_refusal(exc):
                    raise StoreRefused(describe(exc)) from exc
                if is_read_only(exc):
                    self._leave_pools(exc)
                    exc.connection_invalidated = True
                retryable = is_retryable(exc) or (exc.connection_invalidated and attempt == 0)
                if not retryable or attempt == ATTEMPTS - 1:
                    raise StoreError(describe(exc)) from exc
                time.sleep(random.uniform(0.005, 0.02) * (attempt + 1))
            except SQLAlchemyError as exc:
                if deadline is not None and deadline.fired:
                    raise _cut_off(deadline, exc) from exc
                raise StoreError(describe(exc)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _leave_pools(self, exc: BaseException, *others: Engine) -> None:
        """Every connection the store's pools (and ``others``') hold now is replaced on its
        next checkout: one reached a read-only server, and so, most likely, did every
        connection made before it. (``Pool._invalidate``, private: what SQLAlchemy
        itself does to a pool after a disconnect.)"""
        engines = self._engines
        pools = [] if engines is None else [e.pool for e in (engines[0], engines[2]) if e]
        for pool in [*pools, *(engine.pool for engine in others)]:
            pool._invalidate(cast(Any, None), exc, _checkin=False)

    def _run_locked(self, work: Callable[[Connection], T]) -> T | None:
        """Run ``work`` so that it does not queue behind another owner's row lock.

        An atomic owner holds its record's row locked from its completion UPDATE
        to its commit. A statement that cannot get that lock within a moment
        returns ``None``, and the caller treats the record as still in progress
        rather than waiting in the database for someone else's commit.
        """

        def attempt(conn: Connection) -> T:
            with of(conn).lock_wait_bounded(conn):
                return work(conn)

        try:
            return self._run(attempt, lock_wait_is_final=True)
        except StoreError as exc:
            if is_lock_unavailable(exc.__cause__):
                return None
            raise

    def _schema_help(self, exc: BaseException) -> str:
        return schema_help(self.table.fullname, exc)


def _in_transaction(conn: Connection, work: Callable[[Connection], T]) -> T:
    """``work(conn)`` in one transaction, committed when it returns."""
    with conn.begin():
        return work(conn)


def watched(conn: Connection, deadline: Deadline | None, work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` with the statements it sends on ``conn`` under ``deadline``."""
    if deadline is None:
        return work(*args)
    if conn.dialect.name != "postgresql":
        if getattr(conn.dialect, "is_mariadb", False):
            _limit_statements(conn, deadline.seconds)
        return work(*args)
    dog = watchdog()
    watching = dog.watch(deadline, conn.connection.dbapi_connection)
    try:
        return work(*args)
    finally:
        if watching:
            dog.unwatch(deadline)


#: The ``max_statement_time`` a pooled MariaDB connection's session was given.
_STATEMENT_LIMIT = "flask_idempotency.max_statement_time"


def _limit_statements(conn: Connection, seconds: float) -> None:
    """MariaDB ends a statement that runs longer than ``seconds`` itself (error 1969,
    rolled back: a claim stuck behind a lock never commits later, C58), on the store's
    own engines (:data:`.connect.OWN_POOLS`): set once per pooled connection, in its
    session. An app's engine (``db=``) is left as it is: the session would carry the
    limit into the app's own queries."""
    if conn.engine.pool not in OWN_POOLS:
        return
    info = conn.connection.info
    if info.get(_STATEMENT_LIMIT) == seconds:
        return
    try:  # on the driver's cursor: no SQLAlchemy transaction is begun for it
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(f"SET SESSION max_statement_time = {float(seconds):.3f}")
        finally:
            cursor.close()
    except Exception:  # a dead connection: the statement that follows reports it
        return
    info[_STATEMENT_LIMIT] = seconds


def _cut_off(deadline: Deadline, exc: BaseException) -> StoreError:
    """The error for a statement its deadline ended: :class:`Unanswered` when not even its
    cancel was answered (it may have been applied), else a plain outage (cancelled on
    the server: not applied)."""
    return (Unanswered if deadline.cut else StoreError)(timed_out(deadline, exc))


def timed_out(deadline: Deadline, exc: BaseException) -> str:
    """What :class:`StoreError` says of a statement its deadline cut off."""
    return (
        f"no answer from the database within {deadline.seconds:g} s; the connection was"
        f" closed ({describe(exc)})"
    )


def _autocommit_sibling(engine: Engine) -> Engine | None:
    """A pool of its own on ``engine``'s connect function whose connections are born in
    autocommit; where the dialect has one (PostgreSQL with psycopg2), else ``None``."""
    if not of(engine).autocommit_pool(engine.dialect.driver):
        return None
    sibling = create_engine(engine.url, pool=engine.pool.recreate(), isolation_level="AUTOCOMMIT")
    return process.own_engine(sibling)  # reset in a forked child like the extension's own
