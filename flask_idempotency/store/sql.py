"""The durable store: the source of truth for claims, leases and results.

CONTRACT C8, C13–C14, C20–C21, C26.

Every statement here is one short transaction of its own (C26), so each is
atomic and, at READ COMMITTED, sees the latest committed rows (a snapshot taken
for a single statement cannot hide a competitor's claim, race X9; at a stricter
isolation the conflict surfaces as a serialization failure, which is retried).
No pooled connection has its isolation level switched for us (:mod:`.engines`).
The claim is an INSERT that does nothing when the key is taken (each module of
:mod:`.dialects` has its database's form): the unique index lets exactly one
of any number of concurrent inserters win. Every write an owner makes afterwards
is fenced by its lock token (:mod:`.statements`).
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, MetaData, delete
from sqlalchemy.exc import SQLAlchemyError

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
from .dialects import named, of
from .direct import DirectStatements
from .engines import ATTEMPTS, Unanswered, timed_out, watched
from .errors import StoreError, describe, is_read_only
from .schema import StoreSchema
from .statements import (
    applied_expiry,
    bound_completion,
    claim_params,
    claim_values,
    completion_of,
    completion_params,
    expiry_of,
    fenced_release,
    fenced_renewal,
    new_token,
    owner_params,
    replace_expired,
    select_record,
    still_there,
    take_over,
)

log = logging.getLogger("flask_idempotency")


class ClaimUnanswered(Unanswered):
    """A claim whose statement got no reply, not even to its cancel: it may commit
    later, held by a token nobody was handed (C58). Still a 503 for the request; the
    caller keeps :meth:`DurableStore.release_unanswered` with :attr:`key_digest` and
    :attr:`token` and retries it like a settlement, so the key is not held for a lease."""

    def __init__(self, message: str, key_digest: str, token: str, lease: float) -> None:
        super().__init__(message)
        self.key_digest, self.token, self.lease = key_digest, token, lease


class DurableStore(StoreSchema):
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
        super().__init__(engine_factory, metadata, table_name, create_table)
        #: Commit the claim without waiting for the WAL flush (``IDEMPOTENCY_ASYNC_CLAIM``).
        self.async_claim = async_claim
        # The two statements of every claim and replay, built once: building a
        # construct per request cost more CPU than executing it (bench/run.py).
        self._claim_stmt: Any = None
        self._get_stmt: Any = None
        self._complete_stmt: Any = None
        self._async_claim_sql: tuple[str, dict[str, Any]] | None = None
        self._at_once_sql: tuple[str, dict[str, Any]] | None = None
        self._at_once_stmt: Any = None
        #: The largest body the database takes, read once (C58; ``_largest_read``).
        self._largest_body: int | None = None
        self._largest_read = False
        self._largest_lock = threading.Lock()

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
        try:
            return self._acquire(ident, ttl, lease, guard_locks)
        except UnicodeEncodeError:
            # The connection's client encoding cannot carry the scope or the path (a
            # LATIN1 database, say). They are informational columns (the record is named
            # by the digest), so they are stored escaped instead (issue 22.6).
            return self._acquire(ident.in_ascii(), ttl, lease, guard_locks)

    def _acquire(
        self, ident: Identity, ttl: float, lease: float, guard_locks: bool
    ) -> Claim | Record:
        if not self._verified:
            self.verify_table()
        ttl_ms, lease_ms = int(ttl * 1000), int(lease * 1000)
        record: Record | None = None
        # One token for every attempt of this call: when a write's COMMIT reached the
        # server but its reply was lost, the retry reads a row that carries this token
        # and knows the claim is its own (no waiting for itself, C8).
        token = new_token()
        how = "new"
        for _ in range(ATTEMPTS):
            try:
                outcome = self._claim_or_read(ident, token, ttl_ms, lease_ms, guard_locks)
            except Unanswered as exc:  # may commit later under a token nobody holds (C58)
                raise ClaimUnanswered(str(exc), ident.key_digest, token, lease) from exc
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
            elif not record.lease_live and not process.keeps(record.lock_token):
                # (A record whose settlement this very process keeps is left to it, C59.)
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
            if (
                single is not None
                and self.async_claim
                and of(single).async_claim_prefix(single.dialect.driver) is None
            ):
                single = None  # psycopg 3 through SQLAlchemy: the setting needs a transaction
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
        params = claim_params(ident, token, ttl_ms, lease_ms)
        quick = self._asynchronous_claim_sql(conn) if self.async_claim else None
        if quick is not None:
            text, defaults = quick
            row = conn.exec_driver_sql(text, {**defaults, **params}).first()
        else:
            if self.async_claim:
                of(conn).commit_claim_asynchronously(conn)
            result = conn.execute(self._claim_statement(), params)
            if not result.returns_rows:
                return None  # MySQL/MariaDB: the SELECT that follows tells the winner
            row = result.first()
        return None if row is None else Claim(row.id, token, row.expires_at_ms, "new")

    def _asynchronous_claim_sql(self, conn: Connection) -> tuple[str, dict[str, Any]] | None:
        """With ``IDEMPOTENCY_ASYNC_CLAIM`` where the dialect can (PostgreSQL with psycopg2):
        the setting and the claim INSERT in one round trip; ``None`` elsewhere.

        Opt-in, because it trades durability for one fsync wait per first execution:
        the claim excludes concurrent requests as soon as it commits, but a PostgreSQL
        crash or failover before the WAL flush loses it while its owner may still be
        running, and a retry then runs the view concurrently with that owner. The
        default (synchronous) claim survives a crash once the client has been told.
        """
        prefix = of(conn).async_claim_prefix(conn.dialect.driver)
        if prefix is None:
            return None
        if "%" in self.table.fullname:  # would read as a placeholder once interpolated
            return None
        cached = self._async_claim_sql
        if cached is None:
            compiled = self._claim_statement().compile(dialect=conn.dialect)
            cached = self._async_claim_sql = (prefix + compiled.string, dict(compiled.params))
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
        params = claim_params(ident, token, ttl_ms, lease_ms)
        if self.async_claim:  # the setting and the statement in one simple query
            text, defaults = self._at_once_sql_async(conn)
            row = conn.exec_driver_sql(text, {**defaults, **params}).first()
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
                "claim_async", self._at_once_statement, prefix=direct.async_claim_prefix
            )
        else:
            statement = self._direct_sql("claim", self._at_once_statement)
        params = claim_params(ident, token, ttl_ms, lease_ms)
        claim_or_read = functools.partial(direct.fetchone, statement=statement, params=params)
        row = self._run_direct(direct, statement.sql, claim_or_read)
        if row is None:  # pragma: no cover - the outer SELECT always yields one row
            return None
        if row[0] is not None:  # claimed_id
            return Claim(int(row[0]), token, int(row[1]), "new")
        assert statement.record_values is not None
        record = statement.record_values(row)
        return None if record[0] is None else record_from_values(record)

    def _at_once_statement(self) -> Any:
        """The claim-or-read statement of the single-statement pool, built once
        (PostgreSQL: :meth:`.dialects.postgresql.PostgreSQL.claim_or_read_statement`)."""
        stmt = self._at_once_stmt
        if stmt is None:
            rules = named(self.dialect)
            stmt = self._at_once_stmt = rules.claim_or_read_statement(
                self.table, claim_values(self.table)
            )
        return stmt

    def _at_once_sql_async(self, conn: Connection) -> tuple[str, dict[str, Any]]:
        """The same statement as the driver's SQL, after the asynchronous-commit setting
        (``IDEMPOTENCY_ASYNC_CLAIM``): one simple query is one implicit transaction."""
        cached = self._at_once_sql
        if cached is None:
            prefix = of(conn).async_claim_prefix(conn.dialect.driver)
            assert prefix is not None
            compiled = self._at_once_statement().compile(dialect=conn.dialect)
            cached = self._at_once_sql = (prefix + compiled.string, dict(compiled.params))
        return cached

    def _claim_statement(self) -> Any:
        """``INSERT … ON CONFLICT DO NOTHING RETURNING`` with the request's values as parameters."""
        stmt = self._claim_stmt
        if stmt is None:
            try:
                rules = named(self.dialect)
                stmt = rules.claim_statement(self.table, claim_values(self.table))
            except ValueError as exc:
                raise StoreError(str(exc)) from None
            self._claim_stmt = stmt
        return stmt

    def _replace_expired(
        self, record: Record, ident: Identity, token: str, ttl_ms: int, lease_ms: int
    ) -> Claim | None:
        """Turn an expired record into a fresh claim in one conditional UPDATE (C21)."""
        stmt = replace_expired(self.table, record, ident, token, ttl_ms, lease_ms)
        expires = self._run_locked(
            lambda conn: self._update_returning_expiry(conn, stmt, record.id)
        )
        return None if expires is None else Claim(record.id, token, expires, "replaced")

    def _take_over(self, record: Record, token: str, lease_ms: int) -> Claim | None:
        """Take a lapsed lease with one conditional UPDATE; among racers one wins (C13)."""
        stmt = take_over(self.table, record, token, lease_ms)
        expires = self._run_locked(
            lambda conn: self._update_returning_expiry(conn, stmt, record.id)
        )
        return None if expires is None else Claim(record.id, token, expires, "taken_over")

    def _update_returning_expiry(self, conn: Connection, stmt: Any, record_id: Any) -> int | None:
        """Run a conditional UPDATE of one record; its expiry if it matched, else ``None``.

        Where ``UPDATE … RETURNING`` is missing (MySQL, MariaDB) the matched-row count
        decides, and the row, now locked by this transaction, is read back.
        """
        if of(conn).returns_from_update:
            row = conn.execute(stmt.returning(self.table.c.expires_at_ms)).first()
            return None if row is None else int(row.expires_at_ms)
        if conn.execute(stmt).rowcount != 1:
            return None
        return int(conn.execute(expiry_of(self.table, record_id)).scalar_one())

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
            stmt = self._get_stmt = select_record(self.table)
        return stmt

    # -- the owner's writes, fenced by its token --------------------------------------

    def largest_body(self) -> int | None:
        """The largest body a completion can carry on this database (C58), read from the
        server once per store (``@@max_allowed_packet`` on MySQL/MariaDB; a known limit
        elsewhere); ``None`` while it cannot be read (an outage: read on a later call)."""
        if self._largest_read:
            return self._largest_body
        with self._largest_lock:
            if not self._largest_read:
                try:
                    self._largest_body = of(self.engine).largest_body(self._run)
                except StoreError:
                    return None
                self._largest_read = True
            return self._largest_body

    def fitting(self, response: StoredResponse) -> StoredResponse:
        """``response``, or its body omitted (C33) when the database would refuse it for
        good (C58): such a body is never sent."""
        limit = self.largest_body()
        if limit is None or response.body_omitted or len(response.body) <= limit:
            return response
        log.warning(
            "idempotency: a response body of %d bytes is over the %d bytes this database"
            " takes in one completion; stored without its body (C33, C58)",
            len(response.body),
            limit,
        )
        return response.without_body()

    def complete(self, claim: Claim, response: StoredResponse, *, kept: bool = False) -> int | None:
        """Store the response and complete the record; ``None`` if the lease was lost (C14).

        ``kept``: a kept settlement's try (C55), whose earlier try may have committed
        after its deadline or with its reply lost: every attempt, the first included,
        then recognises the record this claim completed (C58).
        """
        direct = self._direct()
        if direct is not None:
            return self._complete_direct(direct, claim, response, kept)
        single = self._single()
        stmt = self._complete_statement()
        params = completion_params(claim, response)
        applied = self._applied_statement()
        applied_params = owner_params(claim)
        attempts = 1 if kept else 0  # a kept try follows one that may have landed

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
        self, direct: DirectStatements, claim: Claim, response: StoredResponse, kept: bool
    ) -> int | None:
        """:meth:`complete` on the pooled psycopg2 connection directly: the same fenced
        UPDATE … RETURNING, and the same check for a lost reply on a retry (C14)."""
        statement = self._direct_sql("complete", self._complete_statement)
        params = completion_params(claim, response)
        applied = self._direct_sql("applied", self._applied_statement)
        applied_params = owner_params(claim)
        attempts = 1 if kept else 0  # a kept try follows one that may have landed

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
        return applied_expiry(self.table)

    def _complete_statement(self) -> Any:
        """The fenced completion with the claim's and response's values as parameters."""
        stmt = self._complete_stmt
        if stmt is None:
            stmt = self._complete_stmt = bound_completion(self.table)
            if named(self.dialect).returns_from_update:
                stmt = self._complete_stmt = stmt.returning(self.table.c.expires_at_ms)
        return stmt

    def complete_in(self, executor: Any, claim: Claim, response: StoredResponse) -> int | None:
        """Complete the record inside the caller's transaction (``executor``: a Session or
        Connection); the record's expiry, or ``None`` if the lease was lost (C14, C40).

        In atomic mode this runs in the view's transaction, where the UPDATE also
        locks the row until that transaction commits.
        """
        stmt = completion_of(self.table, claim, response)
        t = self.table
        if named(self.dialect).returns_from_update:
            row = executor.execute(stmt.returning(t.c.expires_at_ms)).first()
            return None if row is None else int(row.expires_at_ms)
        if executor.execute(stmt).rowcount != 1:
            return None
        return int(executor.execute(expiry_of(t, claim.record_id)).scalar_one())

    def completion_statement(self, claim: Claim, response: StoredResponse) -> Any:
        """The fenced UPDATE that completes a record, returning its expiry (PostgreSQL and
        SQLite; :meth:`complete_in` works on every dialect)."""
        stmt = completion_of(self.table, claim, response)
        return stmt.returning(self.table.c.expires_at_ms)

    def release(self, claim: Claim, *, kept: bool = False) -> bool:
        """Delete the owner's record so a retry runs anew; ``False`` if the lease was lost (C20).

        A retry after a lost connection that finds the row gone counts as released:
        the earlier attempt's COMMIT reached the server and only its reply was lost
        (another owner could only have deleted it after taking over a lapsed lease,
        and the wake-up that follows is a mere hint). ``kept``: a kept settlement's try,
        which reads it so from its first attempt on (C58).
        """
        direct = self._direct()
        if direct is not None:
            return self._release_direct(direct, claim, kept)
        params = owner_params(claim)
        stmt, exists = self._release_statement(), self._exists_statement()
        attempts = 1 if kept else 0  # a kept try follows one that may have landed

        def delete_own(conn: Connection) -> bool:
            nonlocal attempts
            attempts += 1
            if conn.execute(stmt, params).rowcount:
                return True
            return attempts > 1 and conn.execute(exists, params).first() is None

        return self._run(delete_own, self._single())

    def _release_direct(self, direct: DirectStatements, claim: Claim, kept: bool) -> bool:
        """:meth:`release` on the pooled psycopg2 connection directly (a fenced
        ``DELETE … RETURNING``), with the same reading of a retry that finds no row."""
        statement = self._direct_sql(
            "release", lambda: self._release_statement().returning(self.table.c.id)
        )
        exists = self._direct_sql("exists", self._exists_statement)
        params = owner_params(claim)
        attempts = 1 if kept else 0  # a kept try follows one that may have landed

        def delete_own(cursor: Any, info: dict[str, Any]) -> bool:
            nonlocal attempts
            attempts += 1
            if direct.fetchone(cursor, info, statement, params) is not None:
                return True
            return attempts > 1 and direct.fetchone(cursor, info, exists, params) is None

        return self._run_direct(direct, statement.sql, delete_own)

    def release_unanswered(self, key_digest: str, token: str) -> bool:
        """Undo a claim that got no reply (:class:`ClaimUnanswered`): delete the record of
        ``key_digest`` if it is still in progress under ``token``, which was never handed
        to anyone (fenced like every owner's write: a record another request took over
        or completed stays). ``True`` when it deleted the record; ``False`` when there is
        none: the claim was never applied, or has not been applied *yet* (its statement
        may still be queued on the server), so the caller tries again until the claim's
        lease would have lapsed anyway (C13)."""
        t = self.table
        stmt = delete(t).where(
            t.c.key_digest == key_digest, t.c.lock_token == token, t.c.state == IN_PROGRESS
        )
        return bool(self._run(lambda conn: conn.execute(stmt).rowcount, self._single()))

    def _release_statement(self) -> Any:
        """The owner's fenced DELETE, with the claim's id and token as parameters."""
        return fenced_release(self.table)

    def _exists_statement(self) -> Any:
        """Whether the record is still there (a retried release's check)."""
        return still_there(self.table)

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
        stmt = fenced_renewal(self.table, lease)

        def renew_all(conn: Connection) -> set[int]:
            renewed: set[int] = set()
            for claim in claims:
                if conn.execute(stmt, owner_params(claim)).rowcount:
                    renewed.add(claim.record_id)
            return renewed

        def in_transaction(conn: Connection) -> set[int]:
            with conn.begin(), of(conn).lock_wait_bounded(conn):
                return renew_all(conn)

        target = engine or self.engine
        deadline = self._new_deadline()
        try:
            with target.connect() as conn:
                return watched(conn, deadline, functools.partial(in_transaction, conn))
        except SQLAlchemyError as exc:
            if deadline is not None and deadline.fired:
                raise StoreError(timed_out(deadline, exc)) from exc
            if is_read_only(exc):
                self._leave_pools(exc, target)
            raise StoreError(describe(exc)) from exc


def _to_record(row: Any) -> Record:
    return record_from_values(_RECORD_ITEMS(row._mapping))


_RECORD_ITEMS = operator.itemgetter(*RECORD_COLUMNS)
