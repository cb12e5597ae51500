"""Parking duplicates until the original finishes (CONTRACT C10–C12).

A parked request registers an event under the record's digest *before* it
re-reads the record, so a completion that lands between the read and the wait
cannot be missed (race X1). Whoever finishes a record sets the events of the
same digest in this process at once; other processes learn of it through a
cross-process channel when one is configured (Redis pub/sub) and, always, by
polling the store on a bounded back-off, so a lost message costs at most one
poll interval. A wake-up is only a hint: the waiter always re-reads the store.

Messages go only where a waiter is: a parked request first records, on the
channel, that it expects its digest (then re-reads); whoever settles the record
checks for that, after its durable commit, and publishes only if it is there.
Either the check sees the mark and the waiter gets the message, or the mark came
later and the waiter's re-read sees the settled record. A completion nobody
waits for, the usual case, wakes no listener in any process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

from ..logs import ThrottledLog

T = TypeVar("T")
#: How long a waiter registered without a wait of its own is expected by other processes.
_DEFAULT_EXPECT = 30.0


class TooManyWaiters(Exception):
    """This process already parks as many requests as it may (R86)."""


class Parked:
    """One parked request's wake-up event."""

    __slots__ = ("_event", "cross_process_live")

    def __init__(self) -> None:
        self._event = threading.Event()
        #: Whether other processes' completions reach this waiter as messages (else poll faster).
        self.cross_process_live = False

    def wait(self, timeout: float) -> bool:
        """Sleep until woken or ``timeout`` passes; ``True`` if woken. Re-arms itself."""
        woken = self._event.wait(max(0.0, timeout))
        self._event.clear()
        return woken

    def wake(self) -> None:
        self._event.set()


class CrossProcessChannel(Protocol):
    """What the hub needs from a channel that reaches other processes (the Redis tier)."""

    def ensure_listening(self, hub: WakeupHub) -> bool:
        """Start listening if needed; ``True`` once the subscription is confirmed."""

    def expect(self, key_digest: str, seconds: float) -> bool:
        """Ask whoever settles ``key_digest`` in the next ``seconds`` to publish it; ``True``
        once the request is on record. Never raises."""

    def publish(self, key_digest: str, event: str) -> None:
        """Tell the processes that expect ``key_digest`` that it finished; never raises."""


class WakeupHub:
    """Parked requests of this process, by record digest."""

    def __init__(self, max_waiters: int = 256) -> None:
        self._max_waiters = max_waiters
        self._waiters: dict[str, set[Parked]] = {}
        self._count = 0
        self._lock = threading.Lock()
        self.channel: CrossProcessChannel | None = None
        #: One line for a run of requests refused a place to wait, not one each.
        self.refusals_log = ThrottledLog()

    @contextmanager
    def parked(self, key_digest: str, wait: float = _DEFAULT_EXPECT) -> Iterator[Parked]:
        """Register a waiter for ``key_digest`` for the duration of the block (up to ``wait``
        seconds).

        The caller re-reads the record *inside* the block, after registering. With a
        cross-process channel the waiter is live only once this process listens and the
        channel has recorded that a waiter expects ``key_digest``: completions publish
        only then, so a completion nobody waits for wakes no process (issue 11).
        """
        parked = Parked()
        with self._lock:
            if self._count >= self._max_waiters:
                raise TooManyWaiters
            self._waiters.setdefault(key_digest, set()).add(parked)
            self._count += 1
        try:
            channel = self.channel
            if channel is not None:
                parked.cross_process_live = channel.ensure_listening(self) and channel.expect(
                    key_digest, wait
                )
            yield parked
        finally:
            with self._lock:
                waiters = self._waiters.get(key_digest)
                if waiters is not None:
                    waiters.discard(parked)
                    if not waiters:
                        del self._waiters[key_digest]
                self._count -= 1

    def wake(self, key_digest: str) -> None:
        """Wake every waiter of ``key_digest`` in this process."""
        with self._lock:
            waiters = list(self._waiters.get(key_digest, ()))
        for parked in waiters:
            parked.wake()

    def wake_all(self) -> None:
        """Wake every waiter, e.g. after the channel reconnected and messages may be lost."""
        with self._lock:
            waiters = [p for group in self._waiters.values() for p in group]
        for parked in waiters:
            parked.wake()

    def announce(self, key_digest: str, event: str) -> None:
        """A record finished (``done``) or was released: wake local waiters, then tell the rest."""
        self.wake(key_digest)
        if self.channel is not None:
            self.channel.publish(key_digest, event)

    @property
    def parked_count(self) -> int:
        return self._count


class PollSchedule:
    """Bounded exponential back-off for re-reading the store while parked (C10)."""

    def __init__(self, first: float = 0.025, factor: float = 2.0, cap: float = 0.5) -> None:
        self._next = first
        self._factor = factor
        self._cap = cap

    def next(self) -> float:
        interval = self._next
        self._next = min(self._cap, self._next * self._factor)
        return interval


def wait_for_owner(
    hub: WakeupHub,
    key_digest: str,
    outcome: T,
    *,
    wait: float,
    recheck: Callable[[], T],
    in_flight: Callable[[T], bool],
) -> T:
    """Park until the owner of ``key_digest`` settles, then return the fresh outcome (C10–C12).

    Registered first, checked second: a completion between the caller's last read
    and the wait still wakes us (X1). Each wake-up or poll tick calls ``recheck``;
    the loop ends when ``in_flight`` says the record is no longer running, or when
    ``wait`` seconds have passed. With pub/sub confirmed, polling is only the
    safety net for a lost message. Requests and ``once()`` share this loop.
    """
    deadline = time.monotonic() + wait
    try:
        with hub.parked(key_digest, wait) as parked:
            live = parked.cross_process_live
            polls = PollSchedule(first=0.1 if live else 0.025, cap=1.0 if live else 0.5)
            while True:
                outcome = recheck()
                if not in_flight(outcome):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                parked.wait(min(remaining, polls.next()))
    except TooManyWaiters:
        hub.refusals_log.warning(
            "idempotency: too many parked requests in this process (IDEMPOTENCY_MAX_WAITERS"
            " = %d); a duplicate was answered at once instead of waiting",
            hub._max_waiters,
        )
    return outcome
