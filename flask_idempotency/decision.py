"""The decision, as plain code: what a lookup's outcome means for one request (CONTRACT §3).

A protected request and a ``once()`` call both look their key up (cache first,
then the durable claim) and end in exactly one of:

========== ================================================================
Own        the claim is ours (new, an expired record replaced, or a lapsed
           lease taken over): run the work
Replay     a completed record with the same fingerprint: answer with it (C9)
KeyReused  the record was made by another request (fingerprint differs, C7)
InProgress still running elsewhere after waiting up to ``wait`` (C11)
Unavailable the durable store failed and no cached copy could answer (C25)
========== ================================================================

On the way, a record still in flight under the same fingerprint makes the
request park (C10): the caller's ``park`` waits for a wake-up or a poll tick
and re-checks through the same lookup until the outcome changes or the wait
runs out. A re-check the store cannot answer keeps the request parked: its
original still runs, or its owner keeps the completion until the store is back
(C55). Nothing here knows Flask, SQL, Redis or a dialect: the lookup,
the parking and the cache fallback are handed in, so the state machine is
tested on its own (tests/test_decision.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .records import IN_PROGRESS, Claim, Completed, Record
from .store import StoreError

#: What one lookup can find: our claim, a completed record, or someone else's record.
Outcome = Claim | Completed | Record
#: ``look_up()`` → the outcome and where it came from (``"cache"`` or ``"database"``).
LookUp = Callable[[], tuple[Outcome, str]]
#: ``park(record, recheck, in_flight)`` → the outcome once the original finished or the
#: wait ran out; ``recheck`` looks the key up again, ``in_flight`` says whether to go on.
Park = Callable[[Record, Callable[[], Outcome], Callable[[Outcome], bool]], Outcome]


@dataclasses.dataclass(frozen=True)
class Own:
    """The claim is ours; ``claim.how`` says whether it was new, replaced or taken over."""

    claim: Claim

    @property
    def taken_over(self) -> bool:
        return self.claim.how == "taken_over"


@dataclasses.dataclass(frozen=True)
class Replay:
    """Answer with the stored outcome (C9); ``source`` is ``"cache"`` or ``"database"``."""

    completed: Completed
    source: str


@dataclasses.dataclass(frozen=True)
class KeyReused:
    """The key belongs to another request: 422, the stored record untouched (C7)."""

    found: Completed | Record


@dataclasses.dataclass(frozen=True)
class InProgress:
    """The original still runs and the wait is over: 409 with Retry-After (C11)."""

    record: Record


@dataclasses.dataclass(frozen=True)
class Unavailable:
    """The durable store could not answer and nothing cached could (C25)."""

    error: StoreError


Verdict = Own | Replay | KeyReused | InProgress | Unavailable


def in_flight(outcome: Outcome, fingerprint: str) -> bool:
    """Whether ``outcome`` is this request's original, still running: worth waiting for."""
    return (
        type(outcome) is Record
        and outcome.state == IN_PROGRESS
        and outcome.fingerprint == fingerprint
    )


def judge(outcome: Outcome, fingerprint: str, source: str) -> Own | Replay | KeyReused | InProgress:
    """The verdict on one outcome, once any waiting is over."""
    if isinstance(outcome, Claim):
        return Own(outcome)
    if outcome.fingerprint != fingerprint:
        return KeyReused(outcome)
    if isinstance(outcome, Completed):
        return Replay(outcome, source)
    return InProgress(outcome)


def decide(
    look_up: LookUp,
    fingerprint: str,
    *,
    park: Park | None = None,
    cached: Callable[[], Completed | None] | None = None,
) -> Verdict:
    """Look the key up, park while the original runs (if ``park``), and judge the outcome.

    ``cached`` answers when the durable store fails: a completed copy still in the
    cache replays (C25); without one the verdict is :class:`Unavailable`.
    """
    source = "database"

    def recheck() -> Outcome:
        nonlocal source
        outcome, source = look_up()
        return outcome

    try:
        outcome = recheck()
        if park is not None and in_flight(outcome, fingerprint):
            assert isinstance(outcome, Record)
            last: Outcome = outcome

            def recheck_parked() -> Outcome:
                # The store gone while we wait (a failover): as far as we know the original
                # still runs, and its owner keeps its completion until the store is back
                # (C55), so go on waiting for its wake-up instead of answering 503.
                nonlocal last
                try:
                    last = recheck()
                except StoreError:
                    pass
                return last

            outcome = park(outcome, recheck_parked, lambda found: in_flight(found, fingerprint))
    except StoreError as exc:
        found = cached() if cached is not None else None
        if found is None:
            return Unavailable(exc)
        outcome, source = found, "cache"
    return judge(outcome, fingerprint, source)
