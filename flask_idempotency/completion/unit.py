"""Transactional mode: the view's writes and the record's completion commit together (C40, C43).

With ``@idempotent(atomic=True)`` and ``Idempotency(db=db)``, the claim is still
its own short committed transaction, so other workers see it at once. Once the
claim is won, a :class:`Unit` ends whatever transaction ``db.session`` had open
(a scope loader that loaded ``current_user`` started one, and at REPEATABLE READ
or SERIALIZABLE its snapshot predates the claim) and begins a fresh one that sees
the claim, at the route's isolation level if it names one. The view then writes
through ``db.session`` and flushes, but does not commit. When the response is
known, the completion, an UPDATE fenced by this owner's lock token, is written
into that same transaction, and one commit makes both durable. A crash at any
instant leaves both or neither: the database rolls back an uncommitted
transaction when its connection dies, and the claim's lease lets the next retry
take over.

At a snapshot level (REPEATABLE READ, SERIALIZABLE) the transaction cannot see a
row version committed after its snapshot, so it could not complete a record the
lease heartbeat had renewed meanwhile. There the unit locks its record's row as
its first statement instead: while the transaction is open nobody can take the
key over, and the lock dies with the connection, so a killed worker still frees
its key for the next retry once its lease has lapsed.

A serialization failure (40001) or deadlock (40P01) anywhere in the unit rolls
it back; the route's ``retries`` say how often the view runs again, in a fresh
transaction under the same claim (:class:`Retryable`).

If another request took the lease over meanwhile, the fenced UPDATE matches no
row: the view's writes are rolled back and the client gets 409; the new owner's
result replays on the next retry.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from flask import current_app
from sqlalchemy import event, select, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from ..records import Claim, StoredResponse
from ..store import DurableStore, StoreError
from ..store.errors import describe as _describe
from ..store.errors import sqlstate as _sqlstate

log = logging.getLogger("flask_idempotency")

#: ``session.info`` flag: an atomic view owns this session's transaction.
_OWNED = "flask_idempotency.atomic_owner"
#: ``session.info`` flag: the commit under way is ours, not the view's.
_COMMITTING = "flask_idempotency.committing"
#: ``session.info`` flag: the view committed its own writes (logged outside debug/testing).
_VIEW_COMMITTED = "flask_idempotency.view_committed"
_guarded: weakref.WeakSet[Any] = weakref.WeakSet()

#: Levels whose transaction reads one snapshot taken at its first statement.
_SNAPSHOT_LEVELS = frozenset({"REPEATABLE READ", "SERIALIZABLE"})
#: Dialects where ``SET TRANSACTION ISOLATION LEVEL`` sets the next transaction's level only
#: (SQLite's transactions are serializable already).
_SET_TRANSACTION = frozenset({"postgresql", "mysql", "mariadb"})
#: SQLSTATEs after which the view runs again in a fresh transaction (C43).
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
#: The isolation level each engine's connections use by default, read once per engine.
_engine_levels: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


class ViewCommitted(RuntimeError):
    """An atomic view committed ``db.session`` itself, outside the extension's unit."""


class ViewWriteFailed(RuntimeError):
    """Flushing an atomic view's writes failed (a constraint, bad data): the view's own
    error, so the claim is released and the request fails like a view exception."""


class Retryable(Exception):
    """The unit hit a serialization failure or deadlock; everything it wrote is rolled back."""

    def __init__(self, sqlstate: str, detail: str) -> None:
        super().__init__(detail)
        self.sqlstate = sqlstate


class LeaseLost(Exception):
    """The unit found its record no longer held by its lock token before the view ran."""


def retryable_sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE if ``exc`` (or what it wraps) is a serialization failure or deadlock."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, Retryable):
            return exc.sqlstate
        if isinstance(exc, DBAPIError):
            state = _sqlstate(exc)
            if state in RETRYABLE_SQLSTATES:
                return state
        exc = exc.__cause__
        seen += 1
    return None


def guard_sessions(db: Any) -> None:
    """Watch ``db.session`` for commits made by an atomic view (once per ``db``)."""
    if db in _guarded:
        return
    event.listen(db.session, "before_commit", _before_commit)
    _guarded.add(db)


def _before_commit(session: Any) -> None:
    if session.info.get(_OWNED) and not session.info.get(_COMMITTING):
        message = (
            "An @idempotent(atomic=True) view called db.session.commit(). In atomic mode the"
            " extension commits the view's writes together with the idempotency record;"
            " flush instead of committing."
        )
        if current_app.debug or current_app.testing:
            raise ViewCommitted(message)
        log.warning("idempotency: %s The commit went ahead without that guarantee.", message)
        session.info.pop(_OWNED, None)
        session.info[_VIEW_COMMITTED] = True  # its writes are final: never run it again


