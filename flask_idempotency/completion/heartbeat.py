"""Lease heartbeat: one thread per process renews the lease of every running owner (C44).

A claim holds its key for one lease. Without renewals a view that runs longer
than that is run a second time by a retry that takes the lapsed lease over.
While an owner's view runs, its lease is renewed here at about a third of the
lease, by an UPDATE fenced with its lock token, so a live owner keeps its key
however long it runs (up to ``IDEMPOTENCY_MAX_RUNTIME``), while a dead one (its
process killed) stops renewing and loses the key within one lease.

One thread serves every owner of the process, whatever the number of requests:
each round renews the leases that are due, grouped per store in one short
transaction. The thread and its condition are made on first use, never at
import, so a gevent monkey-patch applied before the first request turns them into
a greenlet and its primitives; a forked child starts with a fresh renewer (the
parent's thread does not exist there). The thread ends when it has had nothing to
renew for a while and starts again with the next owner.

A settlement kept because the store refused it for now (C55, :mod:`.deferred`)
holds its lease the same way (C59): whenever the store answers, its lease is
renewed after those of running views, and the settlement is then tried at once on
the settler's own thread, so a slow one (up to the statement deadline) never
delays a renewal; while it waits, the other kept settlements' leases are still
renewed here, so none lapses. A claim of this process never takes over a record
whose settlement the process keeps (:func:`..process.keeps`). A process that ends
hands the settlements it still keeps on (:meth:`Renewer.hand_over`, the spool of
:mod:`.deferred` and :mod:`.inherit`). Every deadline here is on ``time.monotonic()``.

A renewal that finds the record no longer under the owner's token, or renewals
that fail until the lease must have lapsed, are reported through the
``lease_renewal_failed`` signal (sent from the renewal thread). The owner still
settles as before: its completion is fenced, so a taken-over owner stores
nothing, and in transactional mode its writes are rolled back and its client
gets 409.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import QueuePool

from .. import process
from ..records import Claim
from ..store import DurableStore

log = logging.getLogger("flask_idempotency")

#: After a failed renewal, try again this soon (a fraction of the lease, within bounds).
_RETRY_FRACTION = 0.1
#: A renewer with nothing to renew for this long ends its thread.
_IDLE_EXIT = 10.0

TAKEN_OVER = "taken-over"
STORE_UNAVAILABLE = "store-unavailable"
MAX_RUNTIME = "max-runtime"


#: Settlements one process keeps at most (C55, :mod:`.deferred`).
MAX_PENDING = 1000
#: Bytes of stored bodies one process keeps at most for them.
MAX_PENDING_BYTES = 64 * 1024 * 1024
#: The first retry's pause and the longest between two retries (seconds).
FIRST_PAUSE = 0.05
MAX_PAUSE = 1.0


@dataclasses.dataclass(eq=False)
class Settlement:
    """One kept completion or release, as the renewer retries it."""

    #: ``"complete"`` or ``"release"``.
    action: str
    #: The fenced write; raises while the store is still unreachable.
    attempt: Callable[[], Any]
    #: What follows once it landed, with the write's result (promote, wake, signals).
    landed: Callable[[Any], None]
    #: What follows when it is given up, with the last error.
    gave_up: Callable[[BaseException], None]
    #: Bytes of body it holds.
    size: int
    #: When to stop trying (monotonic).
    deadline: float
    pause: float = FIRST_PAUSE
    #: What another process needs to land it once this one has ended (a
    #: :class:`.spool.Handover`); ``None``: it cannot be handed on.
    handover: Any = None


class Lease:
    """One running owner's lease, as the renewer keeps it (with slots: one is made per
    first execution)."""

    __slots__ = (
        "_reported",
        "claim",
        "confirmed_until",
        "done",
        "held",
        "in_flight",
        "lease",
        "lost",
        "max_runtime",
        "next_due",
        "queued",
        "renewer",
        "report",
        "settlement",
        "started",
        "store",
    )

    def __init__(
        self,
        store: DurableStore,
        claim: Claim,
        lease: float,
        max_runtime: float,
        report: Callable[[str], None],
    ) -> None:
        self.store = store
        self.claim = claim
        self.lease = lease
        self.max_runtime = max_runtime
        self.report = report
        now = time.monotonic()
        self.started = now
        #: Until when the database holds the lease for us, on this process's clock: a
        #: renewal counts from when it was sent, which is no later than the database's now.
        self.confirmed_until = now + lease
        self.next_due = now + lease / 3
        #: Not renewed meanwhile: a row lock in the owner's own transaction holds the key.
        self.held = False
        self.done = False
        self.in_flight = False
        #: Why the lease was lost, once it was (``TAKEN_OVER`` or ``STORE_UNAVAILABLE``).
        self.lost: str | None = None
        self._reported: set[str] = set()
        self.renewer: Renewer | None = None
        #: A settlement the store refused for now, retried on the settler's thread (C55).
        self.settlement: Settlement | None = None
        #: Its settlement waits for, or is in, an attempt on the settler's thread.
        self.queued = False


class Renewer:
    """The per-process renewal thread and the leases it serves."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._leases: set[Lease] = set()
        #: Leases registered without the lock (:meth:`add`) that the thread has not taken
        #: into :attr:`_leases` yet; each entry is taken out by exactly one of the thread
        #: (``popitem``) and :meth:`remove` (``pop``), each one step under the GIL.
        self._incoming: dict[Lease, bool] = {}
        self._thread: threading.Thread | None = None
        #: When the waiting thread wakes up by itself (monotonic); ``None`` while it is not
        #: waiting (it scans every lease before it waits again) or has been woken.
        self._wakes_at: float | None = None
        #: Per store engine, a pool of the renewer's own (used by its thread only).
        self._engines: dict[int, tuple[Engine, Engine]] = {}
        #: Settlements kept (C55): how many, and the bytes of their bodies.
        self.pending = 0
        self.pending_bytes = 0
        #: Settlements that landed or were given up whose callbacks (promotion, wake-up,
        #: signals) have not finished yet: an exit flush waits for them too (C59).
        self.finishing = 0
        #: Kept settlements due for an attempt, tried one at a time on the settler's own
        #: thread: a slow one (up to the statement deadline) never delays a renewal (C59).
        self._to_settle: list[Lease] = []
        self._settler: threading.Thread | None = None

    # -- called by owners ----------------------------------------------------------------

    def add(self, lease: Lease) -> None:
        """Renew ``lease`` from now on.

        Every first execution registers a lease, and nearly every one is removed long
        before its first renewal is due: so registering takes no lock when the thread
        is waiting and wakes no later than the lease is due. The lease waits in
        :attr:`_incoming`, which the thread takes in whenever it wakes (it clears
        :attr:`_wakes_at` first, under the lock, and takes them in after), and which
        :meth:`remove` takes it back out of just as cheaply. Otherwise (no thread, a
        thread between two waits, a lease due sooner) the lock is taken as before.
        """
        self._incoming[lease] = True
        wakes_at = self._wakes_at  # read after the lease is in: see _next_round
        if wakes_at is not None and lease.next_due >= wakes_at and self._thread is not None:
            return
        with self._cond:
            if self._thread is None:
                self._start_thread()
            else:
                self._wake_if_sooner(lease)

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease``; returns once no renewal of it is under way."""
        if self._incoming.pop(lease, False):
            lease.done = True  # the thread never saw it: no renewal of it can be under way
            return
        with self._cond:
            lease.done = True
            self._leases.discard(lease)
            self._wait_idle(lease)

    def registered(self) -> set[Lease]:
        """Every lease renewed from now on (tests, diagnostics)."""
        with self._cond:
            return {*self._leases, *self._incoming}

    def _take_incoming(self) -> None:
        """Take the leases registered without the lock into :attr:`_leases` (under the lock)."""
        incoming = self._incoming
        while incoming:
            try:
                lease = incoming.popitem()[0]
            except KeyError:  # remove() took the last one meanwhile
                break
            if not lease.done:
                self._leases.add(lease)

    def hold(self, lease: Lease) -> None:
        """Pause renewals of ``lease`` (its owner is about to lock or complete its row)."""
        with self._cond:
            lease.held = True
            self._wait_idle(lease)

    def resume(self, lease: Lease) -> None:
        with self._cond:
            lease.held = False
            self._wake_if_sooner(lease)

    def defer(self, lease: Lease, settlement: Settlement) -> bool:
        """Keep ``settlement`` and retry it on this thread until it lands (C55).

        ``False`` when the process already keeps as many settlements, or as many
        bytes, as it may: the caller then drops it, as before deferral existed.
        """
        with self._cond:
            if (
                self.pending >= MAX_PENDING
                or self.pending_bytes + settlement.size > MAX_PENDING_BYTES
            ):
                return False
            self.pending += 1
            self.pending_bytes += settlement.size
            process.keep_token(lease.claim.lock_token)
            lease.settlement = settlement
            lease.done = lease.held = False
            lease.next_due = time.monotonic() + settlement.pause
            self._leases.add(lease)
            lease.renewer = self
            if self._thread is None:
                self._start_thread()
            else:
                self._wake_if_sooner(lease)
        return True

    def flush(self, timeout: float) -> int:
        """Try every kept settlement now and wait up to ``timeout`` for them to land;
        returns how many are still pending (a clean worker shutdown calls this).

        A settlement that landed counts as pending until what follows it (promotion to
        the cache, the wake-up, the signals) has run: the process may end as soon as
        this returns (C59).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            now = time.monotonic()
            for lease in self._leases:
                if lease.settlement is not None:
                    lease.next_due = min(lease.next_due, now)
            self._wakes_at = None
            self._cond.notify_all()
            while (
                (self.pending or self.finishing)
                and time.monotonic() < deadline
                and self._thread is not None
            ):
                if self._to_settle and self._settler is None:
                    lease = self._to_settle.pop(0)  # no settler thread: settle here
                    self._cond.release()
                    try:
                        self._settle(lease)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            return self.pending

    def kept(self) -> list[Settlement]:
        """Every settlement this process keeps now."""
        with self._cond:
            return [lease.settlement for lease in self._leases if lease.settlement is not None]

    def hand_over(self) -> list[Settlement]:
        """Stop keeping every settlement that can be handed on, and return them (the exit
        flush spools them, :mod:`.deferred`): this process no longer tries them, renews
        their leases or refuses their takeover. One in the middle of an attempt may still
        land here; its fenced write then makes the other process's attempt a no-op."""
        handed: list[Settlement] = []
        with self._cond:
            for lease in list(self._leases):
                settlement = lease.settlement
                if settlement is None or settlement.handover is None:
                    continue
                lease.settlement = None
                lease.done = True
                self._leases.discard(lease)
                self.pending -= 1
                self.pending_bytes -= settlement.size
                process.forget_token(lease.claim.lock_token)
                handed.append(settlement)
            self._cond.notify_all()
        return handed

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="idempotency-heartbeat", daemon=True)
        self._thread.start()

    def _wake_if_sooner(self, lease: Lease) -> None:
        """Wake the waiting thread only if ``lease`` is due before it would wake anyway.

        Every first execution registers a lease, and most are due long after the
        thread's next round: waking it for each cost a thread switch and a scan of
        every lease per request. A thread that is not waiting scans all leases
        before it waits again, so it needs no wake-up either.
        """
        wakes_at = self._wakes_at
        if wakes_at is not None and lease.next_due < wakes_at:
            self._wakes_at = None  # one wake-up is enough: it rescans everything
            self._cond.notify_all()

    def _wait_idle(self, lease: Lease) -> None:
        while lease.in_flight:
            self._cond.wait(1.0)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                due = self._next_round()
                if due is None:
                    return
                self._renew(due)
                # Hold no finished owner while waiting for the next round: a lease keeps
                # its store (and its app) alive, and a short-lived app must be freed (C47).
                del due
        except Exception:  # pragma: no cover - a bug here must not pass silently
            log.exception("idempotency: the lease heartbeat stopped")
            with self._cond:
                self._thread = None

    def _next_round(self) -> list[Lease] | None:
        """Wait for the leases that are due; ``None`` when idle long enough to stop."""
        with self._cond:
            idle_since = time.monotonic()
            while True:
                # After _wakes_at was cleared (add() then takes the lock) and before it is
                # set again: a lease add() left without waking this thread is taken in here.
                self._take_incoming()
                now = time.monotonic()
                active = [lease for lease in self._leases if not lease.held]
                if not self._leases and now - idle_since >= _IDLE_EXIT:
                    self._thread = None
                    self._close_engines()
                    return None
                if self._leases:
                    idle_since = now
                due = [lease for lease in active if lease.next_due <= now]
                if due:
                    for lease in due:
                        lease.in_flight = True
                    return due
                soonest = min((lease.next_due - now for lease in active), default=_IDLE_EXIT)
                wait = max(0.001, soonest)
                del active  # see _run: no lease is held across the wait
                self._wakes_at = now + wait
                self._cond.wait(wait)
                self._wakes_at = None

    def _renew(self, due: list[Lease]) -> None:
        """Renew the due leases: running views' first, then those of kept settlements.

        A kept settlement's lease is renewed exactly like a running view's, whenever
        the store answers (C59): its record then never lapses while this process keeps
        it, however long the outage before. Each renewed one is handed to the settler
        for an attempt at once, with no back-off left to wait out.
        """
        settling = [lease for lease in due if lease.settlement is not None]
        running = [lease for lease in due if lease.settlement is None]
        reports: list[tuple[Lease, str]] = []
        now = time.monotonic()
        stopping = [lease for lease in running if now - lease.started >= lease.max_runtime]
        groups: dict[tuple[int, float], list[Lease]] = {}
        for lease in running:
            if lease not in stopping:
                groups.setdefault((id(lease.store), lease.lease), []).append(lease)
        outcomes = self._renew_groups(groups)
        kept: dict[tuple[int, float], list[Lease]] = {}
        for lease in settling:
            kept.setdefault((id(lease.store), lease.lease), []).append(lease)
        settled = self._renew_groups(kept)
        with self._cond:
            for lease in stopping:
                self._leases.discard(lease)
                reports.append((lease, MAX_RUNTIME))
            now = time.monotonic()
            for lease, ok in outcomes.items():
                if ok:
                    lease.next_due = _next_renewal(lease, now)
                    continue
                if ok is False and not lease.done:
                    lease.lost = TAKEN_OVER
                    self._leases.discard(lease)  # nothing of ours left to renew
                    reports.append((lease, TAKEN_OVER))
                    continue
                lease.next_due = now + _retry_step(lease)
                if now >= lease.confirmed_until and not lease.done:
                    lease.lost = lease.lost or STORE_UNAVAILABLE
                    reports.append((lease, STORE_UNAVAILABLE))
            for lease, ok in settled.items():
                settlement = lease.settlement
                if settlement is None:  # it landed on the settler's thread meanwhile
                    continue
                # Renewed: try it now. Not renewed (False): no longer in progress under
                # our token, maybe because an earlier try of ours landed; the fenced
                # attempt tells which. No answer: try again once the store answers,
                # unless its time is up (the attempt then gives it up).
                lease.next_due = _next_renewal(lease, now) if ok else now + _retry_step(lease)
                if (ok is not None or now >= settlement.deadline) and not lease.queued:
                    lease.queued = True
                    self._to_settle.append(lease)
            if self._to_settle and self._settler is None:
                self._start_settler()
            for lease in due:
                lease.in_flight = False
            self._cond.notify_all()
        for lease, reason in reports:
            if reason not in lease._reported and not lease.done:
                lease._reported.add(reason)
                lease.report(reason)

    def _renew_groups(
        self, groups: dict[tuple[int, float], list[Lease]]
    ) -> dict[Lease, bool | None]:
        """Renew each group in one short transaction: renewed, not ours, or no answer."""
        outcomes: dict[Lease, bool | None] = {}
        for leases in groups.values():
            sent = time.monotonic()
            store = leases[0].store
            try:
                renewed = store.renew(
                    [lease.claim for lease in leases], leases[0].lease, engine=self._engine(store)
                )
            except Exception as exc:  # StoreError, or a pool that cannot hand out a connection
                log.debug("idempotency: lease renewal failed: %s", exc)
                outcomes.update((lease, None) for lease in leases)
                continue
            for lease in leases:
                outcomes[lease] = lease.claim.record_id in renewed
                if outcomes[lease]:
                    lease.confirmed_until = sent + lease.lease
        return outcomes

    def _start_settler(self) -> None:
        """Start the settler's thread (under the lock); at interpreter exit, where a
        new thread may be refused, :meth:`flush` settles on its own thread instead."""
        settler = threading.Thread(
            target=self._run_settler, name="idempotency-settler", daemon=True
        )
        try:
            settler.start()
        except RuntimeError as exc:  # "can't create new thread at interpreter shutdown"
            log.debug("idempotency: no settler thread now (%s)", exc)
            return
        self._settler = settler

    def _run_settler(self) -> None:
        """The settler's thread: attempt each queued settlement once, in turn."""
        try:
            while True:
                with self._cond:
                    if not self._to_settle:
                        self._settler = None
                        return
                    lease = self._to_settle.pop(0)
                self._settle(lease)
        except Exception:  # pragma: no cover - a bug here must not pass silently
            log.exception("idempotency: the settler stopped")
            with self._cond:
                self._settler = None

    def _settle(self, lease: Lease) -> None:
        """Try one kept settlement; keep it (its lease renewed) while the store refuses."""
        settlement = lease.settlement
        assert settlement is not None
        result: Any = None
        error: BaseException | None = None
        try:
            result = settlement.attempt()
        except Exception as exc:  # StoreError, or a pool that cannot hand out a connection
            error = exc
        with self._cond:
            lease.queued = False
            now = time.monotonic()
            if lease.settlement is not settlement:
                # Handed on meanwhile (hand_over): the other process lands it, unless
                # this try did; then what follows it runs here.
                if error is not None:
                    return
            elif error is not None and now < settlement.deadline:
                settlement.pause = min(settlement.pause * 2, MAX_PAUSE)
                lease.next_due = min(lease.next_due, now + settlement.pause)
                self._wakes_at = None
                self._cond.notify_all()
                return
            else:
                lease.settlement = None
                lease.done = True
                self._leases.discard(lease)
                self.pending -= 1
                self.pending_bytes -= settlement.size
            self.finishing += 1
        try:
            if error is None:
                settlement.landed(result)
            else:
                settlement.gave_up(error)
        finally:
            process.forget_token(lease.claim.lock_token)
            with self._cond:
                self.finishing -= 1
                self._cond.notify_all()

    def _engine(self, store: DurableStore) -> Engine:
        """The store's engine with a pool of the renewer's own.

        In transactional mode each running view holds a pooled connection for its
        whole duration; with every connection held, a renewal sharing that pool
        would wait for one until the leases it should renew had lapsed. The copy
        keeps the original pool's connect function, arguments and events.
        """
        engine = store.engine
        if not isinstance(engine.pool, QueuePool):
            return engine  # SQLite's pools: nothing to starve, and a copy may be another database
        held = self._engines.get(id(engine))
        if held is None or held[0] is not engine:
            own = process.own_engine(create_engine(engine.url, pool=engine.pool.recreate()))
            held = self._engines[id(engine)] = (engine, own)
        return held[1]

    def _close_engines(self) -> None:
        engines, self._engines = self._engines, {}
        for _, own in engines.values():
            own.dispose()


