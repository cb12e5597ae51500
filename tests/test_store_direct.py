"""The psycopg2 request path on the pooled DBAPI connection directly (issue 11).

CONTRACT C8, C9, C14, C26, C45: the claim, the replay and the completion run
their statements on a cursor of a connection of the store's own autocommit pool,
without SQLAlchemy's execution layer, and nothing the store promises changes: the
same records, dead connections invalidated and retried, a broken table a
deployment error, and an app's statement instrumentation still sees every statement.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import jsonify
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from flask_idempotency import idempotent
from flask_idempotency.records import Claim, Identity, Record, StoredResponse
from flask_idempotency.store import DurableStore, StoreError, StoreMisconfigured
from flask_idempotency.store.direct import DirectStatements

from .conftest import PG_DRIVERS, driver_url, service_missing
from .support.pgbouncer import PgBouncer, pgbouncer_binary
from .test_lifecycle import KEY, REPLAYED

pytestmark = pytest.mark.postgres


@pytest.fixture(params=PG_DRIVERS, ids=("psycopg2", "psycopg3"))
def store(pg_database: URL, request: pytest.FixtureRequest) -> Iterator[DurableStore]:
    """A store on the direct path of each driver (psycopg 3 as the extension's own engine
    makes it: no preparation by psycopg itself, ``prepare_threshold=None``)."""
    url = driver_url(pg_database, request.param)
    name = f"idem_direct_{uuid.uuid4().hex[:10]}"
    args: dict[str, Any] = {"application_name": name}
    if request.param == "psycopg":
        args["prepare_threshold"] = None
    made = DurableStore(
        lambda: create_engine(url, pool_size=3, connect_args=args),
        table_name=name,
        create_table=True,
    )
    yield made
    made.table.drop(made.engine, checkfirst=True)
    made.engine.dispose()


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The SQL of every statement run on the direct path."""
    seen: list[str] = []
    original = DirectStatements.run

    def spy(self: DirectStatements, sql: str, work: Any) -> Any:
        seen.append(sql)
        return original(self, sql, work)

    monkeypatch.setattr(DirectStatements, "run", spy)
    return seen


def identity_of(name: str) -> Identity:
    digest = (uuid.uuid4().hex + uuid.uuid4().hex)[:64]
    return Identity("anonymous", digest, name.ljust(64, "0")[:64], "POST", f"/{name}")


RESPONSE = StoredResponse(201, (("Content-Type", "application/json"),), b'{"ok":true}\x00\xff')


