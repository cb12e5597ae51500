"""The durable store without Flask, on SQLite, PostgreSQL and MariaDB (C8, C13, C14, C20, C21).

Times come from the database clock; tests that need time to pass poll that
clock instead of sleeping a guessed amount (no timed assertions).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy import func, select

from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import (
    COMPLETED,
    IN_PROGRESS,
    Claim,
    Identity,
    Record,
    StoredResponse,
)
from flask_idempotency.store import DurableStore, StoreError
from flask_idempotency.store.clock import db_now_ms
from flask_idempotency.store.connect import create_store_engine

from .conftest import driver_url, service_missing

TTL = 3600.0
LEASE = 60.0


#: MariaDB at its default REPEATABLE READ with PyMySQL, at READ COMMITTED, and with
#: mysqlclient (``mysql+mysqldb``): the claim must be atomic at both isolation levels.
BACKENDS = [
    "sqlite",
    "postgresql",
    "postgresql-psycopg3",
    "mariadb",
    "mariadb-read-committed",
    "mariadb-mysqldb",
]


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path):
    """The store on each durable database in turn: SQLite (embedded), the real
    PostgreSQL and the real MariaDB, each with a table of this test's own."""
    options = {}
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path}/store.sqlite3"
    elif request.param.startswith("postgresql"):
        driver = "psycopg" if request.param.endswith("psycopg3") else "psycopg2"
        base = driver_url(request.getfixturevalue("pg_database"), driver)
        url = base.render_as_string(hide_password=False)
    else:
        mysql = request.getfixturevalue("mysql_url")
        if request.param == "mariadb-mysqldb":
            try:
                import MySQLdb  # noqa: F401
            except ImportError as exc:
                service_missing("the mysqlclient driver", str(exc))
            mysql = mysql.set(drivername="mysql+mysqldb")
        if request.param == "mariadb-read-committed":
            options["isolation_level"] = "READ COMMITTED"
        url = mysql.render_as_string(hide_password=False)
    engine = create_store_engine(url, **options)
    table = f"idem_store_{uuid.uuid4().hex[:12]}"
    store = DurableStore(lambda: engine, table_name=table, create_table=True)
    yield store
    if request.param != "sqlite":
        store.table.drop(engine, checkfirst=True)
    engine.dispose()


def ident(key: str = "k", *, fingerprint: str = "f" * 64, scope: str = "anonymous") -> Identity:
    return Identity(scope, key_digest(scope, key), fingerprint, "POST", "/pay")


def db_now(store: DurableStore) -> int:
    with store.autocommit.connect() as conn:
        return int(conn.execute(select(db_now_ms())).scalar_one())


def wait_for_db_clock(store: DurableStore, past_ms: int, limit: float = 30.0) -> None:
    """Block until the database clock is beyond ``past_ms`` (bounded, never a bare sleep)."""
    deadline = time.monotonic() + limit
    while db_now(store) <= past_ms:
        assert time.monotonic() < deadline, "the database clock did not advance"
        time.sleep(0.01)


def row_count(store: DurableStore) -> int:
    with store.autocommit.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(store.table)).scalar_one())


RESPONSE = StoredResponse(
    201, (("Content-Type", "application/json"), ("Location", "/p/1")), b'{"id":1}'
)


def test_c8_first_acquire_claims(store) -> None:
    claim = store.acquire(ident(), ttl=TTL, lease=LEASE)
    assert isinstance(claim, Claim)
    assert claim.how == "new"
    record = store.get(ident().key_digest)
    assert record is not None
    assert record.state == IN_PROGRESS
    assert record.lock_token == claim.lock_token
    assert record.fingerprint == "f" * 64
    assert record.lease_live
    assert not record.expired
    assert record.expires_at_ms == claim.expires_at_ms
    assert record.expires_at_ms - record.created_at_ms == TTL * 1000
    assert record.lease_expires_at_ms - record.created_at_ms == LEASE * 1000


def test_c8_second_acquire_sees_the_in_progress_record(store) -> None:
    first = store.acquire(ident(), ttl=TTL, lease=LEASE)
    second = store.acquire(ident(), ttl=TTL, lease=LEASE)
    assert isinstance(second, Record)
    assert second.state == IN_PROGRESS
    assert second.lock_token == first.lock_token
    assert second.lease_remaining > 0
    assert row_count(store) == 1


def test_c7_different_fingerprint_returns_the_record_untouched(store) -> None:
    store.acquire(ident(), ttl=TTL, lease=LEASE)
    other = store.acquire(ident(fingerprint="0" * 64), ttl=TTL, lease=LEASE)
    assert isinstance(other, Record)
    assert other.fingerprint == "f" * 64


