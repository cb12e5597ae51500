"""The durable store: the source of truth for claims, leases and results.

CONTRACT C8, C13–C14, C20–C21, C26.

Every statement here is one short transaction of its own (C26), so each is
atomic and, at READ COMMITTED, sees the latest committed rows (a snapshot taken
for a single statement cannot hide a competitor's claim, race X9; at a stricter
isolation the conflict surfaces as a serialization failure, which is retried).
No pooled connection has its isolation level switched for us: a switch is
undone when the connection returns to the pool, and undoing it on a connection
the network has cut raises outside SQLAlchemy's error handling and loses the
pool slot. The claim is an INSERT that does nothing when the key is taken
(``store_dialects`` has the per-database form): the unique index lets exactly one
of any number of concurrent inserters win. Every write an owner makes afterwards
is fenced by its lock token.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import random
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    MetaData,
    Table,
    and_,
    bindparam,
    create_engine,
    delete,
    inspect,
    literal,
    not_,
    select,
    true,
    update,
)
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .. import process
from ..records import (
    COMPLETED,
    IN_PROGRESS,
    RECORD_COLUMNS,
    Claim,
    Identity,
    Record,
    StoredResponse,
    record_from_values,
)
from .._wire.psycopg2 import DirectSQL, DirectStatements
from .dialects import (
    insert_or_nothing,
    insert_unless_present,
    is_lock_unavailable,
    is_retryable,
    lock_wait_bounded,
    mysql_errno,
    returns_from_update,
    sqlstate,
)
from .table import db_now_ms, idempotency_table

log = logging.getLogger("flask_idempotency")

T = TypeVar("T")

_ATTEMPTS = 4


class StoreError(Exception):
    """The durable store could not answer; the request gets 503 (C25, C26)."""


class StoreMisconfigured(StoreError):
    """The records table is missing or does not match the code: a deployment error (C45).

    Not an outage: waiting does not fix it, and failing open for it would run
    every protected view unprotected. The message says what to run.
    """


class DurableStore:
    """SQLAlchemy Core access to the records table, on PostgreSQL, MySQL/MariaDB or SQLite."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        *,
        metadata: MetaData | None = None,
        table_name: str = "idempotency_keys",
        create_table: bool = False,
        async_claim: bool = False,
    ) -> None:
        self._engine_factory = engine_factory
        self.table: Table = idempotency_table(metadata or MetaData(), table_name)
        self._create_table = create_table
        #: Commit the claim without waiting for the WAL flush (``IDEMPOTENCY_ASYNC_CLAIM``).
        self.async_claim = async_claim
        self._verified = False
        self._engines: tuple[Engine, Engine, Engine | None] | None = None
        # The two statements of every claim and replay, built once: building a
        # construct per request cost more CPU than executing it (bench/run.py).
        self._claim_stmt: Any = None
        self._get_stmt: Any = None
        self._complete_stmt: Any = None
        self._async_claim_sql: tuple[str, dict[str, Any]] | None = None
        self._at_once_sql: tuple[str, dict[str, Any]] | None = None
        self._at_once_stmt: Any = None
        self._single_slot: dict[str, tuple[Engine | None]] = {}
        self._direct_runner: DirectStatements | None = None
        #: The direct path's statements as psycopg2 SQL, by name (:meth:`_direct_sql`).
        self._direct_cache: dict[str, DirectSQL] = {}
        self._setup_lock = process.lazy_lock()

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
                raise StoreError(f"could not create the table: {_describe(exc)}") from exc
        if single is not None and "%" not in self.table.fullname:
            # (A literal % in the table name would read as a placeholder in its SQL.)
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

    def create_table(self) -> None:
        """Create the table if it is missing (tests, and the embedded SQLite default)."""
        self.table.create(self.engine, checkfirst=True)

    def verify_table(self) -> None:
        """Read every column once per process before the first claim, so that a missing
        or mismatched table stops requests before any view runs (C45), not at completion."""
        t = self.table
        probe = select(*t.c).where(t.c.id.is_(None)).limit(1)
        self._run(lambda conn: conn.execute(probe).first(), self._single())
        self._verified = True

    # -- the claim ------------------------------------------------------------------

    def acquire(
        self, ident: Identity, *, ttl: float, lease: float, guard_locks: bool = False
    ) -> Claim | Record:
        """Claim the record for ``ident``, or return the record that stands in the way.

        Returns a :class:`Claim` when this request now owns the record: it was new,
        it had expired and was replaced (C21), or its lease had lapsed and was taken
        over (C13). Otherwise returns the live record; the caller compares its
        fingerprint (C7), replays it (C9) or waits for it (C10).

        ``guard_locks`` (atomic routes): an atomic owner keeps its record's row
        locked from its completion to its commit, and a claim's unique check
        would queue behind that commit; guarded, it gives up after a moment and
        reads the record instead, so the duplicate parks or answers 409.
        """
        if not self._verified:
            self.verify_table()
        ttl_ms, lease_ms = int(ttl * 1000), int(lease * 1000)
        record: Record | None = None
        # One token for every attempt of this call: when a write's COMMIT reached the
        # server but its reply was lost, the retry reads a row that carries this token
        # and knows the claim is its own (no waiting for itself, C8).
        token = _new_token()
        how = "new"
        for _ in range(_ATTEMPTS):
            outcome = self._claim_or_read(ident, token, ttl_ms, lease_ms, guard_locks)
            if isinstance(outcome, Claim):
                return outcome
            record = outcome
            if record is None:
                continue  # released or pruned between the two statements: claim again
            if record.state == IN_PROGRESS and record.lock_token == token:
                return Claim(record.id, token, record.expires_at_ms, how)  # our lost reply
            if record.expired:
                how = "replaced"
                claim = self._replace_expired(record, ident, token, ttl_ms, lease_ms)
            elif record.fingerprint != ident.fingerprint or record.state == COMPLETED:
                return record
            elif not record.lease_live:
                how = "taken_over"
                claim = self._take_over(record, token, lease_ms)
            else:
                return record
            if claim is not None:
                return claim
        if record is None:
            raise StoreError("the record kept vanishing while it was being claimed")
        return record

    def _claim_or_read(
        self, ident: Identity, token: str, ttl_ms: int, lease_ms: int, guard_locks: bool
    ) -> Claim | Record | None:
        """One attempt: the claim, or the record in its way; ``None`` when neither was
        seen (a record that came and went between the two, race X9): try again."""
        if not guard_locks:
            direct = self._direct()
            if direct is not None:
                return self._claim_or_read_direct(direct, ident, token, ttl_ms, lease_ms)
            # A literal % in the table name would read as a placeholder in the driver's SQL.
            single = None if "%" in self.table.fullname else self._single()
            if single is not None:
                return self._run(
                    functools.partial(
                        self._claim_or_read_at_once,
                        ident=ident,
                        token=token,
                        ttl_ms=ttl_ms,
                        lease_ms=lease_ms,
                    ),
                    single,
                )

        def claim_or_read(conn: Connection) -> Claim | Record | None:
            # One transaction for both: at READ COMMITTED the SELECT takes a fresh
            # snapshot and sees the row that made the INSERT do nothing.
            claim = self._insert(conn, ident, token, ttl_ms, lease_ms)
            return claim if claim is not None else self._select(conn, ident.key_digest)

        if guard_locks:
            outcome = self._run_locked(claim_or_read)
            return self.get(ident.key_digest) if outcome is None else outcome  # locked: read
        return self._run(claim_or_read)

    def _insert(
        self, conn: Connection, ident: Identity, token: str, ttl_ms: int, lease_ms: int
    ) -> Claim | None:
        params = _claim_params(ident, token, ttl_ms, lease_ms)
        quick = self._asynchronous_claim_sql(conn) if self.async_claim else None
        if quick is not None:
            sql, defaults = quick
            row = conn.exec_driver_sql(sql, {**defaults, **params}).first()
        else:
            if self.async_claim and conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            result = conn.execute(self._claim_statement(), params)
            if not result.returns_rows:
                return None  # MySQL/MariaDB: the SELECT that follows tells the winner
            row = result.first()
        return None if row is None else Claim(row.id, token, row.expires_at_ms, "new")

    def _asynchronous_claim_sql(self, conn: Connection) -> tuple[str, dict[str, Any]] | None:
        """With ``IDEMPOTENCY_ASYNC_CLAIM`` on PostgreSQL with psycopg2: ``SET LOCAL
        synchronous_commit = off`` and the claim INSERT in one round trip; ``None`` elsewhere.

        Opt-in, because it trades durability for one fsync wait per first execution:
        the claim excludes concurrent requests as soon as it commits, but a PostgreSQL
        crash or failover before the WAL flush loses it while its owner may still be
        running, and a retry then runs the view concurrently with that owner. The
        default (synchronous) claim survives a crash once the client has been told.

        psycopg2 sends both statements in one simple query inside the transaction it
        opened, so ``SET LOCAL`` applies to the INSERT and to that transaction's COMMIT.
        """
        if conn.dialect.name != "postgresql" or conn.dialect.driver != "psycopg2":
            return None
        if "%" in self.table.fullname:  # would read as a placeholder once interpolated
            return None
        cached = self._async_claim_sql
        if cached is None:
            compiled = self._claim_statement().compile(dialect=conn.dialect)
            sql = _ASYNC_PREFIX + compiled.string
            cached = self._async_claim_sql = (sql, dict(compiled.params))
        return cached

    def _claim_or_read_at_once(
        self, conn: Connection, *, ident: Identity, token: str, ttl_ms: int, lease_ms: int
    ) -> Claim | Record | None:
        """The claim and, when it meets a record, that record: one statement, one round trip.

        The INSERT runs in a CTE and the outer SELECT reads the row by key with the
        statement's snapshot. A row a competitor committed after that snapshot makes
        the INSERT do nothing yet stays invisible to the SELECT: then neither comes
        back and the caller claims again with a fresh statement (race X9).
        """
        params = _claim_params(ident, token, ttl_ms, lease_ms)
        if self.async_claim:  # SET LOCAL and the statement in one simple query
            sql, defaults = self._at_once_sql_async(conn)
            row = conn.exec_driver_sql(sql, {**defaults, **params}).first()
        else:  # a construct: its compiled form and result columns are cached
            row = conn.execute(self._at_once_statement(), params).first()
        if row is None:  # pragma: no cover - the outer SELECT always yields one row
            return None
        if row.claimed_id is not None:
            return Claim(int(row.claimed_id), token, int(row.claimed_expires_at_ms), "new")
        return None if row.id is None else _to_record(row)

    def _claim_or_read_direct(
        self, direct: DirectStatements, ident: Identity, token: str, ttl_ms: int, lease_ms: int
    ) -> Claim | Record | None:
        """:meth:`_claim_or_read_at_once` on the pooled psycopg2 connection directly."""
        if self.async_claim:
            statement = self._direct_sql(
                "claim_async", self._at_once_statement, prefix=_ASYNC_PREFIX
            )
        else:
            statement = self._direct_sql("claim", self._at_once_statement)
        params = _claim_params(ident, token, ttl_ms, lease_ms)
        claim_or_read = functools.partial(direct.fetchone, statement=statement, params=params)
        row = self._run_direct(direct, statement.sql, claim_or_read)
        if row is None:  # pragma: no cover - the outer SELECT always yields one row
            return None
        if row[0] is not None:  # claimed_id
            return Claim(int(row[0]), token, int(row[1]), "new")
        assert statement.record_values is not None
        record = statement.record_values(row)
        return None if record[0] is None else record_from_values(record)

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
            statement = build()
            names = [c.key for c in statement.exported_columns]
            at = [names.index(column) for column in RECORD_COLUMNS if column in names]
            getter = operator.itemgetter(*at) if len(at) == len(RECORD_COLUMNS) else None
            body_at = names.index("response_body") if "response_body" in names else None
            compiled = runner.compile(statement, getter, prefix, body_at)
            cached = self._direct_cache.setdefault(name, compiled)
        return cached

    def _at_once_statement(self) -> Any:
        """``WITH ins AS (INSERT … SELECT … WHERE NOT EXISTS (the key) … RETURNING) SELECT
        ins.*, r.*, now FROM one LEFT JOIN ins LEFT JOIN table AS r ON r.key_digest = …``,
        built once (PostgreSQL).

        The INSERT is not even attempted when the statement's snapshot already holds
        the key (a replay): no sequence value is drawn and no speculative insertion
        is checked against the unique index.
        """
        stmt = self._at_once_stmt
        if stmt is None:
            ins = insert_unless_present(self.table, self._claim_values()).cte("ins")
            r = self.table.alias("r")
            one = select(literal(1).label("one")).subquery("one")
            stmt = self._at_once_stmt = select(
                ins.c.id.label("claimed_id"),
                ins.c.expires_at_ms.label("claimed_expires_at_ms"),
                *r.c,
                db_now_ms().label("now_ms"),
            ).select_from(
                one.outerjoin(ins, true()).outerjoin(
                    r, r.c.key_digest == bindparam("p_key_digest", type_=r.c.key_digest.type)
                )
            )
        return stmt

    def _at_once_sql_async(self, conn: Connection) -> tuple[str, dict[str, Any]]:
        """The same statement as the driver's SQL, after ``SET LOCAL synchronous_commit = off``
        (``IDEMPOTENCY_ASYNC_CLAIM``): one simple query is one implicit transaction."""
        cached = self._at_once_sql
        if cached is None:
            compiled = self._at_once_statement().compile(dialect=conn.dialect)
            sql = _ASYNC_PREFIX + compiled.string
            cached = self._at_once_sql = (sql, dict(compiled.params))
        return cached

    def _claim_statement(self) -> Any:
        """``INSERT … ON CONFLICT DO NOTHING RETURNING`` with the request's values as parameters."""
        stmt = self._claim_stmt
        if stmt is None:
            try:
                stmt = insert_or_nothing(self.dialect, self.table, self._claim_values())
            except ValueError as exc:
                raise StoreError(str(exc)) from None
            self._claim_stmt = stmt
        return stmt

    def _claim_values(self) -> dict[str, Any]:
        """The claim's column values: the request's as parameters, times from the database."""
        t = self.table
        now = db_now_ms()
        return {
            "key_digest": bindparam("p_key_digest", type_=t.c.key_digest.type),
            "scope": bindparam("p_scope", type_=t.c.scope.type),
            "fingerprint": bindparam("p_fingerprint", type_=t.c.fingerprint.type),
            "method": bindparam("p_method", type_=t.c.method.type),
            "path": bindparam("p_path", type_=t.c.path.type),
            "state": IN_PROGRESS,
            "lock_token": bindparam("p_lock_token", type_=t.c.lock_token.type),
            "created_at_ms": now,
            "expires_at_ms": now + bindparam("p_ttl_ms", type_=BigInteger()),
            "lease_expires_at_ms": now + bindparam("p_lease_ms", type_=BigInteger()),
        }

    def _replace_expired(
        self, record: Record, ident: Identity, token: str, ttl_ms: int, lease_ms: int
    ) -> Claim | None:
        """Turn an expired record into a fresh claim in one conditional UPDATE (C21)."""
        t, now = self.table, db_now_ms()
        stmt = (
            update(t)
            .where(
                t.c.id == record.id,
                t.c.expires_at_ms <= now,
                not_(and_(t.c.state == IN_PROGRESS, t.c.lease_expires_at_ms > now)),
            )
            .values(
                scope=ident.scope,
                fingerprint=ident.fingerprint,
                method=ident.method,
                path=ident.path[:2048],
                state=IN_PROGRESS,
                lock_token=token,
                created_at_ms=now,
                expires_at_ms=now + ttl_ms,
                lease_expires_at_ms=now + lease_ms,
                completed_at_ms=None,
                response_status=None,
                response_headers=None,
                response_body=None,
                body_omitted=False,
            )
        )
        expires = self._run_locked(
            lambda conn: self._update_returning_expiry(conn, stmt, record.id)
        )
        return None if expires is None else Claim(record.id, token, expires, "replaced")

    def _take_over(self, record: Record, token: str, lease_ms: int) -> Claim | None:
        """Take a lapsed lease with one conditional UPDATE; among racers one wins (C13)."""
        t, now = self.table, db_now_ms()
        stmt = (
            update(t)
            .where(
                t.c.id == record.id,
                t.c.state == IN_PROGRESS,
                t.c.lock_token == record.lock_token,
                t.c.lease_expires_at_ms <= now,
            )
            .values(lock_token=token, lease_expires_at_ms=now + lease_ms)
        )
        expires = self._run_locked(
            lambda conn: self._update_returning_expiry(conn, stmt, record.id)
        )
        return None if expires is None else Claim(record.id, token, expires, "taken_over")

    def _update_returning_expiry(self, conn: Connection, stmt: Any, record_id: Any) -> int | None:
        """Run a conditional UPDATE of one record; its expiry if it matched, else ``None``.

        Where ``UPDATE … RETURNING`` is missing (MySQL, MariaDB) the matched-row count
        decides, and the row, now locked by this transaction, is read back.
        """
        if returns_from_update(conn.dialect.name):
            row = conn.execute(stmt.returning(self.table.c.expires_at_ms)).first()
            return None if row is None else int(row.expires_at_ms)
        if conn.execute(stmt).rowcount != 1:
            return None
        t = self.table
        expiry = select(t.c.expires_at_ms).where(t.c.id == record_id)
        return int(conn.execute(expiry).scalar_one())

    def _run_locked(self, work: Callable[[Connection], T]) -> T | None:
        """Run ``work`` so that it does not queue behind another owner's row lock.

        An atomic owner holds its record's row locked from its completion UPDATE
        to its commit. A statement that cannot get that lock within a moment
        returns ``None``, and the caller treats the record as still in progress
        rather than waiting in the database for someone else's commit.
        """

        def attempt(conn: Connection) -> T:
            with lock_wait_bounded(conn):
                return work(conn)

        try:
            return self._run(attempt, lock_wait_is_final=True)
        except StoreError as exc:
            if is_lock_unavailable(exc.__cause__):
                return None
            raise

    # -- reads ---------------------------------------------------------------------

    def get(self, key_digest: str) -> Record | None:
        """The record named ``key_digest``, read with the database clock (no lock taken, R74)."""
        direct = self._direct()
        if direct is None:
            return self._run(lambda conn: self._select(conn, key_digest), self._single())
        statement = self._direct_sql("get", self._select_statement)
        params = {"p_key_digest": key_digest}
        read = functools.partial(direct.fetchone, statement=statement, params=params)
        row = self._run_direct(direct, statement.sql, read)
        if row is None:
            return None
        assert statement.record_values is not None
        return record_from_values(statement.record_values(row))

    def _select(self, conn: Connection, key_digest: str) -> Record | None:
        row = conn.execute(self._select_statement(), {"p_key_digest": key_digest}).first()
        return None if row is None else _to_record(row)

    def _select_statement(self) -> Any:
        stmt = self._get_stmt
        if stmt is None:
            t = self.table
            stmt = self._get_stmt = select(t, db_now_ms().label("now_ms")).where(
                t.c.key_digest == bindparam("p_key_digest", type_=t.c.key_digest.type)
            )
        return stmt

    # -- the owner's writes, fenced by its token --------------------------------------

    def complete(self, claim: Claim, response: StoredResponse) -> int | None:
        """Store the response and complete the record; ``None`` if the lease was lost (C14)."""
        direct = self._direct()
        if direct is not None:
            return self._complete_direct(direct, claim, response)
        single = self._single()
        stmt = self._complete_statement()
        params = _completion_params(claim, response)
        applied = self._applied_statement()
        applied_params = {"p_record_id": claim.record_id, "p_lock_token": claim.lock_token}
        attempts = 0

        def complete_own(conn: Connection) -> int | None:
            nonlocal attempts
            attempts += 1
            result = conn.execute(stmt, params)
            if result.returns_rows:
                row = result.first()
            else:  # MySQL/MariaDB: the matched-row count decides
                row = (
                    conn.execute(applied, applied_params).first() if result.rowcount == 1 else None
                )
            if row is None and attempts > 1:
                # An earlier attempt's COMMIT may have reached the server with its reply
                # lost: the completed row still carries our token (C14).
                row = conn.execute(applied, applied_params).first()
            return None if row is None else int(row.expires_at_ms)

        return self._run(complete_own, single)

    def _complete_direct(
        self, direct: DirectStatements, claim: Claim, response: StoredResponse
    ) -> int | None:
        """:meth:`complete` on the pooled psycopg2 connection directly: the same fenced
        UPDATE … RETURNING, and the same check for a lost reply on a retry (C14)."""
        statement = self._direct_sql("complete", self._complete_statement)
        params = _completion_params(claim, response)
        applied = self._direct_sql("applied", self._applied_statement)
        applied_params = {"p_record_id": claim.record_id, "p_lock_token": claim.lock_token}
        attempts = 0

        def complete_own(cursor: Any, info: dict[str, Any]) -> int | None:
            nonlocal attempts
            attempts += 1
            row = direct.fetchone(cursor, info, statement, params)
            if row is None and attempts > 1:
                # An earlier attempt's COMMIT may have reached the server with its reply
                # lost: the completed row still carries our token (C14).
                row = direct.fetchone(cursor, info, applied, applied_params)
            return None if row is None else int(row[0])

        return self._run_direct(direct, statement.sql, complete_own)

    def _applied_statement(self) -> Any:
        """The expiry of a record this claim has completed (a retried completion's check)."""
        t = self.table
        return select(t.c.expires_at_ms).where(
            t.c.id == bindparam("p_record_id", type_=t.c.id.type),
            t.c.lock_token == bindparam("p_lock_token", type_=t.c.lock_token.type),
            t.c.state == COMPLETED,
        )

    def _complete_statement(self) -> Any:
        """The fenced completion with the claim's and response's values as parameters."""
        stmt = self._complete_stmt
        if stmt is None:
            t = self.table
            stmt = self._complete_stmt = self._completion(
                bindparam("p_record_id", type_=t.c.id.type),
                bindparam("p_lock_token", type_=t.c.lock_token.type),
                bindparam("p_status", type_=t.c.response_status.type),
                bindparam("p_headers", type_=t.c.response_headers.type),
                bindparam("p_body", type_=t.c.response_body.type),
                bindparam("p_body_omitted", type_=t.c.body_omitted.type),
            )
            if returns_from_update(self.dialect):
                stmt = self._complete_stmt = stmt.returning(t.c.expires_at_ms)
        return stmt

    def complete_in(self, executor: Any, claim: Claim, response: StoredResponse) -> int | None:
        """Complete the record inside the caller's transaction (``executor``: a Session or
        Connection); the record's expiry, or ``None`` if the lease was lost (C14, C40).

        In atomic mode this runs in the view's transaction, where the UPDATE also
        locks the row until that transaction commits.
        """
        stmt = self._completion(
            claim.record_id,
            claim.lock_token,
            response.status,
            response.headers_json(),
            response.body,
            response.body_omitted,
        )
        t = self.table
        if returns_from_update(self.dialect):
            row = executor.execute(stmt.returning(t.c.expires_at_ms)).first()
            return None if row is None else int(row.expires_at_ms)
        if executor.execute(stmt).rowcount != 1:
            return None
        expiry = select(t.c.expires_at_ms).where(t.c.id == claim.record_id)
        return int(executor.execute(expiry).scalar_one())

    def completion_statement(self, claim: Claim, response: StoredResponse) -> Any:
        """The fenced UPDATE that completes a record, returning its expiry (PostgreSQL and
        SQLite; :meth:`complete_in` works on every dialect)."""
        return self._completion(
            claim.record_id,
            claim.lock_token,
            response.status,
            response.headers_json(),
            response.body,
            response.body_omitted,
        ).returning(self.table.c.expires_at_ms)

    def _completion(
        self, record_id: Any, lock_token: Any, status: Any, headers: Any, body: Any, omitted: Any
    ) -> Any:
        # The completed row keeps its owner's token, so that a completion whose COMMIT
        # reply was lost recognises its own write when retried (C14); a completed
        # record itself is never written again.
        t = self.table
        return (
            update(t)
            .where(t.c.id == record_id, t.c.lock_token == lock_token, t.c.state == IN_PROGRESS)
            .values(
                state=COMPLETED,
                response_status=status,
                response_headers=headers,
                response_body=body,
                body_omitted=omitted,
                completed_at_ms=db_now_ms(),
                lease_expires_at_ms=None,
            )
        )

    def release(self, claim: Claim) -> bool:
        """Delete the owner's record so a retry runs anew; ``False`` if the lease was lost (C20).

        A retry after a lost connection that finds the row gone counts as released:
        the earlier attempt's COMMIT reached the server and only its reply was lost
        (another owner could only have deleted it after taking over a lapsed lease,
        and the wake-up that follows is a mere hint).
        """
        direct = self._direct()
        if direct is not None:
            return self._release_direct(direct, claim)
        params = {"p_record_id": claim.record_id, "p_lock_token": claim.lock_token}
        stmt, exists = self._release_statement(), self._exists_statement()
        attempts = 0

        def delete_own(conn: Connection) -> bool:
            nonlocal attempts
            attempts += 1
            if conn.execute(stmt, params).rowcount:
                return True
            return attempts > 1 and conn.execute(exists, params).first() is None

        return self._run(delete_own, self._single())

    def _release_direct(self, direct: DirectStatements, claim: Claim) -> bool:
        """:meth:`release` on the pooled psycopg2 connection directly (a fenced
        ``DELETE … RETURNING``), with the same reading of a retry that finds no row."""
        statement = self._direct_sql(
            "release", lambda: self._release_statement().returning(self.table.c.id)
        )
        exists = self._direct_sql("exists", self._exists_statement)
        params = {"p_record_id": claim.record_id, "p_lock_token": claim.lock_token}
        attempts = 0

        def delete_own(cursor: Any, info: dict[str, Any]) -> bool:
            nonlocal attempts
            attempts += 1
            if direct.fetchone(cursor, info, statement, params) is not None:
                return True
            return attempts > 1 and direct.fetchone(cursor, info, exists, params) is None

        return self._run_direct(direct, statement.sql, delete_own)

    def _release_statement(self) -> Any:
        """The owner's fenced DELETE, with the claim's id and token as parameters."""
        t = self.table
        return delete(t).where(
            t.c.id == bindparam("p_record_id", type_=t.c.id.type),
            t.c.lock_token == bindparam("p_lock_token", type_=t.c.lock_token.type),
            t.c.state == IN_PROGRESS,
        )

    def _exists_statement(self) -> Any:
        """Whether the record is still there (a retried release's check)."""
        t = self.table
        return select(t.c.id).where(t.c.id == bindparam("p_record_id", type_=t.c.id.type))

    def renew(self, claims: list[Claim], lease: float, *, engine: Engine | None = None) -> set[int]:
        """Extend the leases of ``claims`` to ``lease`` seconds from now (C44).

        Fenced like every owner's write: a record renews only while it is still in
        progress under the claim's lock token. Returns the ids of the records
        renewed; a claim missing from it was taken over or released. All in one
        short transaction, on ``engine`` if given (the heartbeat's own pool, so
        views holding every pooled connection cannot starve it); a row another
        transaction holds locked (a completion about to commit) makes the call
        fail with :class:`StoreError` after a moment instead of waiting, and the
        heartbeat tries again.
        """
        t = self.table
        stmt = (
            update(t)
            .where(
                t.c.id == bindparam("p_record_id", type_=t.c.id.type),
                t.c.lock_token == bindparam("p_lock_token", type_=t.c.lock_token.type),
                t.c.state == IN_PROGRESS,
            )
            .values(lease_expires_at_ms=db_now_ms() + int(lease * 1000))
        )

        def renew_all(conn: Connection) -> set[int]:
            renewed: set[int] = set()
            for claim in claims:
                params = {"p_record_id": claim.record_id, "p_lock_token": claim.lock_token}
                if conn.execute(stmt, params).rowcount:
                    renewed.add(claim.record_id)
            return renewed

        try:
            with (engine or self.engine).begin() as conn, lock_wait_bounded(conn):
                return renew_all(conn)
        except SQLAlchemyError as exc:
            raise StoreError(_describe(exc)) from exc

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

        def once() -> T:
            if single is not None:  # autocommit: each statement commits by itself
                with single.connect() as conn:
                    return work(conn)
            with self.engine.begin() as conn:
                return work(conn)

        return self._retrying(once, lock_wait_is_final=lock_wait_is_final)

    def _run_direct(
        self, direct: DirectStatements, sql: str, work: Callable[[Any, dict[str, Any]], T]
    ) -> T:
        """:meth:`_run` for ``work`` on a cursor of the direct path (:mod:`.store_direct`)."""
        return self._retrying(functools.partial(direct.run, sql, work))

    def _retrying(self, once: Callable[[], T], *, lock_wait_is_final: bool = False) -> T:
        """``once()``, with the retries and the outage rule of :meth:`_run`."""
        for attempt in range(_ATTEMPTS):
            try:
                return once()
            except DBAPIError as exc:
                if _is_schema_error(exc):
                    raise StoreMisconfigured(self._schema_help(exc)) from exc
                if lock_wait_is_final and is_lock_unavailable(exc):
                    raise StoreError(_describe(exc)) from exc
                retryable = is_retryable(exc) or (
                    exc.connection_invalidated and attempt == 0
                )
                if not retryable or attempt == _ATTEMPTS - 1:
                    raise StoreError(_describe(exc)) from exc
                time.sleep(random.uniform(0.005, 0.02) * (attempt + 1))
            except SQLAlchemyError as exc:
                raise StoreError(_describe(exc)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _schema_help(self, exc: BaseException) -> str:
        return (
            f"the table {self.table.fullname!r} is missing or does not match Flask-Idempotency"
            f" ({_describe(exc)}). This is a deployment error, not an outage: run"
            " `flask db upgrade` (Flask-Migrate), or `flask idempotency create-table`,"
            " or `db.create_all()`; `flask idempotency check` compares the table"
        )


#: Put before the claim: it commits without waiting for the WAL flush (``async_claim``).
_ASYNC_PREFIX = "SET LOCAL synchronous_commit = off; "


def _claim_params(ident: Identity, token: str, ttl_ms: int, lease_ms: int) -> dict[str, Any]:
    """The bound values of a claim INSERT, alone or inside the claim-or-read statement."""
    return {
        "p_key_digest": ident.key_digest,
        "p_scope": ident.scope,
        "p_fingerprint": ident.fingerprint,
        "p_method": ident.method,
        "p_path": ident.path[:2048],
        "p_lock_token": token,
        "p_ttl_ms": ttl_ms,
        "p_lease_ms": lease_ms,
    }


def _new_token() -> str:
    """A fresh lock token: 128 random bits as 32 hex digits, like ``uuid4().hex`` without
    building a UUID (a few µs per first execution, issue 11)."""
    return os.urandom(16).hex()


def _autocommit_sibling(engine: Engine) -> Engine | None:
    """A pool of its own on ``engine``'s connect function whose connections are born in
    autocommit; PostgreSQL with psycopg2 only (``None`` elsewhere)."""
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg2":
        return None
    sibling = create_engine(engine.url, pool=engine.pool.recreate(), isolation_level="AUTOCOMMIT")
    return process.own_engine(sibling)  # reset in a forked child like the extension's own


def _to_record(row: Any) -> Record:
    return record_from_values(_RECORD_ITEMS(row._mapping))


_RECORD_ITEMS = operator.itemgetter(*RECORD_COLUMNS)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


#: SQLSTATEs / messages of "no such table" and "no such column" (C45).
_SCHEMA_SQLSTATES = frozenset({"42P01", "42703", "42S02", "42S22"})
_SCHEMA_MYSQL_ERRNOS = frozenset({1146, 1054})
_SCHEMA_MESSAGES = ("no such table", "no such column", "has no column named")


def _is_schema_error(exc: DBAPIError) -> bool:
    if sqlstate(exc) in _SCHEMA_SQLSTATES:
        return True
    if mysql_errno(exc) in _SCHEMA_MYSQL_ERRNOS:
        return True
    message = str(exc.orig).lower()
    return any(m in message for m in _SCHEMA_MESSAGES)


#: The SQLSTATE of a driver error (``atomic`` reads it too).
_sqlstate = sqlstate


def _describe(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    first_line = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    return f"{type(orig).__name__}: {first_line}"


def _completion_params(claim: Claim, response: StoredResponse) -> dict[str, Any]:
    """The fenced completion's bound values, on either execution path."""
    return {
        "p_record_id": claim.record_id,
        "p_lock_token": claim.lock_token,
        "p_status": response.status,
        "p_headers": response.headers_json(),
        "p_body": response.body,
        "p_body_omitted": response.body_omitted,
    }
