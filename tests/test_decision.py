"""The decision on its own: lookup outcome → verdict, with no Flask, SQL or Redis (CONTRACT §3).

The lookup, the parking and the cache fallback are plain functions here, so each
branch of the state machine (C7, C9, C10–C12, C25) is checked without a server.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from flask_idempotency.decision import (
    InProgress,
    KeyReused,
    Outcome,
    Own,
    Replay,
    Unavailable,
    decide,
    in_flight,
    judge,
)
from flask_idempotency.records import (
    COMPLETED,
    IN_PROGRESS,
    Claim,
    Completed,
    Record,
    StoredResponse,
)
from flask_idempotency.store import StoreError

FP = "f" * 64
OTHER = "0" * 64
RESPONSE = StoredResponse(201, (("Content-Type", "application/json"),), b'{"id":1}')


def record(*, fingerprint: str = FP, state: str = IN_PROGRESS, lease_ms: int = 30_000) -> Record:
    return Record(
        id=1,
        key_digest="d" * 64,
        scope="s",
        fingerprint=fingerprint,
        method="POST",
        path="/p",
        state=state,
        lock_token="t" if state == IN_PROGRESS else None,
        created_at_ms=1_000,
        expires_at_ms=90_000_000,
        lease_expires_at_ms=1_000 + lease_ms if state == IN_PROGRESS else None,
        completed_at_ms=None if state == IN_PROGRESS else 2_000,
        response=None if state == IN_PROGRESS else RESPONSE,
        now_ms=1_000,
    )


def completed(fingerprint: str = FP) -> Completed:
    return Completed(fingerprint, 90_000_000, RESPONSE)


def claim(how: str = "new") -> Claim:
    return Claim(record_id=1, lock_token="t", expires_at_ms=90_000_000, how=how)


def lookups(*outcomes: Outcome, source: str = "database") -> Callable[[], tuple[Outcome, str]]:
    """A lookup that answers ``outcomes`` in turn (the last one for ever)."""
    answers = list(outcomes)

    def look_up() -> tuple[Outcome, str]:
        return (answers.pop(0) if len(answers) > 1 else answers[0]), source

    return look_up


# -- judge ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["new", "replaced", "taken_over"])
def test_c8_c13_a_claim_is_owned(how: str) -> None:
    verdict = judge(claim(how), FP, "database")
    assert verdict == Own(claim(how)) and verdict.taken_over == (how == "taken_over")


def test_c9_a_completed_record_with_the_same_fingerprint_replays() -> None:
    assert judge(completed(), FP, "cache") == Replay(completed(), "cache")


@pytest.mark.parametrize("found", [completed(OTHER), record(fingerprint=OTHER)])
def test_c7_another_fingerprint_is_key_reused_completed_or_in_flight(
    found: Completed | Record,
) -> None:
    assert judge(found, FP, "database") == KeyReused(found)


def test_c11_an_original_still_running_is_in_progress() -> None:
    assert judge(record(), FP, "database") == InProgress(record())


def test_c10_only_the_same_request_still_running_is_worth_waiting_for() -> None:
    assert in_flight(record(), FP)
    assert not in_flight(record(fingerprint=OTHER), FP)
    assert not in_flight(completed(), FP)
    assert not in_flight(claim(), FP)


# -- decide ---------------------------------------------------------------------------


def test_c10_a_duplicate_parks_and_gets_the_replay_when_the_original_completes() -> None:
    parked: list[Record] = []

    def park(
        found: Record, recheck: Callable[[], Outcome], going: Callable[[Outcome], bool]
    ) -> Outcome:
        parked.append(found)
        outcome = recheck()
        while going(outcome):
            outcome = recheck()
        return outcome

    verdict = decide(lookups(record(), record(), completed(), source="cache"), FP, park=park)
    assert parked == [record()]
    assert verdict == Replay(completed(), "cache")  # the source of the last lookup


def test_c12_a_released_record_is_claimed_by_the_waiter_that_rechecks_first() -> None:
    def park(
        found: Record, recheck: Callable[[], Outcome], going: Callable[[Outcome], bool]
    ) -> Outcome:
        return recheck()

    assert decide(lookups(record(), claim()), FP, park=park) == Own(claim())


def test_c11_without_parking_an_in_flight_record_is_in_progress_at_once() -> None:
    assert decide(lookups(record()), FP, park=None) == InProgress(record())


def test_c7_another_request_in_flight_is_never_waited_for() -> None:
    def park(*args: object) -> Outcome:
        raise AssertionError("a request with another fingerprint must not park")

    found = record(fingerprint=OTHER)
    assert decide(lookups(found), FP, park=park) == KeyReused(found)


def test_c25_a_store_failure_replays_a_cached_copy_else_is_unavailable() -> None:
    error = StoreError("connection refused")

    def failing() -> tuple[Outcome, str]:
        raise error

    assert decide(failing, FP, cached=completed) == Replay(completed(), "cache")
    assert decide(failing, FP, cached=lambda: None) == Unavailable(error)
    assert decide(failing, FP) == Unavailable(error)


def test_c25_a_store_failure_while_parked_falls_back_like_the_first_lookup() -> None:
    error = StoreError("gone")

    def park(
        found: Record, recheck: Callable[[], Outcome], going: Callable[[Outcome], bool]
    ) -> Outcome:
        raise error

    assert decide(lookups(record()), FP, park=park, cached=lambda: None) == Unavailable(error)


def test_c55_a_store_failure_while_parked_keeps_waiting_for_the_original() -> None:
    """A re-check the store cannot answer (a failover) is no reason to give up the wait:
    the owner keeps its completion and it lands later (C55)."""
    answers: list[Outcome | Exception] = [record(), StoreError("failing over"), completed()]

    def look_up() -> tuple[Outcome, str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer, "database"

    def park(
        found: Record, recheck: Callable[[], Outcome], going: Callable[[Outcome], bool]
    ) -> Outcome:
        outcome = recheck()
        assert outcome == found and going(outcome)  # still in flight as far as we know
        return recheck()

    assert decide(look_up, FP, park=park) == Replay(completed(), "database")


def test_completed_state_constant_is_what_records_use() -> None:
    assert record(state=COMPLETED).completed() == completed()