def test_c5_scopes_are_separate_records(store) -> None:
    a = store.acquire(ident("k", scope="a"), ttl=TTL, lease=LEASE)
    b = store.acquire(ident("k", scope="b"), ttl=TTL, lease=LEASE)
    assert isinstance(a, Claim) and isinstance(b, Claim)
    assert a.record_id != b.record_id
    assert row_count(store) == 2


@pytest.mark.parametrize(
    "response",
    [
        RESPONSE,
        StoredResponse(204, (), b""),
        StoredResponse(200, (("Content-Type", "application/octet-stream"),), bytes(range(256)) * 4),
        StoredResponse(302, (("Location", "https://example.com/ü"),), b"redirect"),
        StoredResponse(200, (("Content-Type", "text/plain"),), b"", body_omitted=True),
    ],
)
def test_c9_complete_stores_the_exact_response(store, response: StoredResponse) -> None:
    claim = store.acquire(ident(), ttl=TTL, lease=LEASE)
    expires = store.complete(claim, response)
    assert expires == claim.expires_at_ms
    record = store.get(ident().key_digest)
    assert record.state == COMPLETED
    assert record.lock_token == claim.lock_token  # kept: a retried completion knows it (9.4)
    assert record.lease_expires_at_ms is None
    assert record.completed_at_ms is not None
    assert record.response == response
    again = store.acquire(ident(), ttl=TTL, lease=LEASE)
    assert isinstance(again, Record) and again.state == COMPLETED
    assert again.completed().response == response


def test_c21_reads_do_not_extend_life(store) -> None:
    claim = store.acquire(ident(), ttl=TTL, lease=LEASE)
    store.complete(claim, RESPONSE)
    before = store.get(ident().key_digest)
    for _ in range(3):
        store.acquire(ident(), ttl=TTL * 2, lease=LEASE)
    after = store.get(ident().key_digest)
    assert after.expires_at_ms == before.expires_at_ms == claim.expires_at_ms


def test_c14_complete_with_a_foreign_token_is_refused(store) -> None:
    claim = store.acquire(ident(), ttl=TTL, lease=LEASE)
    forged = Claim(claim.record_id, "not-the-token", claim.expires_at_ms, "new")
    assert store.complete(forged, RESPONSE) is None
    assert store.release(forged) is False
    record = store.get(ident().key_digest)
    assert record.state == IN_PROGRESS and record.lock_token == claim.lock_token


def test_c20_release_deletes_and_frees_the_key(store) -> None:
    claim = store.acquire(ident(), ttl=TTL, lease=LEASE)
    assert store.release(claim) is True
    assert store.get(ident().key_digest) is None
    assert row_count(store) == 0
    assert store.release(claim) is False  # twice is a no-op
    again = store.acquire(ident(fingerprint="1" * 64), ttl=TTL, lease=LEASE)
    assert isinstance(again, Claim) and again.how == "new"


def test_c14_release_after_complete_keeps_the_record(store) -> None:
    claim = store.acquire(ident(), ttl=TTL, lease=LEASE)
    store.complete(claim, RESPONSE)
    assert store.release(claim) is False
    assert store.get(ident().key_digest).state == COMPLETED
    assert store.complete(claim, StoredResponse(500, (), b"late")) is None
    assert store.get(ident().key_digest).response == RESPONSE


def test_c13_c14_takeover_of_a_lapsed_lease_and_fencing(store) -> None:
    lost = store.acquire(ident(), ttl=TTL, lease=0.05)
    record = store.get(ident().key_digest)
    wait_for_db_clock(store, record.lease_expires_at_ms)
    assert not store.get(ident().key_digest).lease_live
    taker = store.acquire(ident(), ttl=TTL, lease=LEASE)
    assert isinstance(taker, Claim) and taker.how == "taken_over"
    assert taker.record_id == lost.record_id
    assert taker.lock_token != lost.lock_token
    assert taker.expires_at_ms == lost.expires_at_ms, "a takeover keeps the original life"
    # The slow original can neither complete nor release the taker's record.
    assert store.complete(lost, StoredResponse(200, (), b"stale")) is None
    assert store.release(lost) is False
    assert store.complete(taker, RESPONSE) == taker.expires_at_ms
    assert store.get(ident().key_digest).response == RESPONSE


def test_c13_takeover_keeps_the_fingerprint(store) -> None:
    """A different request never takes over: a lapsed lease is still the original's key (C7)."""
    store.acquire(ident(), ttl=TTL, lease=0.05)
    wait_for_db_clock(store, store.get(ident().key_digest).lease_expires_at_ms)
    other = store.acquire(ident(fingerprint="2" * 64), ttl=TTL, lease=LEASE)
    assert isinstance(other, Record)
    assert other.fingerprint == "f" * 64


