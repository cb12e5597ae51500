"""Settlements the store refused for now, kept and retried while the owner's process lives (C55).

A view ran and its client has its answer; storing that answer, or releasing the
key, then failed because the database could not be reached: a primary failing
over, a restart, a network cut. Dropped, the record would stay in progress until
its lease lapsed, and the next retry would take it over and run the view a
second time. Kept instead, its lease is renewed by the heartbeat's thread like a
running view's, and the settlement is retried on a settler thread after each
renewal (C59; :mod:`.heartbeat`), until the store accepts the write, the record turns out to be
another owner's (the write is fenced by the lock token, C14), or
``IDEMPOTENCY_MAX_RUNTIME`` has passed since the owner began. A duplicate
arriving in between parks or gets 409 as for any key in flight, and is woken by
the completion when it lands.

Only a process that dies with settlements pending leaves the window open: its
records lapse after one lease and the next retry runs the view again
(docs/guarantees.md). Memory is bounded: a process keeps at most
:data:`MAX_PENDING` settlements and :data:`MAX_PENDING_BYTES` of bodies; past
that a settlement is dropped as before, with a log line and the
``settlement_deferred`` signal (outcome ``"refused"``). A clean shutdown
(``atexit``, which gunicorn's workers run) gives pending ones
:data:`FLUSH_TIMEOUT` seconds to land.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .. import signals
from ..records import Claim, Identity
from ..store import StoreError
from . import heartbeat
from .heartbeat import MAX_PENDING, MAX_PENDING_BYTES, Settlement

if TYPE_CHECKING:
    from ..state import AppState

__all__ = ["MAX_PENDING", "MAX_PENDING_BYTES", "Owner", "flush", "keep", "pending"]

log = logging.getLogger("flask_idempotency")

#: How long a clean shutdown waits for pending settlements to land.
FLUSH_TIMEOUT = 10.0


class Owner(Protocol):
    """What a deferred settlement needs of its owner: a request's or a ``once()`` run's."""

    @property
    def state(self) -> AppState: ...

    @property
    def ident(self) -> Identity: ...

    @property
    def started(self) -> float: ...

    @property
    def claim(self) -> Claim: ...

    @property
    def lease_seconds(self) -> float: ...

    def emit(self, signal: Any, **extra: Any) -> None: ...

    def lease_lost(self, action: str) -> None: ...

    def report_lease(self, reason: str) -> None: ...


def keep(
    owner: Owner,
    action: str,
    attempt: Callable[[], Any],
    landed: Callable[[Any], object],
    *,
    size: int,
    error: StoreError,
) -> bool:
    """Keep a settlement the store refused (``error``) and retry it in the background.

    ``attempt`` is the fenced write; ``landed(result)`` what follows it once it
    succeeded. ``False`` when the process keeps too many already: the settlement
    is dropped, as before deferral existed (logged, signalled).
    """
    digest = owner.ident.key_digest[:16]
    settings = owner.state.settings
    owner.emit(signals.store_error, tier="database", error=str(error), action=action)

    def on_landed(result: Any) -> None:
        log.info("idempotency: the deferred %s of %s landed", action, digest)
        owner.emit(signals.settlement_deferred, action=action, outcome="landed", pending=pending())
        landed(result)

    def on_gave_up(last: BaseException) -> None:
        log.error(
            "idempotency: gave up the deferred %s of %s at IDEMPOTENCY_MAX_RUNTIME: %s",
            action,
            digest,
            last,
        )
        owner.emit(signals.settlement_deferred, action=action, outcome="gave-up", pending=pending())

    settlement = Settlement(
        action,
        attempt,
        on_landed,
        on_gave_up,
        size=size,
        deadline=owner.started + settings.max_runtime,
    )
    entry = heartbeat.Lease(
        owner.state.store,
        owner.claim,
        owner.lease_seconds,
        settings.max_runtime,
        owner.report_lease,
    )
    entry.started = owner.started
    if heartbeat.renewer().defer(entry, settlement):
        _flush_at_exit()
        log.warning(
            "idempotency: could not %s %s now (%s); this process retries it in the background",
            action,
            digest,
            error,
        )
        owner.emit(
            signals.settlement_deferred, action=action, outcome="deferred", pending=pending()
        )
        return True
    log.error(
        "idempotency: could not %s %s (%s), and this process already keeps as many deferred"
        " settlements as it may; the key runs again once its lease lapses",
        action,
        digest,
        error,
    )
    owner.emit(signals.settlement_deferred, action=action, outcome="refused", pending=pending())
    return False


def pending() -> int:
    """How many settlements this process keeps now."""
    return heartbeat.renewer().pending


def flush(timeout: float = FLUSH_TIMEOUT) -> int:
    """Try every pending settlement now; wait up to ``timeout``; how many are left."""
    renewer = heartbeat.renewer()
    if not renewer.pending:
        return 0
    left = renewer.flush(timeout)
    if left:
        log.error(
            "idempotency: %d deferred settlement(s) had not landed when this process ended;"
            " their keys run again once their lease lapses",
            left,
        )
    return left


_registered: list[bool] = []


def _flush_at_exit() -> None:
    if not _registered:
        _registered.append(True)
        atexit.register(flush)