def _next_renewal(lease: Lease, now: float) -> float:
    """When to renew a lease just renewed: a third of a lease after the renewal was sent.

    Counted from the sending, as :attr:`Lease.confirmed_until` is, not from the answer:
    a store that takes ``d`` to answer would otherwise space the extensions a third of a
    lease plus ``d`` apart, and a slow answer followed by a late one could lapse a lease
    of a live owner. Never sooner than a retry step from now: a store slower than a third
    of a lease is asked again at that pace, not back to back.
    """
    return max(lease.confirmed_until - lease.lease * 2 / 3, now + _retry_step(lease))


def _retry_step(lease: Lease) -> float:
    """After a renewal with no answer, try again this soon."""
    return max(0.02, min(1.0, lease.lease * _RETRY_FRACTION))


_renewer: Renewer | None = None
#: Renewers a forked child inherited: kept referenced, never used, so that collecting
#: them never closes a connection the parent still uses.
_inherited: list[Renewer] = []


def renewer() -> Renewer:
    """This process's renewer, made on first use and afresh in a forked child."""
    global _renewer
    current = _renewer
    if current is None or current.pid != os.getpid():
        if current is not None:
            _inherited.append(current)
        current = _renewer = Renewer()
    return current


def reset_after_fork() -> None:
    """Forget the parent's renewer in a forked child: its thread does not exist there."""
    global _renewer
    if _renewer is not None:
        _inherited.append(_renewer)
    _renewer = None


process.at_fork(reset_after_fork)


def start(
    store: DurableStore,
    claim: Claim,
    lease: float,
    max_runtime: float,
    report: Callable[[str], None],
) -> Lease:
    """Renew ``claim``'s lease from now on, until :func:`stop`."""
    entry = Lease(store, claim, lease, max_runtime, report)
    entry.renewer = renewer()
    entry.renewer.add(entry)
    return entry


def _of(lease: Lease) -> Renewer:
    return lease.renewer if lease.renewer is not None else renewer()


def stop(lease: Lease) -> None:
    _of(lease).remove(lease)


def hold(lease: Lease) -> None:
    _of(lease).hold(lease)


def resume(lease: Lease) -> None:
    _of(lease).resume(lease)
