"""How an owner settles outside transactional mode: store the answer, or give the key back.

Storing is the durable completion (fenced by the owner's lock token, C14), then
the promotion to the cache and the wake-up of parked duplicates (C23).
Releasing deletes the record (fenced) and wakes one waiter to claim it (C20).
Transactional mode (:mod:`.transactional`) shares the release and the
after-commit steps.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Response

from .. import signals
from ..config import CALLER_STATUSES, TRANSIENT_STATUSES
from ..records import Completed, StoredResponse
from ..responses import capture
from ..store import StoreError, StoreRefused
from . import deferred, spool
from .ownership import Ownership
from .unit import abandon

log = logging.getLogger("flask_idempotency")


def release_reason(own: Ownership, status: int) -> str | None:
    """Why this outcome must not be stored, or ``None`` to store it (C16–C19)."""
    if own.release_requested:
        return "view"
    if own.failed:
        return "exception"
    if status in TRANSIENT_STATUSES:
        return "transient-status"
    if status in CALLER_STATUSES:
        return "caller-status"  # 401/403 answer who asks, not what was done (C16)
    if status >= 500 and not own.options.store_server_errors:
        return "server-error"
    return None


def store(own: Ownership, response: Response) -> Response:
    """Complete the record with ``response``; the answer the client gets (C14, C23, C55)."""
    state = own.state
    try:
        # A streamed body is drained here, with the lease still renewed: a slow stream
        # must not let a retry take the key over while it is read (C44).
        stored = capture(response, state.settings)
    except Exception:
        own.stop_heartbeat()
        release(own, "exception", response.status_code)  # a stream that failed mid-buffer
        raise
    own.stop_heartbeat()  # the completion is fenced; a renewal must not race it
    stored = state.store.fitting(stored)  # a body the database would refuse is not sent (C58)
    try:
        expires_at_ms = state.store.complete(own.claim, stored)
    except StoreRefused as exc:
        refused(own, stored, exc)
        return response
    except StoreError as exc:
        # The view ran; its client gets its answer now. The record is completed by this
        # process in the background once the store answers again (C55).
        store_kept(own, stored, exc)
        return response
    if expires_at_ms is None:
        own.lease_lost("complete")
        return response
    completed(own, stored, expires_at_ms)
    return response


def refused(own: Ownership, stored: StoredResponse, error: StoreRefused) -> None:
    """The database refused the completion for good (C58): store the answer without its
    body (C33), or, where even that is refused, give the key back; once, never kept as a
    settlement (a retry would be refused the same way, and the view run again after a
    lease). The client has its answer either way."""
    state, digest = own.state, own.ident.key_digest[:16]
    own.emit(signals.store_error, tier="database", error=str(error), action="complete")
    if not stored.body_omitted:
        log.error(
            "idempotency: the database refused the completion of %s (%s); storing it without"
            " its body (C33)",
            digest,
            error,
        )
        stored = stored.without_body()
        try:
            expires_at_ms = state.store.complete(own.claim, stored)
        except StoreRefused as again:
            error = again
        except StoreError as exc:
            store_kept(own, stored, exc)
            return
        else:
            if expires_at_ms is None:
                own.lease_lost("complete")
            else:
                completed(own, stored, expires_at_ms)
            return
    log.error(
        "idempotency: the database refused the completion of %s even without its body (%s);"
        " the key is released, and a retry runs the view",
        digest,
        error,
    )
    release(own, "store-refused", stored.status)


def store_kept(own: Ownership, stored: StoredResponse, error: StoreError) -> None:
    """Keep the completion the store could not take now, to land it later (C55); one the
    database then refuses for good is tried once more without its body (C58)."""
    state = own.state
    holder = [stored]

    def attempt() -> int | None:
        try:
            return state.store.complete(own.claim, holder[0], kept=True)
        except StoreRefused as exc:
            if holder[0].body_omitted:
                raise
            log.error(
                "idempotency: the database refused the deferred completion of %s (%s);"
                " storing it without its body (C33)",
                own.ident.key_digest[:16],
                exc,
            )
            holder[0] = holder[0].without_body()
            return state.store.complete(own.claim, holder[0], kept=True)

    deferred.keep(
        own,
        "complete",
        attempt,
        lambda expires_at_ms: _deferred_completion_landed(own, holder[0], expires_at_ms),
        size=len(stored.body),
        error=error,
        handover=_handover(own, "complete", response=stored),
    )


def completed(own: Ownership, stored: StoredResponse, expires_at_ms: int) -> None:
    """After the durable commit: promote to the cache, then wake the waiters (C23)."""
    own.state.announce_completed(
        own.ident.key_digest, Completed(own.ident.fingerprint, expires_at_ms, stored)
    )
    if stored.body_omitted:
        own.state.stored_without_body(own.route)
    if signals.response_stored.receivers:
        own.emit(signals.response_stored, status=stored.status, body_omitted=stored.body_omitted)


def _deferred_completion_landed(
    own: Ownership, stored: StoredResponse, expires_at_ms: int | None
) -> None:
    if expires_at_ms is None:
        own.lease_lost("complete")
    else:
        completed(own, stored, expires_at_ms)


def release(own: Ownership, reason: str, status: int | None) -> bool:
    """Give the key back; ``False`` when it was no longer ours (taken over)."""
    state = own.state
    if own.options.atomic:
        abandon(state.require_db())  # nothing the view wrote survives a release
    try:
        released = state.store.release(own.claim)
    except StoreError as exc:
        deferred.keep(
            own,
            "release",
            lambda: state.store.release(own.claim, kept=True),
            lambda released: _released(own, bool(released), reason, status),
            size=0,
            error=exc,
            handover=_handover(own, "release", reason=reason, status=status),
        )
        return True
    return _released(own, released, reason, status)


def _handover(own: Ownership, action: str, **what: Any) -> spool.Handover:
    """What another process needs to land this settlement once this one ended (C59)."""
    return spool.Handover(action, own.claim, own.ident, own.lease_seconds, own.route, **what)


def _released(own: Ownership, released: bool, reason: str, status: int | None) -> bool:
    if not released:
        own.lease_lost("release")
        return False
    own.state.wakeups.announce(own.ident.key_digest, "released")  # C20: a waiter claims it
    own.emit(signals.claim_released, reason=reason, status=status)
    return True


def settle_unfinished(own: Ownership, reason: str) -> None:
    """Release a claim no response will settle (an exception, an exit, C15)."""
    if own.settled:
        return
    own.settled = True
    own.stop_heartbeat()
    release(own, reason, None)
