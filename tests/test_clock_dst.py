"""The store's clock in the repeated hour of a daylight saving change (issue 22 item 1).

CONTRACT C52 (the database clock is an epoch no session time zone, DST change or host
zone can shift; MySQL/MariaDB with ``time_zone=SYSTEM`` in a zone with DST included),
C13 and C8 (a live lease is never taken over: one execution), C42.

On 2026-10-25 Europe/Berlin goes from 03:00 CEST (UTC+2) back to 02:00 CET (UTC+1):
02:00-03:00 local happens twice. A clock that turns the current instant into local time
and back (MySQL/MariaDB's ``UNIX_TIMESTAMP(NOW(3))`` under ``time_zone=SYSTEM``) cannot
tell the two passes apart; when it takes the later one, it reads an hour ahead through
the whole first pass. An owner that claimed at 01:59:50 CEST with a 60 s lease then
looks an hour overdue to a duplicate 25 s later (02:00:15 CEST, first pass), which
takes the record over: the view runs twice.

Each database is put at those instants without touching any clock of the machine:

- MariaDB: a private ``mariadbd`` (tests/support/mariadb_server.py) whose host zone is
  Europe/Berlin (``TZ`` in its environment, ``time_zone=SYSTEM``, the defaults); each
  store connection is given the instant with ``SET timestamp`` when it is checked out.
- PostgreSQL: the session's database with ``TimeZone=Europe/Berlin`` on every store
  connection (both drivers, the psycopg2 direct path included), and a stand-in
  ``statement_timestamp()`` earlier on the ``search_path`` than ``pg_catalog`` that
  returns the instant as a ``timestamptz`` (exactly what the real one returns then).
- SQLite: the process's own zone set to Europe/Berlin, and ``strftime(format, 'now')``
  answered by SQLite's own ``strftime`` for the instant (``'unixepoch'``), as SQLite's
  'now' (the host's UTC clock) would read then.

Each clock is also checked at the real time, with no stand-in, under the same zone.
"""

from __future__ import annotations

import datetime
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.engine import URL, Engine

from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import Claim, Identity, Record

# The store and its clock expression, wherever the package keeps them (repoint here).
from flask_idempotency.store import DurableStore
from flask_idempotency.store.clock import db_now_ms
from flask_idempotency.store.connect import create_store_engine
from tests.conftest import close_stores, driver_url, running_mariadb
from tests.support.mariadb_server import MariaDBServer

BERLIN = ZoneInfo("Europe/Berlin")
TTL, LEASE = 86400.0, 60.0  # the defaults (IDEMPOTENCY_TTL, IDEMPOTENCY_LEASE)


def _epoch(*fields: int, fold: int = 0, micro: int = 0) -> float:
    return datetime.datetime(*fields, micro, tzinfo=BERLIN, fold=fold).timestamp()


#: Instants in Europe/Berlin around the autumn change of 2026 (fold=1: the second pass).
INSTANTS = {
    "summer": _epoch(2026, 7, 1, 12, 0, 0, micro=250_000),
    "01:59:50 CEST, before the change": _epoch(2026, 10, 25, 1, 59, 50),
    "02:30 CEST, first pass": _epoch(2026, 10, 25, 2, 30, 0, micro=250_000),  # 00:30:00.25Z
    "02:59:59 CEST, end of first pass": _epoch(2026, 10, 25, 2, 59, 59, micro=999_000),
    "02:30 CET, second pass": _epoch(2026, 10, 25, 2, 30, 0, fold=1, micro=250_000),
    "winter": _epoch(2026, 12, 1, 12, 0, 0, micro=250_000),
}
#: The owner claims 10 s before the repeated hour; a duplicate comes 25 s into its lease.
OWNER_CLAIMS = _epoch(2026, 10, 25, 1, 59, 50)  # 2026-10-24T23:59:50Z, 1792886390
DUPLICATE_COMES = OWNER_CLAIMS + 25.0  # 02:00:15 CEST, the first pass
#: An owner that claims at the very end of the first pass and dies: its lease must lapse
#: within one lease, 65 s later (02:01:00 CET, the second pass).
LATE_OWNER_CLAIMS = _epoch(2026, 10, 25, 2, 59, 55)
LATE_TAKER_COMES = LATE_OWNER_CLAIMS + LEASE + 5.0

