"""How an owner settles in transactional mode: the view's writes and its record commit
together, and a serialization failure runs the view again under the same claim (C40, C43).

The unit of work itself (its isolation level, the row lock at snapshot levels,
the fenced completion inside the view's transaction) is :mod:`.unit`; this
module is the owner's side: run the view in a unit, retry it, and turn every
way a commit can fail into an answer the client can act on.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from flask import Response

from .. import signals
from ..problems import RequestInProgress, StoreUnavailable
from ..responses import capture
from ..store import StoreError
from . import unit
from .ownership import Ownership
from .plain import completed, release, release_reason

log = logging.getLogger("flask_idempotency")

#: Retry-After on a 503 for a commit that failed: the database needs a moment.
_STORE_RETRY_AFTER = 3.0


def run(
    own: Ownership, view: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the view and commit its writes with its record, as one unit of work (C40, C43).

    A serialization failure or deadlock, in the view or at the commit, rolls the
    attempt back; the view runs again in a fresh transaction under the same claim,
    up to the route's ``retries``. Only the last attempt's response is stored.
    Past the retries the claim is released and the client gets 503 with
    Retry-After. The claim itself is never given up between attempts.
    """
    attempts = 0
    while True:
        attempts += 1
        try:
            own.hold_heartbeat()  # a renewal under way must not race the lock or snapshot
            refused = _begin(own)
            if refused is not None:
                return refused
            assert own.unit is not None
            if not own.unit.locks_row:
                own.resume_heartbeat()  # a row lock, where taken, holds the key instead
            response = own.app.make_response(view(*args, **kwargs))
            if release_reason(own, response.status_code) is not None:
                return response  # settling releases it, rolling the writes back
            own.settled = True
            return store(own, response, retry=True)
        except Exception as exc:
            sqlstate = unit.retryable_sqlstate(exc)
            if sqlstate is None or (own.unit is not None and own.unit.view_committed):
                raise  # a view that committed its own writes is never run again (C43)
            own.settled = False
            assert own.unit is not None
            own.unit.rollback()
            own.resume_heartbeat()
            if attempts > own.options.retries:
                return _out_of_retries(own, attempts, sqlstate)
            own.emit(signals.transaction_retried, attempt=attempts, sqlstate=sqlstate)
            time.sleep(random.uniform(0.0, 0.005 * attempts))  # let the winner commit first


def store(own: Ownership, response: Response, *, retry: bool = False) -> Response:
    """Commit the view's writes and the completion as one transaction (C40).

    Both or neither: if the lease was lost, or the commit failed, the view's
    writes are gone, so its response would be a lie; the client gets a problem
    telling it to retry with the same key. With ``retry``, a serialization
    failure or deadlock propagates as :class:`unit.Retryable` for the caller to
    run the view again; without, it is answered like any failed commit.
    """
    state = own.state
    try:
        stored = capture(response, state.settings)  # a stream is read with the lease renewed
    except Exception:
        own.stop_heartbeat()
        release(own, "exception", response.status_code)  # a stream that failed mid-buffer
        raise
    own.hold_heartbeat()  # a renewal under way must not race the commit
    if own.unit is None:
        own.unit = unit.Unit(state.require_db(), state.store, own.claim, own.options.isolation)
    try:
        expires_at_ms = own.unit.commit(stored)
    except unit.ViewWriteFailed:
        release(own, "exception", stored.status)  # like an exception in the view (C17)
        raise
    except unit.Retryable as exc:
        if retry:
            raise
        return _failed(own, StoreError(str(exc)), "commit", stored.status)
    except StoreError as exc:
        return _failed(own, exc, "commit", stored.status)
    if expires_at_ms is None:
        own.lease_lost("complete")
        return _lost_lease_answer()
    completed(own, stored, expires_at_ms)
    return response


def _begin(own: Ownership) -> Response | None:
    """Begin the view's transaction after the claim (C43); an answer if it cannot run."""
    state = own.state
    if own.unit is None:
        own.unit = unit.Unit(state.require_db(), state.store, own.claim, own.options.isolation)
    try:
        own.unit.begin()
    except unit.LeaseLost:
        own.settled = True
        own.lease_lost("begin")
        return _lost_lease_answer()
    except StoreError as exc:
        own.settled = True
        return _failed(own, exc, "begin", None)
    return None


def _out_of_retries(own: Ownership, attempts: int, sqlstate: str) -> Response:
    """Every attempt conflicted: keep nothing, free the key, tell the client to retry."""
    own.settled = True
    log.warning(
        "idempotency: %s conflicted with concurrent transactions (SQLSTATE %s) %d time(s);"
        " released",
        own.ident.key_digest[:16],
        sqlstate,
        attempts,
    )
    release(own, "serialization-failure", None)
    return StoreUnavailable(
        f"The request conflicted with concurrent transactions {attempts} time(s) and nothing"
        " was kept. Retry with the same key.",
        retry_after=1.0,
    ).get_response()


def _lost_lease_answer() -> Response:
    return RequestInProgress(
        "Another request took this Idempotency-Key over while this one ran;"
        " this one's changes were rolled back. Retry with the same key to get its result.",
        retry_after=1.0,
    ).get_response()


def _failed(own: Ownership, exc: StoreError, action: str, status: int | None) -> Response:
    log.error("idempotency: atomic %s failed for %s: %s", action, own.ident.key_digest[:16], exc)
    own.emit(signals.store_error, tier="database", error=str(exc), action=action)
    if not release(own, f"{action}-failed", status):
        return _lost_lease_answer()  # another request holds the key now: its answer will replay
    return StoreUnavailable(
        "The request could not be committed and nothing was kept. Retry with the same key.",
        retry_after=_STORE_RETRY_AFTER,
    ).get_response()
