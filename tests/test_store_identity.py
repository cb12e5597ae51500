"""A store is named by something its database holds, not by the text of its URL (C41).

Issue 26 item 6: two services whose database URLs read the same but reach different
databases (two stacks' ``postgresql://…@db/app``, ``localhost`` on two hosts, a relative
SQLite path from two working directories) must never see each other's records in a
shared Redis. The Redis origin is the digest of (the store's identity, the table): a
random id written once, when the table is created, into ``<table>_store``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
from flask import Flask, jsonify, request
from sqlalchemy.engine import make_url

from flask_idempotency import Idempotency, idempotent, signals

KEY = "order-1001"


def sqlite_service(name: str, directory: Path, client: Any, **config: Any) -> SimpleNamespace:
    """A service whose store is ``sqlite:///idempotency.sqlite3``: the same URL text in every
    working directory, a different file in each."""
    app = Flask(name, instance_path=str(directory / "instance"))
    app.config.update(
        IDEMPOTENCY_DATABASE_URI="sqlite:///idempotency.sqlite3",
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_WAIT=2,
    )
    app.config.update(config)
    Idempotency(app, redis=client)
    calls: list[dict[str, Any]] = []
    replays: list[str] = []

    @app.post("/charge")
    @idempotent
    def charge() -> Any:
        body = request.get_json()
        calls.append(body)
        return jsonify(service=name, card=body["card"], n=len(calls)), 201

    def replayed(sender: Any, **extra: Any) -> None:
        replays.append(extra["source"])

    signals.request_replayed.connect(replayed, app, weak=False)
    return SimpleNamespace(
        app=app,
        calls=calls,
        replays=replays,
        state=app.extensions["idempotency"],
        post=lambda body: app.test_client().post(
            "/charge", json=body, headers={"Idempotency-Key": KEY}
        ),
    )


@pytest.fixture
def two_directories(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    a, b = tmp_path / "stack-a", tmp_path / "stack-b"
    a.mkdir()
    b.mkdir()
    yield a, b


def dispose(*services: SimpleNamespace) -> None:
    for service in services:
        engines = service.state.store._engines
        if engines is not None:
            engines[0].dispose()


def test_i26_6_c41_same_sqlite_url_text_in_two_working_directories_shares_no_record(
    two_directories: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Service A and service B both read ``sqlite:///idempotency.sqlite3``, each from its own
    working directory, so each has its own database; they share one Redis and its default
    prefix. B's database has never seen the key: B runs its own view and answers with its
    own response, never A's cached one (C41)."""
    server = fakeredis.FakeServer()
    dir_a, dir_b = two_directories

    monkeypatch.chdir(dir_a)
    a = sqlite_service("stack_a", dir_a, fakeredis.FakeRedis(server=server))
    first = a.post({"card": "4111 1111 1111 1111"})
    assert first.status_code == 201
    again = a.post({"card": "4111 1111 1111 1111"})
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert a.replays == ["cache"]  # A's record is in the shared Redis
    assert (dir_a / "idempotency.sqlite3").exists()

    monkeypatch.chdir(dir_b)
    b = sqlite_service("stack_b", dir_b, fakeredis.FakeRedis(server=server))
    try:
        answer = b.post({"card": "4111 1111 1111 1111"})
        assert "Idempotent-Replayed" not in answer.headers, f"B replayed A's {answer.json}"
        assert (dir_b / "idempotency.sqlite3").exists()
        assert answer.status_code == 201
        assert answer.get_json()["service"] == "stack_b"
        assert b.calls == [{"card": "4111 1111 1111 1111"}]
        assert b.replays == []
        assert a.state.cache.origin != b.state.cache.origin
    finally:
        dispose(a, b)


# -- the same with real servers: two PostgreSQL databases behind one address -------------------


@pytest.fixture
def real_redis() -> Iterator[tuple[str, str]]:
    """The machine's Redis (never flushed) and a prefix of this test's own, cleaned after."""
    import redis

    from tests.conftest import REDIS_URL, service_missing

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_missing("Redis", str(exc))
    prefix = f"test-i26-6-{uuid.uuid4().hex[:8]}"
    try:
        yield REDIS_URL, prefix
    finally:
        for name in client.scan_iter(match=f"{prefix}:*"):
            client.delete(name)
        client.close()


