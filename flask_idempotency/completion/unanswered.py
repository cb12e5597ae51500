"""A claim that got no reply, undone by a fenced release kept like a settlement (C58).

A claim whose statement got no answer, not even to its cancel (a dead network; see
:mod:`..store.deadline`), may still commit on the server, under a lock token nobody
was handed: every retry would then get 409 ``request-in-progress`` until the lease
lapsed, though no view ran (C11). The request itself answers 503; the release of that
token, by key (its record id was never read), is kept with :func:`.deferred.keep` and
tried again by the renewer's thread until it deletes the record, or until the claim
would have lapsed by itself (two leases after the cut: the statement may have waited
on the server that long before it committed), when a retry takes it over anyway (C13).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..config import EffectiveOptions
from ..records import Claim, Identity
from ..store import StoreError
from . import deferred, spool
from .ownership import Ownership

if TYPE_CHECKING:
    from flask import Flask

    from ..state import AppState
    from ..store import ClaimUnanswered

#: The record id of a claim whose reply never came: not known (the release goes by key).
UNKNOWN_ID = -1


def keep_release(
    state: AppState,
    ident: Identity,
    options: EffectiveOptions,
    started: float,
    app: Flask,
    route: str | None,
    error: ClaimUnanswered,
) -> bool:
    """Keep the fenced release of the claim ``error`` names; ``False`` when the process
    keeps too many settlements already (logged and signalled by :func:`.deferred.keep`)."""
    store = state.store
    until = time.monotonic() + 2 * error.lease
    digest, token = error.key_digest, error.token

    def attempt() -> bool:
        if store.release_unanswered(digest, token):
            return True
        if time.monotonic() < until:  # the claim may still be queued on the server
            raise StoreError("the claim that got no reply has not landed (yet)")
        return False

    def landed(released: object) -> None:
        if released:  # a waiter may claim it now (C20)
            state.wakeups.announce(digest, "released")

    claim = Claim(UNKNOWN_ID, token, 0, "new")
    owner = Ownership(state, ident, claim, options, started, app, route)
    handover = spool.Handover(  # C59: the next process lands it if this one ends first
        "release-unanswered",
        claim,
        ident,
        options.lease,
        route,
        until=time.time() + (until - time.monotonic()),
    )
    return deferred.keep(owner, "release", attempt, landed, size=0, error=error, handover=handover)
