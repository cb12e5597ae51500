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

A process that ends does not drop them (C59). A clean shutdown (``atexit``, which
gunicorn's workers run when ``--max-requests`` recycles them, on a graceful restart
or deploy, on SIGTERM) gives pending ones :data:`FLUSH_TIMEOUT` seconds to land,
with their promotion, wake-up and signals; those still pending then are written to
the host's spool (:mod:`.spool`), and the next process of the app on the host
adopts them (:mod:`.inherit`): each is a write fenced by its key and lock token,
which anyone may apply later and at most one application of which changes
anything. Only a process killed outright (SIGKILL, the OOM killer) or a host that
dies with its spool leaves the window open: those records lapse after one lease
and the next retry runs the view again (docs/guarantees.md). Memory is bounded: a
process keeps at most :data:`MAX_PENDING` settlements and
:data:`MAX_PENDING_BYTES` of bodies; past that a settlement is dropped as before,
with a log line and the ``settlement_deferred`` signal (outcome ``"refused"``).

Deadlines are on the monotonic clock, the renewer's: an owner's start, taken on
``time.perf_counter()`` for the signals' durations, is carried over as time elapsed,
never compared across the two clocks (the platform may run them apart).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .. import signals
from ..records import Claim, Identity
from ..store import StoreError
from . import heartbeat, spool
from .heartbeat import MAX_PENDING, MAX_PENDING_BYTES, Settlement

if TYPE_CHECKING:
    from ..state import AppState

__all__ = [
    "MAX_PENDING",
    "MAX_PENDING_BYTES",
    "Owner",
    "adopt",
    "begun",
    "flush",
    "keep",
    "pending",
]

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
    handover: spool.Handover | None = None,
) -> bool:
    """Keep a settlement the store refused (``error``) and retry it in the background.

    ``attempt`` is the fenced write; ``landed(result)`` what follows it once it
    succeeded; ``handover`` what another process needs to land it once this one has
    ended (without it, the settlement is dropped at exit). ``False`` when the process
    keeps too many already: the settlement is dropped, as before deferral existed
    (logged, signalled).
    """
    owner.emit(signals.store_error, tier="database", error=str(error), action=action)
    deadline = begun(owner.started) + owner.state.settings.max_runtime
    if _keep(owner, action, attempt, landed, size, deadline, handover):
        log.warning(
            "idempotency: could not %s %s now (%s); this process retries it in the background",
            action,
            owner.ident.key_digest[:16],
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
        owner.ident.key_digest[:16],
        error,
    )
    owner.emit(signals.settlement_deferred, action=action, outcome="refused", pending=pending())
    return False


def adopt(
    owner: Owner,
    handover: spool.Handover,
    attempt: Callable[[], Any],
    landed: Callable[[Any], object],
) -> bool:
    """Keep a settlement another process handed on (:mod:`.inherit`): its lease renewed
    and its write tried like one of this process's own; ``False`` when this process keeps
    as many as it may already."""
    deadline = time.monotonic() + (handover.give_up_at - time.time())
    size = len(handover.response.body) if handover.response is not None else 0
    action = "complete" if handover.action == "complete" else "release"
    return _keep(owner, action, attempt, landed, size, deadline, handover)


def begun(started: float) -> float:
    """An owner's start (``time.perf_counter()``) on the monotonic clock, as time elapsed."""
    return time.monotonic() - (time.perf_counter() - started)


def _keep(
    owner: Owner,
    action: str,
    attempt: Callable[[], Any],
    landed: Callable[[Any], object],
    size: int,
    deadline: float,
    handover: spool.Handover | None,
) -> bool:
    digest = owner.ident.key_digest[:16]
    settings = owner.state.settings

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

    where = spool_path(owner.state) if handover is not None else None
    settlement = Settlement(
        action,
        attempt,
        on_landed,
        on_gave_up,
        size=size,
        deadline=deadline,
        handover=None if where is None else (where, handover, deadline),
    )
    entry = heartbeat.Lease(
        owner.state.store,
        owner.claim,
        owner.lease_seconds,
        settings.max_runtime,
        owner.report_lease,
    )
    entry.started = deadline - settings.max_runtime
    if heartbeat.renewer().defer(entry, settlement):
        _flush_at_exit()
        return True
    return False


def pending() -> int:
    """How many settlements this process keeps now."""
    return heartbeat.renewer().pending


def flush(timeout: float | None = None) -> int:
    """Try every pending settlement now; wait up to ``timeout`` (:data:`FLUSH_TIMEOUT`);
    hand on to the spool those that could not land; how many are left."""
    renewer = heartbeat.renewer()
    if not renewer.pending:
        return 0
    left = renewer.flush(FLUSH_TIMEOUT if timeout is None else timeout)
    if left:
        handed = _spool(renewer.hand_over())
        if handed:
            log.warning(
                "idempotency: %d deferred settlement(s) had not landed when this process"
                " ended; they are written to the host's spool (IDEMPOTENCY_SPOOL_DIR), and the"
                " next process of this app on this host lands them",
                handed,
            )
        left = renewer.pending
    if left:
        log.error(
            "idempotency: %d deferred settlement(s) had not landed when this process ended;"
            " their keys run again once their lease lapses",
            left,
        )
    return left


def spool_path(state: AppState) -> Path | None:
    """The host's spool directory of ``state``'s store, or ``None`` when there is none:
    ``IDEMPOTENCY_SPOOL_DIR = False``, or a database only this process sees (SQLite in
    memory)."""
    setting = state.settings.spool_dir
    if setting is False:
        return None
    store = state.store
    url = store.engine.url
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        return None
    root = Path(setting) if isinstance(setting, str) else spool.default_root()
    key = spool.store_key(url.render_as_string(hide_password=True), store.table.fullname)
    return root / key


def _spool(settlements: list[Settlement]) -> int:
    """Write each settlement to its store's spool; how many were written (the others are
    logged with the reason and dropped)."""
    written = 0
    for settlement in settlements:
        where, handover, deadline = settlement.handover
        handover = dataclasses.replace(
            handover, give_up_at=time.time() + (deadline - time.monotonic())
        )
        try:
            spool.write(spool.directory(where.parent, where.name), handover)
        except OSError as exc:
            log.error(
                "idempotency: could not write the deferred %s of %s to the spool %s (%s);"
                " its key runs again once its lease lapses",
                settlement.action,
                handover.ident.key_digest[:16],
                where,
                exc,
            )
            continue
        written += 1
    return written


_registered: list[bool] = []


def _flush_at_exit() -> None:
    if not _registered:
        _registered.append(True)
        atexit.register(flush)