def test_i11_c9_c14_claim_replay_and_completion_run_on_the_direct_path(store, runs) -> None:
    """C8/C9/C14: the claim, the completion and the replay each run one statement on the
    direct path, and read back exactly the record SQLAlchemy's path reads."""
    ident = identity_of("direct-1")
    claim = store.acquire(ident, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    assert store.complete(claim, RESPONSE) == claim.expires_at_ms
    replay = store.acquire(ident, ttl=60, lease=30)
    assert len(runs) == 3, runs
    assert runs[0].startswith("WITH ins AS") and runs[1].startswith("UPDATE")
    assert isinstance(replay, Record) and replay.response == RESPONSE
    assert type(replay.response.body) is bytes
    through_sqlalchemy = store._run(
        lambda conn: store._select(conn, ident.key_digest), store._single()
    )
    direct_read = store.get(ident.key_digest)
    assert direct_read == replace_clock(direct_read, through_sqlalchemy)
    assert replay == replace_clock(replay, through_sqlalchemy)


def replace_clock(like: Record | None, record: Record | None) -> Record:
    """``record`` with ``like``'s database clock, the one field two reads differ in."""
    assert like is not None and record is not None
    return Record(**{**record.__dict__, "now_ms": like.now_ms})


def test_i11_c14_completion_with_a_lost_lease_is_none_on_the_direct_path(store, runs) -> None:
    """C14: a completion whose token no longer owns the record changes nothing."""
    ident = identity_of("direct-2")
    claim = store.acquire(ident, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    stranger = type(claim)(claim.record_id, uuid.uuid4().hex, claim.expires_at_ms, "new")
    assert store.complete(stranger, RESPONSE) is None
    assert store.complete(claim, RESPONSE) == claim.expires_at_ms
    assert len(runs) == 3


def test_i11_c26_dead_pooled_connections_are_invalidated_and_retried(store, runs) -> None:
    """C26: the database dropped every pooled connection (a restart): the next call
    finds a dead one, invalidates the pool's connections as SQLAlchemy would, and
    succeeds on a fresh one instead of meeting the next dead one and answering 503."""
    idents = [identity_of(f"direct-dead-{i}") for i in range(3)]
    store.acquire(identity_of("direct-warm"), ttl=60, lease=30)  # set up and verified
    pool = store._single()
    assert pool is not None
    held = [pool.raw_connection() for _ in range(3)]  # fill the pool with three connections
    for conn in held:
        conn.close()
    with store.autocommit.connect() as admin:
        killed = admin.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = :name AND pid <> pg_backend_pid()"
            ),
            {"name": store.table.name},
        ).scalar_one()
    assert killed >= 3
    for ident in idents:
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        assert store.complete(claim, RESPONSE) == claim.expires_at_ms
    assert len(runs) == 1 + 6 + 1  # the warm-up, six statements, one retry


def test_i11_c45_table_dropped_after_verification_is_a_deployment_error(store, runs) -> None:
    """C45: the schema error on the direct path is classified as before, not as an outage."""
    store.acquire(identity_of("direct-3"), ttl=60, lease=30)
    store.table.drop(store.engine)
    try:
        with pytest.raises(StoreMisconfigured, match="create-table"):
            store.acquire(identity_of("direct-4"), ttl=60, lease=30)
    finally:
        store.create_table()
    assert len(runs) == 2


def test_i11_c25_unreachable_database_is_a_store_error(pg_database: URL) -> None:
    """C25/C26: a pool that cannot connect raises StoreError (the 503), like SQLAlchemy's path."""
    url = driver_url(pg_database, "psycopg2").set(host="127.0.0.1", port=1)
    broken = DurableStore(lambda: create_engine(url, connect_args={"connect_timeout": 1}))
    broken._verified = True  # straight to the claim's statement
    with pytest.raises(StoreError) as raised:
        broken.acquire(identity_of("direct-5"), ttl=60, lease=30)
    assert "OperationalError" in str(raised.value)


