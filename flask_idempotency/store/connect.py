"""How the store's own engines are made, per database: fail fast, pools sized, pragmas set.

CONTRACT C25, C47, C55.

An app that passes ``db=`` or ``engine=`` keeps its own engine; one the extension
builds from ``IDEMPOTENCY_DATABASE_URI`` comes from here, owned by :mod:`..process`
(reset after fork, disposed when its app's store is gone, C47).

PostgreSQL connections give up on a host that does not accept them within
:data:`CONNECT_TIMEOUT` seconds (each host of a multi-host URL in turn), and on one
that stops acknowledging what they send within :data:`~.deadline.STATEMENT_DEADLINE`
(``tcp_user_timeout``); keepalives find a dead peer of an idle pooled connection.
A multi-host URL may be written as libpq writes it in the query (``?host=h1:p1,h2:p2``);
it is rewritten to the form SQLAlchemy reads (:func:`store_url`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import Pool, StaticPool

from .. import process
from .deadline import STATEMENT_DEADLINE

#: Seconds a database host has to accept a connection (libpq: per host of a multi-host
#: URL, so a dead first host costs this much before the next is tried).
CONNECT_TIMEOUT = 3
#: TCP keepalives of the store's PostgreSQL connections (libpq's options): an idle
#: pooled connection whose peer vanished is found within about a minute, and a NAT or
#: firewall between keeps seeing traffic on it.
KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}
#: The first libpq with ``tcp_user_timeout`` (an older one refuses the option).
_TCP_USER_TIMEOUT_LIBPQ = 120000
#: The pools of engines built here: their sessions are the store's alone, so a session
#: setting (MariaDB's ``max_statement_time``, :mod:`.engines`) never reaches an app's own
#: queries the way it would on an engine the app passed in.
OWN_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()


def lazy_engine(uri: str) -> Callable[[], Engine]:
    """The engine for ``uri``, built on first use and owned by :mod:`process` (reset after
    fork). No lock: building an engine opens no connection, so racing first requests may
    both build one and agree on the first stored (a lock made here, before gevent patched
    ``threading`` under ``--preload``, would stall a gevent worker)."""
    slot: dict[str, Engine] = {}

    def factory() -> Engine:
        engine = slot.get("value")
        if engine is None:
            engine = process.once(slot, lambda: create_store_engine(uri))
            process.own_engine(engine)
            # Its pooled connections are closed when the app's store is gone, not left
            # to the garbage collector (C47; Python 3.13 warns of each one). Racing first
            # callers may both register this; disposing twice is harmless.
            weakref.finalize(factory, engine.dispose)
        return engine

    return factory


def create_store_engine(uri: str, **options: Any) -> Engine:
    """An engine tuned for the store: fail fast when the database is unreachable (C25).

    PostgreSQL engines work behind a transaction pooler such as PgBouncer on both
    drivers: psycopg2 never prepares, and psycopg 3 is told not to.
    """
    url = store_url(uri)
    backend = url.get_backend_name()
    kwargs: dict[str, Any] = {}
    if backend == "postgresql":
        driver = url.get_driver_name()
        if driver in ("psycopg2", ""):
            kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT, **_tcp_options(driver)}
        elif driver == "psycopg":
            # No server-side prepared statements: behind a transaction pooler (PgBouncer)
            # the next transaction may run on another server connection, where "_pg3_0"
            # already exists or does not exist at all.
            kwargs["connect_args"] = {
                "connect_timeout": CONNECT_TIMEOUT,
                "prepare_threshold": None,
                **_tcp_options(driver),
            }
        kwargs["pool_size"] = 10
        kwargs["max_overflow"] = 20
        kwargs["pool_timeout"] = 5
    elif backend in ("mysql", "mariadb"):
        # utf8mb4: scopes and paths are any Unicode; the driver's default may be latin1.
        kwargs["connect_args"] = {"connect_timeout": 3, "charset": "utf8mb4"}
        kwargs["pool_size"] = 10
        kwargs["max_overflow"] = 20
        kwargs["pool_timeout"] = 5
        kwargs["pool_recycle"] = 3600  # below the server's wait_timeout (8 h by default)
        # Every store transaction ends with its own COMMIT or ROLLBACK (through a
        # Connection), so the pool's rollback-on-return would only add a round trip
        # (the MySQL drivers send it even with no transaction open) and, when the
        # network drops right after a COMMIT, log a traceback for an outage (C25).
        kwargs["pool_reset_on_return"] = None
    elif backend == "sqlite":
        kwargs["connect_args"] = {"timeout": 30, "check_same_thread": False}
        if url.database in (None, "", ":memory:"):
            kwargs["poolclass"] = StaticPool
    kwargs.update(options)
    engine = create_engine(url, **kwargs)
    OWN_POOLS.add(engine.pool)
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _tcp_options(driver: str) -> dict[str, Any]:
    """libpq's TCP options for the store's connections: keepalives, and where this
    driver's libpq has it, ``tcp_user_timeout`` (data unacknowledged for
    :data:`~.deadline.STATEMENT_DEADLINE` seconds: the connection is dead)."""
    options: dict[str, Any] = dict(KEEPALIVES)
    if _libpq_version(driver) >= _TCP_USER_TIMEOUT_LIBPQ:
        options["tcp_user_timeout"] = int(STATEMENT_DEADLINE * 1000)
    return options


def _libpq_version(driver: str) -> int:
    """The version of the libpq ``driver`` runs on (``120000`` for 12.0), 0 when unknown."""
    try:
        if driver == "psycopg":
            import psycopg

            return int(psycopg.pq.version())
        import psycopg2.extensions

        return int(psycopg2.extensions.libpq_version())
    except Exception:  # not installed (create_engine says so), or a build without it
        return 0


def store_url(uri: str | URL) -> URL:
    """``uri`` as SQLAlchemy reads it, with libpq's ``?host=h1:p1,h2:p2`` rewritten to
    SQLAlchemy's ``?host=h1:p1&host=h2:p2``.

    SQLAlchemy takes ``?host=h1:p1&host=h2:p2`` and ``?host=h1,h2&port=p1,p2``, but
    turns ``?host=h1:p1,h2:p2`` into the hosts ``"h1:p1"`` and ``"h2:p2"`` with the
    port ``","``: every connection fails, the host names do not resolve. (libpq's
    ``postgresql://h1:p1,h2:p2/db`` SQLAlchemy cannot parse at all: ``init_app``
    refuses it, showing the query form.)
    """
    url = make_url(uri)
    host = url.query.get("host")
    if (
        url.get_backend_name() == "postgresql"
        and isinstance(host, str)
        and "," in host
        and ":" in host
        and "port" not in url.query
    ):
        pairs = [("host", entry) for entry in host.split(",") if entry]
        url = url.difference_update_query(["host"]).update_query_pairs(pairs)
    return url


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
