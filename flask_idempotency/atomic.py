"""Transactional mode: the view's writes and the record's completion commit together (C40).

With ``@idempotent(atomic=True)`` and ``Idempotency(db=db)``, the claim is still
its own short committed transaction, so other workers see it at once. The view
then writes through ``db.session`` and flushes, but does not commit. When the
response is known, the completion, an UPDATE fenced by this owner's lock token
(which also locks the row), is written into that same transaction, and one
commit makes both durable. A crash at any instant leaves both or neither: the
database rolls back an uncommitted transaction when its connection dies, and
the claim's lease lets the next retry take over.

If another request took the lease over meanwhile, the fenced UPDATE matches no
row: the view's writes are rolled back and the client gets 409; the new owner's
result replays on the next retry.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from flask import current_app
from sqlalchemy import event
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from .records import Claim, StoredResponse
from .store import DurableStore, StoreError, _describe

log = logging.getLogger("flask_idempotency")

#: ``session.info`` flag: an atomic view owns this session's transaction.
_OWNED = "flask_idempotency.atomic_owner"
#: ``session.info`` flag: the commit under way is ours, not the view's.
_COMMITTING = "flask_idempotency.committing"
_guarded: weakref.WeakSet[Any] = weakref.WeakSet()


class ViewCommitted(RuntimeError):
    """An atomic view committed ``db.session`` itself, outside the extension's unit."""


class ViewWriteFailed(RuntimeError):
    """Flushing an atomic view's writes failed (a constraint, bad data): the view's own
    error, so the claim is released and the request fails like a view exception."""


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


def begin(db: Any) -> None:
    """Mark the session as owned by an atomic view, before the view runs."""
    db.session.info[_OWNED] = True


def commit(db: Any, store: DurableStore, claim: Claim, response: StoredResponse) -> int | None:
    """Complete the record inside the view's transaction and commit both.

    Returns the record's expiry, or ``None`` when the lease was lost (the view's
    writes were rolled back). Raises :class:`ViewWriteFailed` when the view's own
    writes cannot be flushed, and :class:`StoreError` when the database failed
    (both rolled back).
    """
    session = db.session
    session.info[_COMMITTING] = True
    try:
        # Flush the view's pending writes first (autoflush may be off): the completion
        # locks the record's row until the commit, and a slow flush must not hold it.
        try:
            session.flush()
        except SQLAlchemyError as exc:
            if not _is_disconnect(exc):
                # The view's own data broke a constraint: its error, not a store outage.
                _rollback_quietly(session)
                raise ViewWriteFailed(_describe(exc)) from exc
            raise
        row = session.execute(store.completion_statement(claim, response)).first()
        if row is None:
            session.rollback()
            return None
        session.commit()
        return int(row.expires_at_ms)
    except SQLAlchemyError as exc:
        _rollback_quietly(session)
        raise StoreError(_describe(exc)) from exc
    finally:
        session.info.pop(_COMMITTING, None)
        session.info.pop(_OWNED, None)


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
