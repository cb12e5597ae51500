"""The renewer on its own, on SQLite (fast; the PostgreSQL proofs are in test_heartbeat.py).

C44: a registered claim's lease is renewed while it runs; a renewal that finds the
record under another token reports ``taken-over`` at once; a stopped lease is no
longer renewed; past the max runtime renewals stop with ``max-runtime``.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from flask_idempotency.completion import heartbeat
from flask_idempotency.records import Claim, Identity
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine
from tests.support.waiting import wait_until


@pytest.fixture
def store(tmp_path: Path) -> DurableStore:
    engine = create_store_engine(f"sqlite:///{tmp_path}/renewer.sqlite3")
    store = DurableStore(lambda: engine)
    store.create_table()
    return store


def claim(store: DurableStore, lease: float) -> tuple[Identity, Claim]:
    ident = Identity(
        scope="s", key_digest=uuid.uuid4().hex * 2, fingerprint="f", method="POST", path="/"
    )
    won = store.acquire(ident, ttl=3600, lease=lease)
    assert isinstance(won, Claim)
    return ident, won


def test_i12_1_c44_a_running_owner_keeps_its_lease(store: DurableStore) -> None:
    ident, won = claim(store, 0.3)
    reports: list[str] = []
    lease = heartbeat.start(store, won, 0.3, 60, reports.append)
    try:
        time.sleep(1.0)  # more than three leases
        record = store.get(ident.key_digest)
        assert record is not None and record.lease_live and reports == []
    finally:
        heartbeat.stop(lease)
    time.sleep(0.5)
    record = store.get(ident.key_digest)
    assert record is not None and not record.lease_live  # stopped: no more renewals


def test_i12_1_c44_a_taken_over_lease_is_reported_at_once(store: DurableStore) -> None:
    _, won = claim(store, 0.6)
    reported = threading.Event()
    reasons: list[str] = []

    def report(reason: str) -> None:
        reasons.append(reason)
        reported.set()

    lease = heartbeat.start(store, won, 0.6, 60, report)
    try:
        with store.engine.begin() as conn:  # another request took it over
            t = store.table
            conn.execute(update(t).where(t.c.id == won.record_id).values(lock_token="other"))
        assert reported.wait(2.0)
        assert reasons == [heartbeat.TAKEN_OVER] and lease.lost == heartbeat.TAKEN_OVER
    finally:
        heartbeat.stop(lease)


def test_i12_1_c44_max_runtime_stops_renewing(store: DurableStore) -> None:
    ident, won = claim(store, 0.3)
    reasons: list[str] = []
    lease = heartbeat.start(store, won, 0.3, 0.5, reasons.append)
    try:
        wait_until(lambda: reasons == [heartbeat.MAX_RUNTIME], "the max-runtime report", within=5)
        time.sleep(0.5)
        record = store.get(ident.key_digest)
        assert record is not None and not record.lease_live
    finally:
        heartbeat.stop(lease)


class CountingCondition(threading.Condition):
    """A condition that counts how often waiters are woken and how often one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.notified = 0
        self.waits = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_c44_a_new_lease_wakes_the_renewer_only_if_due_before_its_next_round(
    store: DurableStore,
) -> None:
    """Every first execution registers a lease: waking the renewal thread for each one
    (a thread switch and a scan of every lease) is wasted unless the new lease is due
    before the thread would wake anyway; a lease due sooner still wakes it."""
    renewer = heartbeat.Renewer()
    cond = renewer._cond = CountingCondition()
    leases = [
        heartbeat.Lease(store, claim(store, 30)[1], 30, 60, lambda reason: None) for _ in range(6)
    ]
    urgent_ident, urgent_claim = claim(store, 0.3)
    urgent = heartbeat.Lease(store, urgent_claim, 0.3, 60, lambda reason: None)
    try:
        renewer.add(leases[0])  # starts the thread, which waits about 10 s for its next round
        wait_until(lambda: cond.waits >= 1, "the renewal thread waiting")
        for lease in leases[1:]:
            renewer.add(lease)  # due in 10 s: later than the thread's next round
        assert cond.notified == 0
        renewer.add(urgent)  # due in 0.1 s: sooner
        assert cond.notified == 1
        wait_until(
            lambda: urgent.next_due > urgent.started + 0.2,  # renewed at least once
            "the urgent lease's renewal",
            within=5,
        )
        record = store.get(urgent_ident.key_digest)
        assert record is not None and record.lease_live and urgent.lost is None
    finally:
        for lease in [*leases, urgent]:
            renewer.remove(lease)


def renew_slowly(
    store: DurableStore, lease_seconds: float, delay: float
) -> tuple[Any, float, float]:
    """Renew a fresh claim's lease once, the store answering ``delay`` late: the lease,
    when the renewal reached the store, and when the renewer was done with it."""
    _, won = claim(store, lease_seconds)
    sent: list[float] = []
    renew = store.renew

    def slow(*args: Any, **kwargs: Any) -> Any:
        sent.append(time.monotonic())
        time.sleep(delay)
        return renew(*args, **kwargs)

    store.renew = slow  # type: ignore[method-assign]
    lease = heartbeat.Lease(store, won, lease_seconds, 60, lambda reason: None)
    heartbeat.Renewer()._renew([lease])
    answered = time.monotonic()
    [sent_at] = sent
    return lease, sent_at, answered


def test_c44_the_next_renewal_counts_from_when_the_last_was_sent(store: DurableStore) -> None:
    """A renewal extends the lease from about when it was sent (the database's now), so
    the next is due a third of a lease after that, however long the answer took: timed
    from the answer, a store answering ``d`` late spaced the extensions a third of a
    lease plus ``d`` apart, and two slow answers in a row could lapse a live owner's
    lease."""
    lease, sent_at, _ = renew_slowly(store, 3.0, 0.4)
    # The renewer notes its own sending just before (it first picks its engine): no
    # later than ``sent_at``, and far less than the 0.4 s answer earlier.
    assert sent_at + 2.6 <= lease.confirmed_until <= sent_at + 3.0
    assert sent_at + 0.6 <= lease.next_due <= sent_at + 1.0  # timed from the answer: >= 1.4


def test_c44_a_store_slower_than_a_third_of_a_lease_is_not_asked_back_to_back(
    store: DurableStore,
) -> None:
    """C44: when a renewal's answer takes longer than a third of the lease, the next one
    comes a retry step (a tenth of a lease) after the answer, not at once."""
    lease, sent_at, answered = renew_slowly(store, 1.2, 0.6)
    assert sent_at + 0.8 <= lease.confirmed_until <= sent_at + 1.2
    # A retry step (0.12 s) after the answer, which came at least 0.6 s after the
    # sending: not a third of a lease after the sending, already past (0.4 s).
    assert sent_at + 0.6 + 0.12 <= lease.next_due <= answered + 0.12