assert DUPLICATE_COMES - OWNER_CLAIMS == 25.0
assert INSTANTS["02:30 CET, second pass"] - INSTANTS["02:30 CEST, first pass"] == 3600.0


def _ms(epoch: float) -> int:
    return round(epoch * 1000)


def ident(key: str) -> Identity:
    return Identity("anonymous", key_digest("anonymous", key), "f" * 64, "POST", "/pay")


@dataclass
class Clocked:
    """A store on one database whose clock the test sets (``None``: the real clock)."""

    store: DurableStore
    engine: Engine
    set_clock: Callable[[float | None], None]

    def now_ms(self) -> int:
        """The store's clock expression, read on one of the store's own connections."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(db_now_ms())).scalar_one())


# -- the three databases ----------------------------------------------------------------


@pytest.fixture(scope="module")
def berlin_mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MariaDBServer]:
    """A private MariaDB whose host zone is Europe/Berlin; ``time_zone`` left at SYSTEM."""
    directory = tmp_path_factory.mktemp("mariadb-berlin")
    with running_mariadb(directory, timezone="Europe/Berlin") as server:
        yield server


@pytest.fixture
def mariadb_clocked(berlin_mariadb: MariaDBServer) -> Iterator[Clocked]:
    clock: list[float | None] = [None]
    engine = create_store_engine(berlin_mariadb.url)

    @event.listens_for(engine, "checkout")
    def _session_timestamp(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        at = clock[0]
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET timestamp = DEFAULT" if at is None else f"SET timestamp = {at:.3f}")

    def set_clock(at: float | None) -> None:
        clock[0] = at

    with engine.connect() as conn:
        zones = conn.execute(text("SELECT @@time_zone, @@system_time_zone")).one()
    assert zones[0] == "SYSTEM" and zones[1] in ("CET", "CEST"), zones
    store = DurableStore(lambda: engine, table_name=f"idem_{uuid.uuid4().hex[:12]}")
    store.create_table()
    try:
        yield Clocked(store, engine, set_clock)
    finally:
        set_clock(None)
        store.table.drop(engine, checkfirst=True)
        engine.dispose()


@pytest.fixture(params=["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
def postgresql_clocked(request: pytest.FixtureRequest, pg_database: URL) -> Iterator[Clocked]:
    schema = f"dst_clock_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_database, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
        conn.execute(text(f"CREATE TABLE {schema}.fake_now (epoch double precision)"))
        conn.execute(text(f"INSERT INTO {schema}.fake_now VALUES (NULL)"))
        conn.execute(
            text(
                f"CREATE FUNCTION {schema}.statement_timestamp() RETURNS timestamptz"
                " LANGUAGE sql STABLE AS $$ SELECT coalesce("
                f"(SELECT to_timestamp(epoch) FROM {schema}.fake_now),"
                " pg_catalog.statement_timestamp()) $$"
            )
        )
    url = driver_url(pg_database, str(request.param)).update_query_dict(
        {"options": f"-c TimeZone=Europe/Berlin -c search_path=public,{schema},pg_catalog"}
    )
    engine = create_store_engine(url.render_as_string(hide_password=False))

    def set_clock(at: float | None) -> None:
        with admin.connect() as conn:
            conn.execute(text(f"UPDATE {schema}.fake_now SET epoch = :at"), {"at": at})

    with engine.connect() as conn:
        assert conn.execute(text("SHOW TimeZone")).scalar_one() == "Europe/Berlin"
    store = DurableStore(lambda: engine, table_name=f"idem_{uuid.uuid4().hex[:12]}")
    store.create_table()
    try:
        yield Clocked(store, engine, set_clock)
    finally:
        store.table.drop(engine, checkfirst=True)
        # The store's own pools (the psycopg2 direct path has a second one) close with it.
        close_stores([store])
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture
def sqlite_clocked(tmp_path: Path) -> Iterator[Clocked]:
    host_zone = os.environ.get("TZ")
    os.environ["TZ"] = "Europe/Berlin"
    time.tzset()
    clock: list[float | None] = [None]
    side = sqlite3.connect(":memory:", check_same_thread=False)
    lock = threading.Lock()

    def strftime(fmt: str, value: Any) -> Any:
        """SQLite's strftime; 'now' is the test's instant when one is set."""
        with lock:
            at = clock[0]
            if value == "now" and at is not None:
                return side.execute("SELECT strftime(?, ?, 'unixepoch')", (fmt, at)).fetchone()[0]
            return side.execute("SELECT strftime(?, ?)", (fmt, value)).fetchone()[0]

    engine = create_store_engine(f"sqlite:///{tmp_path}/dst.sqlite3")

    @event.listens_for(engine, "connect")
    def _stand_in(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.create_function("strftime", 2, strftime)

    def set_clock(at: float | None) -> None:
        clock[0] = at

    store = DurableStore(lambda: engine, table_name="idem_dst")
    store.create_table()
    try:
        yield Clocked(store, engine, set_clock)
    finally:
        engine.dispose()
        side.close()
        if host_zone is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = host_zone
        time.tzset()


# -- what each database must show --------------------------------------------------------


def check_clock_at(clocked: Clocked, name: str) -> None:
    """C52: at ``name``'s instant the store's clock reads that instant's epoch, to the ms."""
    true_ms = _ms(INSTANTS[name])
    clocked.set_clock(INSTANTS[name])
    read_ms = clocked.now_ms()
    assert read_ms == true_ms, (
        f"at {name} the store's clock read {read_ms} ms, the true epoch is {true_ms} ms: "
        f"off by {read_ms - true_ms:+d} ms ({(read_ms - true_ms) / 3_600_000:+.3f} h)"
    )


