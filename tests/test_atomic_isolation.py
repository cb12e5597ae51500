"""Transactional mode at every isolation level the app's engine uses (C40, C43; issue 9 item 5).

The claim commits in a short transaction of its own. If the view's transaction
began earlier (a scope loader that loads ``current_user`` through ``db.session``
starts it), or takes its snapshot at REPEATABLE READ or SERIALIZABLE, it must
still see that claim, or its fenced completion matches no row: the client gets
409, the payment is rolled back, and every later takeover fails the same way.
Once the claim is won, the view runs in a transaction that sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy.engine import URL

from flask_idempotency.fingerprint import key_digest
from tests.apps.atomicapp import AtomicApp, build_app
from tests.support.kill_campaign import AtomicHarness

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
