"""Transactional mode at every isolation level the app's engine uses (C40, C43; issue 9 item 5).

The claim commits in a short transaction of its own. If the view's transaction
began earlier (a scope loader that loads ``current_user`` through ``db.session``
starts it), or takes its snapshot at REPEATABLE READ or SERIALIZABLE, it must
still see that claim, or its fenced completion matches no row: the client gets
409, the payment is rolled back, and every later takeover fails the same way.
Once the claim is won, the view runs in a transaction that sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL

from flask_idempotency.fingerprint import key_digest
from tests.apps.atomicapp import AtomicApp, build_app
from tests.support.kill_campaign import AtomicHarness
from tests.support.waiting import wait_until

pytestmark = pytest.mark.postgres

LEVELS = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]


@pytest.fixture
def harness(pg_url: URL, pg_table: str) -> Iterator[AtomicHarness]:
    h = AtomicHarness(pg_url, pg_table)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def make_payments_app(harness: AtomicHarness) -> Iterator[Callable[..., AtomicApp]]:
    built: list[AtomicApp] = []

    def factory(**options: Any) -> AtomicApp:
        config = {"TESTING": True, **options.pop("config", {})}
        handles = build_app(harness.url, harness.table, config=config, **options)
        built.append(handles)
        return handles

    yield factory
    for handles in built:
        handles.dispose()


@pytest.mark.parametrize("scope_reads_session", [False, True], ids=["no-query", "scope-query"])
@pytest.mark.parametrize("isolation", LEVELS)
def test_i9_5_c43_atomic_view_sees_its_claim_at_every_isolation_level(
    harness: AtomicHarness,
    make_payments_app: Callable[..., AtomicApp],
    isolation: str,
    scope_reads_session: bool,
) -> None:
    """C43/C40: whatever the engine's isolation and whatever db.session did before the
    claim, the first request pays once and stores its answer; a retry replays it."""
    payments = make_payments_app(isolation_level=isolation, scope_reads_session=scope_reads_session)
    with payments.app.app_context(), payments.db.engine.connect() as conn:
        assert conn.get_isolation_level() == isolation  # the app's engine, not a setting of ours
    key = f"i9-5-{isolation.replace(' ', '-')}-{scope_reads_session}"
    body = {"amount": 4300}
    client = payments.app.test_client()

    first = client.post("/payments", json=body, headers={"Idempotency-Key": key})
    assert first.status_code == 201, first.get_data(as_text=True)
    assert "Idempotent-Replayed" not in first.headers
    rows = harness.payments_by_key()[key]
    assert [row.id for row in rows] == [first.get_json()["payment_id"]]

    scope = "scope:user-1" if scope_reads_session else "anonymous"
    record = harness.store.get(key_digest(scope, key))
    assert record is not None and record.state == "completed"

    replay = client.post("/payments", json=body, headers={"Idempotency-Key": key})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.data == first.data
    assert len(harness.payments_by_key()[key]) == 1
    assert harness.attempt_count() == 1


@pytest.mark.parametrize("isolation", LEVELS)
def test_i9_5_c43_takeover_of_a_lapsed_lease_completes_at_every_isolation_level(
    harness: AtomicHarness, make_payments_app: Callable[..., AtomicApp], isolation: str
) -> None:
    """C43/C13: the original's scope loader queried db.session first; the original then
    dies mid-view (its database session is terminated, as a killed worker's would be)
    after its 1 s lease (heartbeat off) lapsed. The retry that takes the key over must
    complete and pay once, at every level (it used to get 409 too, and the key stayed
    stuck). Nothing of the original survives."""
    payments = make_payments_app(
        isolation_level=isolation,
        scope_reads_session=True,
        lease=1.0,
        config={"IDEMPOTENCY_HEARTBEAT": False},
    )
    key, body = f"i9-5-takeover-{isolation.replace(' ', '-')}", {"amount": 4400}
    holding, go_on = threading.Event(), threading.Event()

    def hold(held_key: str, phase: str) -> None:
        if held_key == key and phase == "written" and not holding.is_set():
            holding.set()
            assert go_on.wait(60)

    payments.on_phase = hold
    answers: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answers.update(
            original=payments.app.test_client().post(
                "/payments", json=body, headers={"Idempotency-Key": key}
            )
        )
    )
    thread.start()
    digest = key_digest("scope:user-1", key)
    try:
        assert holding.wait(30)
        wait_until(lambda: not harness.store.get(digest).lease_live, "the lease to lapse")  # type: ignore[union-attr]
        with harness.engine.connect() as conn:
            killed = conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND state = 'idle in transaction'"
                )
            ).all()
        assert len(killed) == 1  # the original's open transaction, and only that
        taker = payments.app.test_client().post(
            "/payments", json=body, headers={"Idempotency-Key": key}
        )
    finally:
        go_on.set()
        thread.join(timeout=60)
    assert taker.status_code == 201, taker.get_data(as_text=True)
    assert answers["original"].status_code in (409, 503)  # its connection is gone
    rows = harness.payments_by_key()[key]
    assert [row.id for row in rows] == [taker.get_json()["payment_id"]]
    record = harness.store.get(digest)
    assert record is not None and record.state == "completed"