class Unit:
    """One atomic owner's transaction: begun after the claim, committed with the completion."""

    def __init__(self, db: Any, store: DurableStore, claim: Claim, isolation: str | None) -> None:
        self.db = db
        self.store = store
        self.claim = claim
        self.isolation = isolation
        self.locks_row = False

    def begin(self) -> None:
        """Start the view's transaction so that it sees the claim (C43).

        Whatever ``db.session`` did before the claim is rolled back: that work ran
        before this request owned the key, and its snapshot may predate the claim.
        Objects it loaded (``current_user``) are expired and reload on access.
        Raises :class:`LeaseLost` when, at a snapshot level, the record is no
        longer ours, and :class:`Retryable` or :class:`StoreError` when the
        database refuses.
        """
        session = self.db.session
        _rollback_quietly(session)
        session.info.pop(_VIEW_COMMITTED, None)
        session.info[_OWNED] = True
        try:
            level = self._level(session)
            if self.isolation is not None and self._dialect(session) in _SET_TRANSACTION:
                session.execute(text(f"SET TRANSACTION ISOLATION LEVEL {self.isolation}"))
            self.locks_row = level in _SNAPSHOT_LEVELS
            if self.locks_row and not self._lock_record(session):
                _rollback_quietly(session)
                raise LeaseLost
        except SQLAlchemyError as exc:
            _rollback_quietly(session)
            state = retryable_sqlstate(exc)
            if state is not None:
                raise Retryable(state, _describe(exc)) from exc
            raise StoreError(_describe(exc)) from exc

    def _dialect(self, session: Any) -> str:
        return str(session.get_bind().dialect.name)

    def _level(self, session: Any) -> str | None:
        """The level this unit's transaction runs at: the route's, else the engine's."""
        if self.isolation is not None:
            return self.isolation
        engine = session.get_bind()
        if engine.dialect.name == "sqlite":
            return None  # one writer at a time: no snapshot can miss a later write
        level = _engine_levels.get(engine)
        if level is None:
            with engine.connect() as conn:
                level = str(conn.get_isolation_level()).upper().replace("_", " ")
            _engine_levels[engine] = level
        return level

    def _lock_record(self, session: Any) -> bool:
        """Lock the record's row as the transaction's first statement; ``False`` if not ours."""
        t = self.store.table
        stmt = (
            select(t.c.id)
            .where(t.c.id == self.claim.record_id, t.c.lock_token == self.claim.lock_token)
            .with_for_update(key_share=True)
        )
        return session.execute(stmt).first() is not None

    def commit(self, response: StoredResponse) -> int | None:
        """Complete the record inside the view's transaction and commit both.

        Returns the record's expiry, or ``None`` when the lease was lost (the
        view's writes were rolled back). Raises :class:`ViewWriteFailed` when the
        view's own writes cannot be flushed, :class:`Retryable` on a serialization
        failure or deadlock, and :class:`StoreError` when the database failed (all
        rolled back).
        """
        session = self.db.session
        session.info[_COMMITTING] = True
        try:
            # Flush the view's pending writes first (autoflush may be off): the completion
            # locks the record's row until the commit, and a slow flush must not hold it.
            try:
                session.flush()
            except SQLAlchemyError as exc:
                if retryable_sqlstate(exc) is None and not _is_disconnect(exc):
                    # The view's own data broke a constraint: its error, not a store outage.
                    _rollback_quietly(session)
                    raise ViewWriteFailed(_describe(exc)) from exc
                raise
            expires_at_ms = self.store.complete_in(session, self.claim, response)
            if expires_at_ms is None:
                session.rollback()
                return None
            session.commit()
            return expires_at_ms
        except SQLAlchemyError as exc:
            _rollback_quietly(session)
            state = retryable_sqlstate(exc)
            if state is not None:
                raise Retryable(state, _describe(exc)) from exc
            raise StoreError(_describe(exc)) from exc
        finally:
            session.info.pop(_COMMITTING, None)
            session.info.pop(_OWNED, None)

    @property
    def view_committed(self) -> bool:
        """Whether the view committed its own writes: a retry would repeat them (C43)."""
        return bool(self.db.session.info.get(_VIEW_COMMITTED))

    def rollback(self) -> None:
        """Throw the view's writes away: the outcome is not stored, or the attempt is retried."""
        abandon(self.db)


def _is_disconnect(exc: SQLAlchemyError) -> bool:
    return isinstance(exc, (OperationalError, InterfaceError)) or bool(
        getattr(exc, "connection_invalidated", False)
    )


def abandon(db: Any) -> None:
    """Throw the view's writes away: the outcome is not stored (release, exception)."""
    session = db.session
    _rollback_quietly(session)
    session.info.pop(_OWNED, None)


def _rollback_quietly(session: Any) -> None:
    try:
        session.rollback()
    except SQLAlchemyError as exc:  # the connection is gone; the database rolls back anyway
        log.warning("idempotency: rollback of an atomic view failed: %s", _describe(exc))
