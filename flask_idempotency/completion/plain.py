"""How an owner settles outside transactional mode: store the answer, or give the key back.

Storing is the durable completion (fenced by the owner's lock token, C14), then
the promotion to the cache and the wake-up of parked duplicates (C23).
Releasing deletes the record (fenced) and wakes one waiter to claim it (C20).
Transactional mode (:mod:`.transactional`) shares the release and the
after-commit steps.
"""

from __future__ import annotations

import logging
import time

from flask import Response

from .. import signals
from ..config import TRANSIENT_STATUSES
from ..records import Claim, Completed, StoredResponse
from ..responses import capture
from ..store import StoreError
from .ownership import Ownership
from .unit import abandon

log = logging.getLogger("flask_idempotency")

#: Pauses between attempts to store a response while the database is unreachable.
_COMPLETE_RETRY_PAUSES = (0.05, 0.2, 0.5)


def release_reason(own: Ownership, status: int) -> str | None:
    """Why this outcome must not be stored, or ``None`` to store it (C16–C19)."""
    if own.release_requested:
        return "view"
    if own.failed:
        return "exception"
    if status in TRANSIENT_STATUSES:
        return "transient-status"
    if status >= 500 and not own.options.store_server_errors:
        return "server-error"
    return None


def store(own: Ownership, response: Response) -> Response:
    """Complete the record with ``response``; the answer the client gets (C14, C23)."""
    state = own.state
    try:
        stored = capture(response, state.settings)
    except Exception:
        release(own, "exception", response.status_code)  # a stream that failed mid-buffer
        raise
    try:
        expires_at_ms = _complete_with_retries(own, stored)
    except StoreError as exc:
        # The view ran; its client still gets the answer. The claim stays until its
        # lease lapses, so a retry waits rather than running the view again at once.
        log.error(
            "idempotency: could not store the response for %s: %s", own.ident.key_digest[:16], exc
        )
        own.emit(signals.store_error, tier="database", error=str(exc), action="complete")
        return response
    if expires_at_ms is None:
        own.lease_lost("complete")
        return response
    completed(own, stored, expires_at_ms)
    return response


def _complete_with_retries(own: Ownership, stored: StoredResponse) -> int | None:
    """Store the response, riding out a short database blip (a failover, a restart).

    The view's effects already happened: if the response cannot be stored, a retry
    after the lease would run the view a second time, so it is worth holding this
    client's answer back a moment longer for a few more attempts.
    """
    claim: Claim = own.claim
    store = own.state.store
    for pause in _COMPLETE_RETRY_PAUSES:
        try:
            return store.complete(claim, stored)
        except StoreError:
            time.sleep(pause)
    return store.complete(claim, stored)


def completed(own: Ownership, stored: StoredResponse, expires_at_ms: int) -> None:
    """After the durable commit: promote to the cache, then wake the waiters (C23)."""
    own.state.announce_completed(
        own.ident.key_digest, Completed(own.ident.fingerprint, expires_at_ms, stored)
    )
    if stored.body_omitted:
        own.state.stored_without_body(own.route)
    if signals.response_stored.receivers:
        own.emit(signals.response_stored, status=stored.status, body_omitted=stored.body_omitted)


def release(own: Ownership, reason: str, status: int | None) -> bool:
    """Give the key back; ``False`` when it was no longer ours (taken over)."""
    state = own.state
    digest = own.ident.key_digest
    if own.options.atomic:
        abandon(state.require_db())  # nothing the view wrote survives a release
    try:
        released = state.store.release(own.claim)
    except StoreError as exc:
        log.error("idempotency: could not release %s: %s", digest[:16], exc)
        own.emit(signals.store_error, tier="database", error=str(exc), action="release")
        return True
    if not released:
        own.lease_lost("release")
        return False
    state.wakeups.announce(digest, "released")  # C20: one waiter claims it next (C12)
    own.emit(signals.claim_released, reason=reason, status=status)
    return True


def settle_unfinished(own: Ownership, reason: str) -> None:
    """Release a claim no response will settle (an exception, an exit, C15)."""
    if own.settled:
        return
    own.settled = True
    own.stop_heartbeat()
    release(own, reason, None)
