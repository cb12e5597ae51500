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
or deploy, on SIGTERM) first writes each pending one to the host's spool
(:mod:`.spool`) under a name that keeps it this process's while it lives, then gives
them :data:`FLUSH_TIMEOUT` seconds to land here, with their promotion, wake-up and
signals (a landed one's file is removed), and hands the rest on; the next process of
the app on the host adopts them (:mod:`.inherit`), also when this one was killed in
the middle of that wait. Each is a write fenced by its key and lock token, which
anyone may apply later and at most one application of which changes anything. Only
a process killed outright before its exit (SIGKILL, the OOM killer) or a host that
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
import threading
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
    where = spool_path(owner.state) if handover is not None else None
    slot = None if where is None or handover is None else _Spooled(where, handover)

    def on_landed(result: Any) -> None:
        if slot is not None:
            slot.finished()  # before what follows: the write is what must not be redone
        # ``None`` / ``False``: another owner's record stands, and the write changed
        # nothing (C58: "landed" only when it did; what follows logs the lost lease).
        outcome = "fenced" if result is None or result is False else "landed"
        if outcome == "landed":
            log.info("idempotency: the deferred %s of %s landed", action, digest)
        owner.emit(signals.settlement_deferred, action=action, outcome=outcome, pending=pending())
        landed(result)

    def on_gave_up(last: BaseException) -> None:
        if slot is not None:
            slot.finished()
        log.error(
            "idempotency: gave up the deferred %s of %s at IDEMPOTENCY_MAX_RUNTIME: %s",
            action,
            digest,
            last,
        )
        owner.emit(signals.settlement_deferred, action=action, outcome="gave-up", pending=pending())

    settlement = Settlement(
        action, attempt, on_landed, on_gave_up, size=size, deadline=deadline, handover=slot
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
    """Hand on what is pending, then try it for up to ``timeout`` (:data:`FLUSH_TIMEOUT`);
    how many are left and dropped.

    Each settlement that can be handed on is written to the spool first, under a name
    that keeps it this process's while it lives; one that lands meanwhile has its file
    removed, and the rest are handed on to any process when the wait is over. A process
    killed during the wait (a graceful timeout shorter than the flush, a SIGKILL)
    therefore drops nothing: its files are taken once it is gone.
    """
    renewer = heartbeat.renewer()
    if not renewer.pending:
        return 0
    for settlement in renewer.kept():
        if isinstance(settlement.handover, _Spooled):
            settlement.handover.write(settlement)
    left = renewer.flush(FLUSH_TIMEOUT if timeout is None else timeout)
    if left:
        handed = 0
        for settlement in renewer.hand_over():
            handed += settlement.handover.publish()
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


class _Spooled:
    """A kept settlement's way to the spool: its file, once written at exit."""

    def __init__(self, where: Path, handover: spool.Handover) -> None:
        self.where = where
        self.handover = handover
        self.file: Path | None = None
        self.done = False
        self._lock = threading.Lock()

    def write(self, settlement: Settlement) -> None:
        """Write it to the spool, still this process's (an ERROR line if it cannot be)."""
        handover = dataclasses.replace(
            self.handover, give_up_at=time.time() + (settlement.deadline - time.monotonic())
        )
        with self._lock:
            if self.done or self.file is not None:
                return
            try:
                directory = spool.directory(self.where.parent, self.where.name)
                self.file = spool.write(directory, handover, leaving=True)
            except OSError as exc:
                log.error(
                    "idempotency: could not write the deferred %s of %s to the spool %s (%s);"
                    " its key runs again once its lease lapses if this process ends first",
                    settlement.action,
                    handover.ident.key_digest[:16],
                    self.where,
                    exc,
                )

    def publish(self) -> int:
        """Hand it on to any process now; 1 if it was, 0 if it had no file."""
        with self._lock:
            if self.file is None or self.done:
                return 0
            try:
                self.file = spool.publish(self.file)
            except OSError as exc:
                log.error("idempotency: could not hand on %s (%s)", self.file, exc)
                return 0
            return 1

    def finished(self) -> None:
        """It landed or was given up here: no other process must try it."""
        with self._lock:
            self.done = True
            if self.file is not None:
                spool.remove(self.file)
                self.file = None


_registered: list[bool] = []


def _flush_at_exit() -> None:
    if not _registered:
        _registered.append(True)
        atexit.register(flush)