def pg_service(name: str, url: str, redis_url: str, prefix: str, table: str) -> SimpleNamespace:
    app = Flask(name)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=url,
        IDEMPOTENCY_TABLE=table,
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_REDIS_URL=redis_url,
        IDEMPOTENCY_REDIS_PREFIX=prefix,
        IDEMPOTENCY_WAIT=2,
    )
    Idempotency(app)
    calls: list[dict[str, Any]] = []
    replays: list[str] = []

    @app.post("/charge")
    @idempotent
    def charge() -> Any:
        body = request.get_json()
        calls.append(body)
        return jsonify(service=name, card=body["card"], n=len(calls)), 201

    def replayed(sender: Any, **extra: Any) -> None:
        replays.append(extra["source"])

    signals.request_replayed.connect(replayed, app, weak=False)
    return SimpleNamespace(
        app=app,
        calls=calls,
        replays=replays,
        state=app.extensions["idempotency"],
        post=lambda body: app.test_client().post(
            "/charge", json=body, headers={"Idempotency-Key": KEY}
        ),
    )


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(180)
def test_i26_6_c41_same_postgresql_url_reaching_two_databases_shares_no_record(
    tmp_path: Path, real_redis: tuple[str, str]
) -> None:
    """Two stacks, each with its own PostgreSQL, both reached as
    ``postgresql://postgres@127.0.0.1:<port>/app_…``: stack A's database behind a loopback
    proxy on that port, then, after A's proxy is gone, stack B's behind a proxy on the same
    port (the ``db`` host of two compose stacks, ``localhost`` on two hosts). One real Redis,
    one prefix, one table name: the URL texts are equal, the databases are not. B's
    database has never seen the key, so B runs its view; it never replays A's (C41)."""
    from sqlalchemy import create_engine, text

    from tests.conftest import PG_BASE_URL, service_missing
    from tests.support.postgres_server import PostgresServer
    from tests.support.tcp_proxy import TcpProxy

    redis_url, prefix = real_redis
    base = make_url(PG_BASE_URL)
    database = f"app_{uuid.uuid4().hex[:10]}"
    table = "idempotency_keys"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{database}"'))
    except Exception as exc:
        admin.dispose()
        service_missing("PostgreSQL", str(exc))
    try:
        private = PostgresServer(tmp_path / "pg-b").start()
    except (FileNotFoundError, RuntimeError) as exc:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()
        service_missing("a private PostgreSQL", str(exc))
    proxy_a = TcpProxy(base.host or "127.0.0.1", base.port or 5432).start()
    port = proxy_a.port
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/{database}"
    proxy_b: TcpProxy | None = None
    services: list[SimpleNamespace] = []
    try:
        private.execute(f'CREATE DATABASE "{database}"')

        a = pg_service("stack_a", url, redis_url, prefix, table)
        services.append(a)
        assert a.post({"card": "4111 1111 1111 1111"}).status_code == 201
        assert a.post({"card": "4111 1111 1111 1111"}).headers.get("Idempotent-Replayed")
        assert a.replays == ["cache"]  # A's record is in the shared Redis
        a.state.store.engine.dispose()
        proxy_a.stop()

        proxy_b = TcpProxy("127.0.0.1", private.port)
        proxy_b.port = port  # the same address, another stack's database
        proxy_b.start()
        b = pg_service("stack_b", url, redis_url, prefix, table)
        services.append(b)
        answer = b.post({"card": "4111 1111 1111 1111"})
        assert "Idempotent-Replayed" not in answer.headers, f"B replayed A's {answer.json}"
        assert answer.status_code == 201
        assert answer.get_json()["service"] == "stack_b"
        assert b.calls == [{"card": "4111 1111 1111 1111"}]
        assert b.replays == []
        assert a.state.store.identity() != b.state.store.identity()
        rows = private.execute(f'SELECT count(*) FROM "{table}"', database=database)
        assert rows == [(1,)]  # B's own record, in B's own database
        assert b.post({"card": "4111 1111 1111 1111"}).headers.get("Idempotent-Replayed")
        assert b.replays == ["cache"]  # and B's tier works: its own record, cached
    finally:
        for service in services:
            service.state.store.engine.dispose()
        if proxy_b is not None:
            proxy_b.stop()
        proxy_a.stop()
        private.stop()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))
        admin.dispose()


