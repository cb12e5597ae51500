"""The next process on the host adopts the settlements an ended one spooled (C59).

A process that ends with kept settlements writes them to the host's spool
(:mod:`.spool`, :func:`.deferred.flush`). Every process of an app looks there before
it decides a request (:func:`pick_up`, at most once per :data:`SCAN_EVERY` seconds:
one directory listing) and adopts what it finds as its own kept settlements
(:func:`.deferred.adopt`): the renewer renews each one's lease by its token while the
store is still down, lands it when the store answers, and then does what its owner
would have done, with this process's app as the signals' sender: the promotion to the
cache, the wake-up of parked duplicates, ``response_stored`` or ``claim_released`` and
``settlement_deferred`` (``landed``). An adopted settlement is this process's for the
rest: a retry of its key arriving here never takes it over (:func:`..process.keeps`),
and were this process to end too, it spools it again.

The scan runs before the claim, so a retry that reaches the next process sees the
handed-on key as kept by it; a retry that reaches another process while the store is
down gets 503 as for any request then; once the store answers, the adopter's first
renewal comes within one retry step (a tenth of the lease).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .. import signals
from ..records import Completed
from ..store import StoreError
from . import deferred, spool
from .ownership import Teller

if TYPE_CHECKING:
    from flask import Flask

    from ..records import Claim, Identity
    from ..state import AppState

log = logging.getLogger("flask_idempotency")

#: Seconds between two looks at the spool of one store, per process.
SCAN_EVERY = 1.0
#: Per store (by id): when this process looks at its spool next (monotonic), where the
#: spool is (``None``: it has none), and the store, weakly (an id may be reused, and a
#: short-lived app must be freed, C47).
_next_scan: dict[int, tuple[float, Path | None, Callable[[], object]]] = {}
_NEVER: tuple[float, Path | None, Callable[[], object]] = (0.0, None, lambda: None)
#: Stores :data:`_next_scan` remembers at most.
_SCANS_KEPT = 256


class Heir(Teller):
    """The owner of an adopted settlement (:class:`.deferred.Owner`): it reports through
    this process's app."""

    def __init__(self, state: AppState, app: Flask, handover: spool.Handover) -> None:
        self.state = state
        self.app = app
        self.handover = handover
        self.started = time.perf_counter()

    @property
    def ident(self) -> Identity:
        return self.handover.ident

    @property
    def claim(self) -> Claim:
        return self.handover.claim

    @property
    def lease_seconds(self) -> float:
        return self.handover.lease

    @property
    def route(self) -> str | None:
        return self.handover.route


def pick_up(state: AppState, app: Flask) -> int:
    """Adopt the settlements spooled for ``state``'s store, at most once per
    :data:`SCAN_EVERY`; how many were adopted (an ERROR line, never an exception, when
    the spool cannot be read)."""
    now = time.monotonic()
    store = state.store
    due, where, of = _next_scan.get(id(store), _NEVER)
    known = of() is store
    if now < due and known:
        return 0
    if not known:  # first look (the path is worked out once per store)
        if len(_next_scan) >= _SCANS_KEPT:  # stores come and go (tests, app factories)
            _next_scan.clear()
        where = deferred.spool_path(state)
    _next_scan[id(store)] = (now + SCAN_EVERY, where, of if known else weakref.ref(store))
    if where is None:
        return 0
    try:
        adopted = 0
        for handover, claimed in spool.take(where):
            if adopt(state, app, handover):
                spool.remove(claimed)
                adopted += 1
            else:
                break  # this process keeps as many as it may: the rest stay spooled
    except OSError as exc:
        log.error("idempotency: could not read the spool of settlements (%s)", exc)
        return 0
    if adopted:
        log.warning(
            "idempotency: this process adopted %d settlement(s) an ended process had"
            " spooled; it lands them as soon as the store answers",
            adopted,
        )
    return adopted


def adopt(state: AppState, app: Flask, handover: spool.Handover) -> bool:
    """Keep one handed-on settlement as this process's own (see the module doc)."""
    heir = Heir(state, app, handover)
    store, claim, ident = state.store, handover.claim, handover.ident
    if handover.action == "complete":
        response = handover.response
        assert response is not None

        def complete() -> int | None:
            return store.complete(claim, response, kept=True)

        def completed(expires_at_ms: int | None) -> None:
            if expires_at_ms is None:
                heir.lease_lost("complete")
                return
            state.announce_completed(
                ident.key_digest, Completed(ident.fingerprint, expires_at_ms, response)
            )
            if response.body_omitted:
                state.stored_without_body(handover.route)
            heir.emit(
                signals.response_stored,
                status=response.status,
                body_omitted=response.body_omitted,
            )

        return deferred.adopt(heir, handover, complete, completed)
    if handover.action == "release":

        def release() -> bool:
            return store.release(claim, kept=True)

        def released(done: object) -> None:
            if not done:
                heir.lease_lost("release")
                return
            state.wakeups.announce(ident.key_digest, "released")  # C20: a waiter claims it
            heir.emit(signals.claim_released, reason=handover.reason, status=handover.status)

        return deferred.adopt(heir, handover, release, released)

    def release_unanswered() -> bool:
        if store.release_unanswered(ident.key_digest, claim.lock_token):
            return True
        if time.time() < handover.until:  # the claim may still be queued on the server
            raise StoreError("the claim that got no reply has not landed (yet)")
        return False

    def undone(done: object) -> None:
        if done:
            state.wakeups.announce(ident.key_digest, "released")

    return deferred.adopt(heir, handover, release_unanswered, undone)