def test_i11_statement_instrumentation_keeps_the_sqlalchemy_path(store, runs) -> None:
    """An app's ``before_cursor_execute`` listener on every Engine still sees the store's
    statements: the direct path steps aside rather than hide them."""
    seen: list[str] = []

    def listener(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    store.acquire(identity_of("direct-6"), ttl=60, lease=30)  # set up, verified
    engine_class = type(store.engine)
    event.listen(engine_class, "before_cursor_execute", listener)
    try:
        ident = identity_of("direct-7")
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        assert store.complete(claim, RESPONSE) == claim.expires_at_ms
        replay = store.acquire(ident, ttl=60, lease=30)
    finally:
        event.remove(engine_class, "before_cursor_execute", listener)
    assert isinstance(replay, Record) and replay.response == RESPONSE
    assert len(seen) == 3 and len(runs) == 1, (seen, runs)


def test_i11_c9_replay_over_http_through_the_direct_path(
    pg_database: URL, make_app: Any, runs
) -> None:
    """C9: an app on psycopg2 replays from PostgreSQL through the direct path."""
    url = driver_url(pg_database, "psycopg2").render_as_string(hide_password=False)
    app, _ = make_app({"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_CREATE_TABLE": True})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return jsonify(n=len(calls)), 201

    client = app.test_client()
    first = client.post("/pay", json={"a": 1}, headers=KEY)
    again = client.post("/pay", json={"a": 1}, headers=KEY)
    assert first.status_code == again.status_code == 201
    assert again.headers.get(REPLAYED) == "true" and again.json == {"n": 1}
    assert calls == [1]
    assert len(runs) == 3
    store = app.extensions["idempotency"].store
    store.table.drop(store.engine, checkfirst=True)


def server_prepared(store: DurableStore) -> set[str]:
    """The statements prepared on the server for the pool's next connection."""
    pool = store._single()
    assert pool is not None
    conn = pool.raw_connection()
    try:
        cursor = conn.cursor()
        cursor.execute("SELECT name FROM pg_prepared_statements")
        return {name for (name,) in cursor.fetchall()}
    finally:
        conn.close()


def test_i11_statements_are_prepared_once_per_connection(store, runs) -> None:
    """The claim, the completion and the read are prepared on the server on first use
    (the statement's preparation and its first run in one round trip), then only
    executed: psycopg2's named by a hash of their SQL, psycopg 3's by psycopg (on a
    connection that reaches PostgreSQL itself: see the next test)."""
    ident = identity_of("prep-1")
    claim = store.acquire(ident, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    store.complete(claim, RESPONSE)
    assert isinstance(store.acquire(ident, ttl=60, lease=30), Record)
    assert store.get(ident.key_digest) is not None
    names = server_prepared(store)
    prefix = "flask_idempotency_" if store.engine.dialect.driver == "psycopg2" else "_pg3_"
    assert len([n for n in names if n.startswith(prefix)]) == 3, names
    direct = store._direct()
    assert direct is not None and direct.prepare


@pytest.fixture
def bouncer(pg_database: URL) -> Iterator[PgBouncer]:
    """A private PgBouncer in transaction mode with one server connection, which every
    client's transactions then share."""
    binary = pgbouncer_binary()
    if binary is None:
        service_missing("pgbouncer", "the binary is not installed (apt-get install pgbouncer)")
    started = PgBouncer(
        str(binary), str(pg_database.host or "127.0.0.1"), int(pg_database.port or 5432),
        pool_size=1,
    ).start()  # fmt: skip
    try:
        yield started
    finally:
        started.stop()


def test_i21_c8_a_statement_name_another_client_prepared_never_runs_its_statement(
    pg_database: URL, bouncer: PgBouncer, caplog: pytest.LogCaptureFixture
) -> None:
    """C8/C41: behind a transaction pooler a statement name can reach a server connection
    where another client prepared another statement under it. psycopg 3 names its
    statements ``_pg3_0``, ``_pg3_1``… per connection: another app's claim (another
    table) under our claim's name ran in its place, and our key was claimed in *its*
    table (CI: "relation idem_m_… does not exist" after that app's table was dropped).
    Through a real PgBouncer: after our first claim, another client replaces every
    statement prepared on the one server connection by the same statement on another
    table, as that client would have prepared it under psycopg's names."""
    name = f"idem_pooled_{uuid.uuid4().hex[:8]}"
    routed = bouncer.route(driver_url(pg_database, "psycopg"))
    store = DurableStore(
        lambda: create_engine(routed, pool_size=2, connect_args={"prepare_threshold": None}),
        table_name=name,
        create_table=True,
    )
    other_name = f"idem_other_{uuid.uuid4().hex[:8]}"
    other = DurableStore(
        lambda: create_engine(driver_url(pg_database, "psycopg2"), pool_size=1),
        table_name=other_name,
        create_table=True,
    )
    try:
        other.create_table()
        with caplog.at_level("INFO", logger="flask_idempotency"):
            first = store.acquire(identity_of("pooled-1"), ttl=60, lease=30)
        assert not isinstance(first, Record)
        direct = store._direct()
        assert direct is not None and not direct.prepare
        assert any("pooler is in use" in r.getMessage() for r in caplog.records)
        theirs = create_engine(routed, poolclass=NullPool, connect_args={"autocommit": True})
        with theirs.connect() as conn:
            cursor = conn.connection.driver_connection.cursor()
            cursor.execute(
                "SELECT name, statement, parameter_types::text[] FROM pg_prepared_statements"
            )
            for statement_name, sql, types in cursor.fetchall():
                cursor.execute(f'DEALLOCATE "{statement_name}"')
                replaced = sql.replace(name, other_name)
                cursor.execute(f'PREPARE "{statement_name}" ({", ".join(types)}) AS {replaced}')
        for n in range(3):
            ident = identity_of(f"pooled-{n + 2}")
            claim = store.acquire(ident, ttl=60, lease=30)
            assert not isinstance(claim, Record)
            assert other.get(ident.key_digest) is None, "our key was claimed in another table"
            assert store.get(ident.key_digest) is not None
    finally:
        for made in (store, other):
            made.table.drop(other.engine, checkfirst=True)
            made.identity_table.drop(other.engine, checkfirst=True)
            made.engine.dispose()


def test_i11_statements_gone_from_the_server_connection_fall_back_to_plain_sql(
    store, runs, caplog
) -> None:
    """A transaction pooler hands the next statement to a server connection that never
    saw our PREPARE (simulated: the statements deallocated behind the pool's back):
    the call still succeeds, and the store stops preparing statements."""
    ident = identity_of("prep-2")
    claim = store.acquire(ident, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    pool = store._single()
    assert pool is not None
    conn = pool.raw_connection()
    cursor = conn.cursor()
    # By name: psycopg 3 notices a DEALLOCATE ALL and forgets its statements itself.
    cursor.execute("SELECT name FROM pg_prepared_statements")
    for (name,) in cursor.fetchall():
        cursor.execute(f'DEALLOCATE "{name}"')
    conn.close()
    with caplog.at_level("INFO", logger="flask_idempotency"):
        assert store.complete(claim, RESPONSE) == claim.expires_at_ms
        replay = store.acquire(ident, ttl=60, lease=30)  # its EXECUTE meets no statement
    assert isinstance(replay, Record) and replay.response == RESPONSE
    direct = store._direct()
    assert direct is not None and not direct.prepare
    assert any("not prepared" in r.getMessage() for r in caplog.records)


def test_i11_table_changed_under_prepared_statements_is_not_an_outage(store, runs) -> None:
    """A migration changes a column's type while statements are prepared on pooled
    connections ("cached plan must not change result type"): the call is retried on a
    fresh connection instead of answering 503."""
    first = identity_of("prep-3")
    claim = store.acquire(first, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    store.complete(claim, RESPONSE)
    assert isinstance(store.acquire(first, ttl=60, lease=30), Record)
    with store.autocommit.connect() as admin:
        admin.exec_driver_sql(
            f'ALTER TABLE "{store.table.name}" ALTER COLUMN scope TYPE varchar(300)'
        )
    replay = store.acquire(first, ttl=60, lease=30)
    assert isinstance(replay, Record) and replay.response == RESPONSE


def test_i11_c26_pooled_connection_closed_on_the_client_is_invalidated_and_retried(
    store, runs
) -> None:
    """C26: a pooled psycopg2 connection already closed on the client side fails when the
    cursor is made, before any statement: it is invalidated and the call retried (it
    raised UnboundLocalError, a 500, when that failure came before the cursor existed)."""
    ident = identity_of("closed-1")
    store.acquire(ident, ttl=60, lease=30)
    pool = store._single()
    assert pool is not None
    conn = pool.raw_connection()
    dbapi_connection = conn.dbapi_connection
    conn.close()  # back in the pool, healthy
    dbapi_connection.close()  # type: ignore[union-attr]
    claim = store.acquire(identity_of("closed-2"), ttl=60, lease=30)
    assert not isinstance(claim, Record)
    assert store.complete(claim, RESPONSE) == claim.expires_at_ms


AWKWARD_TEXT = ["", "plain", "o'brien", "back\\slash", "%(p_scope)s", "100%", "é ü €", "tab\there"]


@pytest.mark.parametrize("prepared", [True, False], ids=["prepared", "plain"])
def test_i11_c9_awkward_values_round_trip_on_the_direct_path(store, runs, prepared) -> None:
    """C9: quotes, backslashes, percent signs and non-ASCII text in the scope, path and
    stored headers, and any bytes in the body, come back exactly, with and without
    prepared statements (a transaction pooler turns them off)."""
    store.acquire(identity_of("warm"), ttl=60, lease=30)  # sets up the direct path
    direct = store._direct()
    assert direct is not None
    direct.prepare = prepared
    for i, awkward in enumerate(AWKWARD_TEXT):
        digest = (uuid.uuid4().hex + uuid.uuid4().hex)[:64]
        ident = Identity(f"scope {awkward}", digest, "f" * 64, "POST", f"/{i}/{awkward}")
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        headers = (("X-Note", awkward), ("ETag", f'"{i}"'))
        response = StoredResponse(200, headers, bytes(range(256)))
        assert store.complete(claim, response) == claim.expires_at_ms
        replay = store.acquire(ident, ttl=60, lease=30)
        assert isinstance(replay, Record) and replay.response == response
        assert (replay.scope, replay.path) == (ident.scope, ident.path)
    assert runs  # every statement above ran on the direct path


def terminate_pooled_connections(store: DurableStore) -> int:
    with store.autocommit.connect() as admin:
        killed: int = admin.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = :name AND pid <> pg_backend_pid()"
            ),
            {"name": store.table.name},
        ).scalar_one()
    return killed


def test_i11_c26_every_statement_returns_its_connection_to_the_pool(store, runs) -> None:
    """The direct path takes its connection from the pool's entries itself: after
    replays, completions, a lost lease, a schema error and a dead connection, nothing
    is left checked out, and the pool never grows past its size."""
    pool = store._single()
    assert pool is not None
    for i in range(5):
        ident = identity_of(f"returned-{i}")
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        assert store.complete(claim, RESPONSE) == claim.expires_at_ms
        assert isinstance(store.acquire(ident, ttl=60, lease=30), Record)
        assert pool.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert terminate_pooled_connections(store) >= 1
    assert not isinstance(store.acquire(identity_of("returned-dead"), ttl=60, lease=30), Record)
    assert pool.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert pool.pool.size() == 3 and pool.pool.overflow() <= 0  # type: ignore[attr-defined]


def test_i11_a_sqlalchemy_without_the_pool_entry_api_takes_the_ordinary_checkout(
    store, runs, monkeypatch
) -> None:
    """The lean checkout calls private pool methods; on a SQLAlchemy where they are not
    what it expects (checked once, at import), every statement takes ``pool.connect()``."""
    from flask_idempotency._wire import sqla_pool as store_direct

    pool = store._single()
    assert pool is not None
    store.acquire(identity_of("entry-api-warm"), ttl=60, lease=30)  # the table is verified
    connect = pool.pool.connect
    connects: list[int] = []

    def counted_connect() -> Any:
        connects.append(1)
        return connect()

    monkeypatch.setattr(pool.pool, "connect", counted_connect)

    def claim_complete_replay(name: str) -> None:
        ident = identity_of(name)
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        assert store.complete(claim, RESPONSE) == claim.expires_at_ms
        assert isinstance(store.acquire(ident, ttl=60, lease=30), Record)

    claim_complete_replay("lean-checkout")
    assert connects == []  # this SQLAlchemy has the entry API: the lean checkout
    monkeypatch.setattr(store_direct, "_POOL_ENTRY_API", False)
    claim_complete_replay("ordinary-checkout")
    assert len(connects) >= 3
    assert pool.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_i11_pool_listeners_still_see_every_checkout(store, runs) -> None:
    """An app's ``checkout``/``checkin`` listeners on the pool (pool metrics, a per-checkout
    setting) see the direct path's connections as before: it steps aside for them."""
    store.acquire(identity_of("listened-warm"), ttl=60, lease=30)
    pool = store._single()
    assert pool is not None
    seen: list[str] = []

    def on_checkout(*args: Any) -> None:
        seen.append("checkout")

    def on_checkin(*args: Any) -> None:
        seen.append("checkin")

    event.listen(pool.pool, "checkout", on_checkout)
    event.listen(pool.pool, "checkin", on_checkin)
    ident = identity_of("listened")
    claim = store.acquire(ident, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    assert store.complete(claim, RESPONSE) == claim.expires_at_ms
    assert seen == ["checkout", "checkin"] * 2


def test_i11_c26_a_pre_pinging_pool_replaces_a_dead_connection_before_the_statement(
    pg_database: URL, runs
) -> None:
    """``pool_pre_ping=True``: the ping on checkout still runs on the direct path, so a
    connection the server dropped is replaced before the statement (no failed attempt)."""
    url = driver_url(pg_database, "psycopg2")
    name = f"idem_ping_{uuid.uuid4().hex[:10]}"
    store = DurableStore(
        lambda: create_engine(
            url, pool_size=1, pool_pre_ping=True, connect_args={"application_name": name}
        ),
        table_name=name,
        create_table=True,
    )
    try:
        store.acquire(identity_of("ping-warm"), ttl=60, lease=30)
        runs.clear()
        assert terminate_pooled_connections(store) >= 1
        claim = store.acquire(identity_of("ping"), ttl=60, lease=30)
        assert not isinstance(claim, Record)
        assert len(runs) == 1  # without the ping: a failed run, then the retry
    finally:
        store.table.drop(store.engine, checkfirst=True)
        store.engine.dispose()


def test_i11_c14_c20_release_runs_on_the_direct_path_fenced_by_the_token(store, runs) -> None:
    """C14/C20: a release is one fenced DELETE on the direct path: a stranger's token
    deletes nothing, the owner's deletes the record, and the key can be claimed anew."""
    ident = identity_of("release-1")
    claim = store.acquire(ident, ttl=60, lease=30)
    assert not isinstance(claim, Record)
    runs.clear()
    stranger = Claim(claim.record_id, "0" * 32, claim.expires_at_ms, "new")
    assert store.release(stranger) is False
    assert store.get(ident.key_digest) is not None
    assert store.release(claim) is True
    assert store.get(ident.key_digest) is None
    assert len(runs) == 4
    assert not isinstance(store.acquire(ident, ttl=60, lease=30), Record)


def test_i11_a_kept_cursor_never_keeps_a_large_stored_body_alive(store, runs) -> None:
    """Each pooled connection keeps one cursor for its next statement, and a cursor holds
    its last result: a replay of a large body lets that cursor go with it."""
    from flask_idempotency._wire.sqla_pool import _CURSOR, _KEPT_RESULT_BYTES

    pool = store._single()
    assert pool is not None
    for size, kept in ((100, True), (_KEPT_RESULT_BYTES + 1, False)):
        ident = identity_of(f"kept-{size}")
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        response = StoredResponse(201, (), b"x" * size)
        assert store.complete(claim, response) == claim.expires_at_ms
        replay = store.acquire(ident, ttl=60, lease=30)
        assert isinstance(replay, Record) and replay.response == response
        # Statements one at a time: the pool has made one connection, the one just used.
        entry = pool.pool._do_get()  # type: ignore[attr-defined]
        try:
            assert (_CURSOR in entry.info) is kept, size
        finally:
            entry.checkin(_fairy_was_created=False)