# -- the identity: written once, read once ---------------------------------------------------


def identity_rows(store: Any) -> list[tuple[Any, ...]]:
    from sqlalchemy import select

    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(store.identity_table))]


def test_i26_6_c41_create_table_writes_one_identity_and_it_is_kept(make_app: Any) -> None:
    """``create_table`` writes the row with the table; creating again changes nothing, and the
    origin is the digest of (id, table), not of the URL."""
    from flask_idempotency.tier import store_origin

    app, _ = make_app()
    store = app.extensions["idempotency"].store
    (row,) = identity_rows(store)
    singleton, store_id, created_at_ms, secret = row
    assert singleton == 1 and len(store_id) == 32 and created_at_ms > 0
    assert len(secret) == 64 and secret != store_id  # 256 random bits, its own (C60)
    store.create_table()
    assert identity_rows(store) == [row]
    assert store.identity().id == store_id
    assert store.identity().secret == secret.encode()
    assert store_origin(store_id, store.table.fullname) != store_origin(
        store_id, store.table.fullname + "_other"
    )


def test_i26_6_c41_db_create_all_writes_the_identity_too(tmp_path: Path) -> None:
    """With ``db=``, the table is on the app's metadata: ``db.create_all()`` creates it and
    writes its row in the same breath (C29)."""
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("create_all_app")
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path}/app.sqlite3"
    db = SQLAlchemy(app)
    Idempotency(app, db=db)
    store = app.extensions["idempotency"].store
    assert "idempotency_keys_store" in db.metadata.tables
    with app.app_context():
        db.create_all()
        (row,) = identity_rows(store)
        assert store.identity().id == row[1]
        db.engine.dispose()


@pytest.mark.postgres
def test_i26_6_c41_an_empty_identity_table_gets_one_row_from_racing_processes(
    pg_url: Any, pg_table: str
) -> None:
    """An autogenerated migration creates the table without its row: the first processes to
    use Redis write it, and however many race, they agree on one id (one row)."""
    import threading

    from flask_idempotency.store import DurableStore
    from flask_idempotency.store.connect import create_store_engine

    url = pg_url.render_as_string(hide_password=False)
    engines = [create_store_engine(url) for _ in range(8)]
    stores = [DurableStore(lambda e=e: e, table_name=pg_table) for e in engines]
    stores[0].identity_table.create(engines[0])
    with engines[0].begin() as conn:
        conn.execute(stores[0].identity_table.delete())  # as autogenerate leaves it: empty
    ids: list[str] = []
    start = threading.Barrier(len(stores))

    def first_use(store: DurableStore) -> None:
        start.wait()
        ids.append(store.identity().id)

    threads = [threading.Thread(target=first_use, args=(s,)) for s in stores]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(ids) == len(stores) and len(set(ids)) == 1, ids
        assert [row[1] for row in identity_rows(stores[0])] == ids[:1]
    finally:
        stores[0].identity_table.drop(engines[0], checkfirst=True)
        for engine in engines:
            engine.dispose()


