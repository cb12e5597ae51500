"""How the store's own engines are made, per database: fail fast, pools sized, pragmas set.

An app that passes ``db=`` or ``engine=`` keeps its own engine; one the extension
builds from ``IDEMPOTENCY_DATABASE_URI`` comes from here, owned by :mod:`..process`
(reset after fork, disposed when its app's store is gone, C47).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from .. import process


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
    url = make_url(uri)
    backend = url.get_backend_name()
    kwargs: dict[str, Any] = {}
    if backend == "postgresql":
        driver = url.get_driver_name()
        if driver in ("psycopg2", ""):
            kwargs["connect_args"] = {"connect_timeout": 3}
        elif driver == "psycopg":
            # No server-side prepared statements: behind a transaction pooler (PgBouncer)
            # the next transaction may run on another server connection, where "_pg3_0"
            # already exists or does not exist at all.
            kwargs["connect_args"] = {"connect_timeout": 3, "prepare_threshold": None}
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
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()