def test_c21_expired_completed_record_is_replaced(store) -> None:
    claim = store.acquire(ident(), ttl=0.2, lease=0.1)
    store.complete(claim, RESPONSE)
    wait_for_db_clock(store, claim.expires_at_ms)
    assert store.get(ident().key_digest).expired
    fresh = store.acquire(ident(fingerprint="3" * 64), ttl=TTL, lease=LEASE)
    assert isinstance(fresh, Claim) and fresh.how == "replaced"
    assert fresh.record_id == claim.record_id
    record = store.get(ident().key_digest)
    assert record.state == IN_PROGRESS
    assert record.fingerprint == "3" * 64
    assert record.response is None
    assert record.expires_at_ms > claim.expires_at_ms
    assert store.complete(claim, RESPONSE) is None, "the old owner's token is gone"


def test_c21_in_progress_with_live_lease_is_never_expired(store) -> None:
    """Past ``expires_at`` but the lease still holds: the owner is running, do not replace."""
    claim = store.acquire(ident(), ttl=0.05, lease=LEASE)
    wait_for_db_clock(store, claim.expires_at_ms)
    record = store.get(ident().key_digest)
    assert record.expires_at_ms <= record.now_ms
    assert record.lease_live and not record.expired
    other = store.acquire(ident(fingerprint="4" * 64), ttl=TTL, lease=LEASE)
    assert isinstance(other, Record) and other.lock_token == claim.lock_token
    same = store.acquire(ident(), ttl=TTL, lease=LEASE)
    assert isinstance(same, Record) and same.lock_token == claim.lock_token


def test_c8_concurrent_acquires_have_one_winner(store) -> None:
    store.create_table()
    threads = 12
    barrier = threading.Barrier(threads)
    results: list[object] = []
    lock = threading.Lock()

    def race() -> None:
        barrier.wait()
        outcome = store.acquire(ident("race"), ttl=TTL, lease=LEASE)
        with lock:
            results.append(outcome)

    workers = [threading.Thread(target=race) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    claims = [r for r in results if isinstance(r, Claim)]
    assert len(results) == threads
    assert len(claims) == 1
    assert all(
        isinstance(r, Record) and r.lock_token == claims[0].lock_token
        for r in results
        if r is not claims[0]
    )


def test_c13_concurrent_takeovers_have_one_winner(store) -> None:
    store.acquire(ident("stale"), ttl=TTL, lease=0.05)
    wait_for_db_clock(store, store.get(ident("stale").key_digest).lease_expires_at_ms)
    threads = 10
    barrier = threading.Barrier(threads)
    results: list[object] = []
    lock = threading.Lock()

    def race() -> None:
        barrier.wait()
        outcome = store.acquire(ident("stale"), ttl=TTL, lease=LEASE)
        with lock:
            results.append(outcome)

    workers = [threading.Thread(target=race) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    claims = [r for r in results if isinstance(r, Claim)]
    assert len(claims) == 1 and claims[0].how == "taken_over"
    assert store.get(ident("stale").key_digest).lock_token == claims[0].lock_token


def test_c25_unreachable_database_is_a_store_error(tmp_path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "db.sqlite3"
    engine = create_store_engine(f"sqlite:///{missing}")
    store = DurableStore(lambda: engine, table_name="idem_missing")
    with pytest.raises(StoreError):
        store.acquire(ident(), ttl=TTL, lease=LEASE)
    with pytest.raises(StoreError):
        store.get(ident().key_digest)
    engine.dispose()


def test_get_of_an_unknown_digest_is_none(store) -> None:
    assert store.get("0" * 64) is None


def test_c44_c14_renew_is_fenced_on_every_database(store) -> None:
    """C44/C14: a renewal extends only a live claim's lease under its own token; a
    completed record (which keeps its token, 9.4) and a foreign token renew nothing."""
    claim = store.acquire(ident("renew"), ttl=TTL, lease=1.0)
    before = store.get(ident("renew").key_digest).lease_expires_at_ms
    forged = Claim(claim.record_id, "not-the-token", claim.expires_at_ms, "new")
    assert store.renew([claim, forged], LEASE) == {claim.record_id}
    assert store.get(ident("renew").key_digest).lease_expires_at_ms > before
    store.complete(claim, RESPONSE)
    assert store.renew([claim], LEASE) == set()
    assert store.get(ident("renew").key_digest).lease_expires_at_ms is None