def test_i26_6_c41_the_identity_is_read_once_per_process_not_per_request(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Redis tier asks for the store's identity at first use, then never again."""
    from sqlalchemy import event

    server = fakeredis.FakeServer()
    app, _ = make_app(redis=fakeredis.FakeRedis(server=server))
    store = app.extensions["idempotency"].store
    identity_table = store.identity_table.name
    statements: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if identity_table in statement:
            statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", seen)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(ok=True), 201

    client = app.test_client()
    for n in range(20):
        assert client.post("/pay", json={}, headers={"Idempotency-Key": f"k{n % 5}"}).status_code
    assert len(statements) == 1, statements
    assert statements[0].lstrip().upper().startswith("SELECT")


# -- no identity: the Redis tier stays off, requests stay protected (C45) ------------------------


def test_i26_6_c45_a_missing_identity_keeps_redis_off_and_says_what_to_run(
    make_app: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deployment that upgraded the library but not its database: the identity table is
    missing and ``create_table`` is off. No cached record can be told from another store's,
    so the Redis tier stays off: nothing is written to Redis or read from it, and every
    request is still decided by the database (one execution, replays from there). It is
    logged at ERROR, once, with the command; ``check`` fails with the same; once the
    operator creates it, the tier comes back without a restart."""
    from flask_idempotency.store import schema

    monkeypatch.setattr(schema, "IDENTITY_RETRY_MISSING", 0.0)
    server = fakeredis.FakeServer()
    spy = fakeredis.FakeRedis(server=server)
    app, _ = make_app(redis=fakeredis.FakeRedis(server=server))
    store = app.extensions["idempotency"].store
    store.identity_table.drop(store.engine)
    calls: list[int] = []
    sources: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        return jsonify(n=len(calls)), 201

    signals.request_replayed.connect(
        lambda sender, **extra: sources.append(extra["source"]), app, weak=False
    )
    runner = app.test_cli_runner()
    checked = runner.invoke(args=["idempotency", "check"])
    assert checked.exit_code == 1, checked.output
    assert "idempotency_keys_store" in checked.output
    assert "flask idempotency create-table" in checked.output

    client = app.test_client()
    with caplog.at_level("INFO", logger="flask_idempotency"):
        answers = [client.post("/pay", json={}, headers={"Idempotency-Key": "k"}) for _ in range(4)]
    assert [a.status_code for a in answers] == [201] * 4
    assert calls == [1]
    assert [a.headers.get("Idempotent-Replayed") for a in answers[1:]] == ["true"] * 3
    assert sources == ["database"] * 3
    assert spy.keys("*") == []  # not one name in Redis: it cannot know which are its own
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "idempotency_keys_store" in errors[0].getMessage()
    assert "flask idempotency create-table" in errors[0].getMessage()

    created = runner.invoke(args=["idempotency", "create-table"])
    assert created.exit_code == 0, created.output
    assert "Created the table 'idempotency_keys_store'" in created.output
    assert "'idempotency_keys'" not in created.output  # that one was there already

    # The tier resumes once its back-off lets a request through (C24): records cached again.
    def cached_again() -> bool:
        client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        return bool(spy.keys("*:{*}"))

    from tests.support.waiting import wait_until

    with caplog.at_level("INFO", logger="flask_idempotency"):
        wait_until(cached_again, "the Redis tier back in use", within=15)
    assert calls == [1]
    # The database's table was missing, not Redis: the tier's return says so.
    resumed = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert resumed == ["idempotency: this store's identity is read; cache and wake-ups resumed"]
    checked = runner.invoke(args=["idempotency", "check"])
    assert checked.exit_code == 0, checked.output
    assert f"the store's identity {store.identity().id}" in checked.output
    assert "origin: " in checked.output


def test_i26_6_c41_without_redis_a_missing_identity_is_only_a_warning(make_app: Any) -> None:
    """Only the Redis tier reads the identity: without one, ``check`` warns and passes."""
    app, _ = make_app()
    store = app.extensions["idempotency"].store
    store.identity_table.drop(store.engine)
    result = app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert result.exit_code == 0, result.output
    assert "warning: the table 'idempotency_keys_store'" in result.output
    assert "needed once IDEMPOTENCY_REDIS_URL is set" in result.output


def test_i26_6_c25_a_database_down_at_first_use_is_a_503_and_nothing_in_redis(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The identity cannot be read while the database is down: the tier stays off (no name
    it could use is known to be this store's), the request is the usual 503, and the next
    one asks again. That is the database's outage, not Redis's, and the log says so (it
    said "Redis unavailable")."""
    from tests.support.redis_server import free_port

    server = fakeredis.FakeServer()
    spy = fakeredis.FakeRedis(server=server)
    app = Flask("down_at_start", instance_path=str(tmp_path / "instance"))
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/x",
        IDEMPOTENCY_WAIT=0,
    )
    Idempotency(app, redis=fakeredis.FakeRedis(server=server))

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(ok=True), 201

    with caplog.at_level("INFO", logger="flask_idempotency"):
        answer = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "k"})
    assert answer.status_code == 503
    assert answer.get_json()["code"] == "store-unavailable"
    assert spy.keys("*") == []
    state = app.extensions["idempotency"]
    assert state.store._identity is None
    assert not [r for r in caplog.records if "Redis unavailable" in r.getMessage()]
    assert any("waits for this store's identity" in r.getMessage() for r in caplog.records)
    assert state.cache.outage.cause == "identity"