def check_real_clock(clocked: Clocked) -> None:
    """C42/C52 at the real time: the store's clock agrees with the host's epoch (the host
    and the database are the same machine here) within a generous second."""
    clocked.set_clock(None)
    before = time.time() * 1000
    read_ms = clocked.now_ms()
    after = time.time() * 1000
    assert before - 1000 <= read_ms <= after + 1000, (read_ms, before, after)


def check_live_lease_not_taken_over(clocked: Clocked) -> None:
    """C13/C8: an owner claims at 01:59:50 CEST with a 60 s lease; a duplicate 25 s later
    (02:00:15 CEST, the repeated hour's first pass) must find the lease live and not
    take the record over (it would run the view a second time)."""
    store, me = clocked.store, ident(f"dst-{uuid.uuid4().hex[:8]}")
    clocked.set_clock(OWNER_CLAIMS)
    owner = store.acquire(me, ttl=TTL, lease=LEASE)
    assert isinstance(owner, Claim) and owner.how == "new", owner

    clocked.set_clock(DUPLICATE_COMES)
    seen = store.get(me.key_digest)
    assert seen is not None and seen.lock_token == owner.lock_token
    figures = (
        f"the owner claimed at {_ms(OWNER_CLAIMS)} ms (01:59:50 CEST) with a {LEASE:.0f} s "
        f"lease, stored as running to {seen.lease_expires_at_ms} ms; 25 s later "
        f"(02:00:15 CEST, first pass, true epoch {_ms(DUPLICATE_COMES)} ms) the store's "
        f"clock read {seen.now_ms} ms ({seen.now_ms - _ms(DUPLICATE_COMES):+d} ms off), "
        f"so the lease looked {'live' if seen.lease_live else 'lapsed'} "
        f"({(seen.lease_expires_at_ms or 0) - seen.now_ms:+d} ms left; truly "
        f"{(seen.lease_expires_at_ms or 0) - _ms(DUPLICATE_COMES):+d} ms)"
    )
    duplicate = store.acquire(me, ttl=TTL, lease=LEASE)
    assert not isinstance(duplicate, Claim), (
        f"a duplicate claimed ({duplicate.how}) a live owner's record: the view runs twice; "
        + figures
    )
    assert isinstance(duplicate, Record) and duplicate.lock_token == owner.lock_token
    assert duplicate.lease_live and duplicate.lease_remaining == pytest.approx(35.0, abs=0.01)


def check_dead_lease_lapses_within_one_lease(clocked: Clocked) -> None:
    """C13: an owner that claims at 02:59:55 CEST (the end of the first pass) and dies
    loses the key within one lease: a request 65 s later (02:01:00 CET, the second
    pass) takes it over, not one hour later."""
    store, me = clocked.store, ident(f"dst-late-{uuid.uuid4().hex[:8]}")
    clocked.set_clock(LATE_OWNER_CLAIMS)
    owner = store.acquire(me, ttl=TTL, lease=LEASE)
    assert isinstance(owner, Claim) and owner.how == "new", owner

    clocked.set_clock(LATE_TAKER_COMES)
    seen = store.get(me.key_digest)
    assert seen is not None
    taker = store.acquire(me, ttl=TTL, lease=LEASE)
    assert isinstance(taker, Claim) and taker.how == "taken_over", (
        f"a dead owner's {LEASE:.0f} s lease, claimed at {_ms(LATE_OWNER_CLAIMS)} ms "
        f"(02:59:55 CEST), still held {LEASE + 5:.0f} s later (true epoch "
        f"{_ms(LATE_TAKER_COMES)} ms, 02:01:00 CET): stored as running to "
        f"{seen.lease_expires_at_ms} ms, the store's clock read {seen.now_ms} ms, "
        f"{(seen.lease_expires_at_ms or 0) - seen.now_ms} ms of lease left"
    )


INSTANT_IDS = list(INSTANTS)


# -- MariaDB: time_zone=SYSTEM on a host in Europe/Berlin ------------------------------------


@pytest.mark.parametrize("instant", INSTANT_IDS)
@pytest.mark.mysql
@pytest.mark.slow
def test_c52_mariadb_clock_in_repeated_dst_hour_reads_the_true_epoch(
    mariadb_clocked: Clocked, instant: str
) -> None:
    check_clock_at(mariadb_clocked, instant)


@pytest.mark.mysql
@pytest.mark.slow
def test_c52_mariadb_clock_under_a_dst_host_zone_agrees_with_the_host_now(
    mariadb_clocked: Clocked,
) -> None:
    check_real_clock(mariadb_clocked)


@pytest.mark.mysql
@pytest.mark.slow
def test_c52_c13_mariadb_live_lease_is_not_taken_over_in_repeated_dst_hour(
    mariadb_clocked: Clocked,
) -> None:
    check_live_lease_not_taken_over(mariadb_clocked)


@pytest.mark.mysql
@pytest.mark.slow
def test_c52_c13_mariadb_dead_lease_lapses_within_one_lease_across_the_dst_change(
    mariadb_clocked: Clocked,
) -> None:
    check_dead_lease_lapses_within_one_lease(mariadb_clocked)


# -- PostgreSQL: session TimeZone Europe/Berlin ---------------------------------------------


@pytest.mark.parametrize("instant", INSTANT_IDS)
def test_c52_postgresql_clock_in_repeated_dst_hour_reads_the_true_epoch(
    postgresql_clocked: Clocked, instant: str
) -> None:
    check_clock_at(postgresql_clocked, instant)


def test_c52_postgresql_clock_under_a_dst_session_zone_agrees_with_the_host_now(
    postgresql_clocked: Clocked,
) -> None:
    check_real_clock(postgresql_clocked)


def test_c52_c13_postgresql_live_lease_is_not_taken_over_in_repeated_dst_hour(
    postgresql_clocked: Clocked,
) -> None:
    check_live_lease_not_taken_over(postgresql_clocked)


def test_c52_c13_postgresql_dead_lease_lapses_within_one_lease_across_the_dst_change(
    postgresql_clocked: Clocked,
) -> None:
    check_dead_lease_lapses_within_one_lease(postgresql_clocked)


# -- SQLite: the process's zone Europe/Berlin ------------------------------------------------


@pytest.mark.parametrize("instant", INSTANT_IDS)
def test_c52_sqlite_clock_in_repeated_dst_hour_reads_the_true_epoch(
    sqlite_clocked: Clocked, instant: str
) -> None:
    check_clock_at(sqlite_clocked, instant)


def test_c52_sqlite_clock_under_a_dst_host_zone_agrees_with_the_host_now(
    sqlite_clocked: Clocked,
) -> None:
    assert os.environ["TZ"] == "Europe/Berlin" and time.localtime().tm_zone in ("CET", "CEST")
    check_real_clock(sqlite_clocked)


def test_c52_c13_sqlite_live_lease_is_not_taken_over_in_repeated_dst_hour(
    sqlite_clocked: Clocked,
) -> None:
    check_live_lease_not_taken_over(sqlite_clocked)


def test_c52_c13_sqlite_dead_lease_lapses_within_one_lease_across_the_dst_change(
    sqlite_clocked: Clocked,
) -> None:
    check_dead_lease_lapses_within_one_lease(sqlite_clocked)
