"""The ``Idempotency`` extension object: configuration, wiring, per-app state."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from flask import Flask, current_app, got_request_exception, request
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from . import atomic, forms, lifecycle, process
from .cache import NoCache, ResponseCache
from .config import ConfigVars, EffectiveOptions, RouteOptions, Settings
from .fingerprint import default_scope
from .jobs import Once
from .records import COMPLETED, Claim, Completed, Identity, Record
from .store import DurableStore
from .store.clock import DatabaseClock
from .wakeup import WakeupHub

EXTENSION_NAME = "idempotency"
#: Routes whose merged options :meth:`AppState.effective_options` keeps.
_OPTIONS_KEPT = 1024
log = logging.getLogger("flask_idempotency")


@dataclasses.dataclass
class AppState:
    """Everything the extension keeps for one app, in ``app.extensions["idempotency"]``."""

    extension: Idempotency
    settings: Settings
    store: DurableStore
    cache: ResponseCache
    wakeups: WakeupHub
    #: The database's clock as seen from this process: how long a cached copy may live (C42).
    clock: DatabaseClock = dataclasses.field(default_factory=DatabaseClock)
    _options: dict[int, tuple[RouteOptions, EffectiveOptions]] = dataclasses.field(
        default_factory=dict
    )
    #: One line per outage of the durable store, not one per failed request.
    outage_log: lifecycle.ThrottledLog = dataclasses.field(default_factory=lifecycle.ThrottledLog)
    #: Whether this app has said that it runs on the default scope (once per app): a
    #: plain flag, read on every request without a call.
    _default_scope_told: bool = False
    _default_scope_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def look_up(
        self, ident: Identity, *, ttl: float, lease: float, guard_locks: bool
    ) -> tuple[Claim | Completed | Record, str]:
        """Cache first (completed records only), then claim or read the durable record.

        Returns the outcome and where it came from (``cache`` or ``database``). A
        completed durable record is promoted for the time it has left by the
        database's clock (C23, C42); every answer of the store refreshes that clock.
        Requests and ``once()`` both decide from this one lookup.
        """
        cached = self.cache.get(ident.key_digest)
        if cached is not None:  # Redis expires each copy when its record expires (C42)
            return cached, "cache"
        sent_at = self.clock.mark()
        outcome = self.store.acquire(ident, ttl=ttl, lease=lease, guard_locks=guard_locks)
        if isinstance(outcome, Record):
            self.clock.observe(outcome.now_ms, sent_at)
            if outcome.state == COMPLETED:
                completed = outcome.completed()
                if type(self.cache) is not NoCache:  # (without a cache tier: nothing to do)
                    self.promote(ident.key_digest, completed)  # read-through (C23)
                return completed, "database"
        elif outcome.how in ("new", "replaced"):  # the database set expiry = its now + ttl
            self.clock.observe(outcome.expires_at_ms - int(ttl * 1000), sent_at)
        return outcome, "database"

    def promote(self, key_digest: str, completed: Completed) -> None:
        """Cache a completed record for the time it has left by the database's clock (C42)."""
        self.cache.promote(key_digest, completed, self.clock.remaining_ms(completed.expires_at_ms))

    def announce_completed(self, key_digest: str, completed: Completed) -> None:
        """After the durable commit: promote, then wake the waiters everywhere (C23)."""
        together = getattr(self.cache, "promote_and_publish", None)
        if together is not None and together(
            key_digest,
            completed,
            self.clock.remaining_ms(completed.expires_at_ms),
            self.wakeups.channel,
            "done",
        ):  # the cached copy and the wake-up left in one round trip
            self.wakeups.wake(key_digest)
            return
        self.promote(key_digest, completed)
        self.wakeups.announce(key_digest, "done")

    def effective_options(self, route: RouteOptions) -> EffectiveOptions:
        """The options a request to a route with ``route`` runs with, merged once per route.

        Found by the route options' identity: hashing them (a dataclass hashes all its
        fields) cost more than the look-up. The entry holds ``route``, so its id is never
        another object's while it is there; bounded, for callers with passing options.
        """
        entry = self._options.get(id(route))
        if entry is not None and entry[0] is route:
            return entry[1]
        options = EffectiveOptions.merge(self.settings, route)
        if len(self._options) >= _OPTIONS_KEPT:
            self._options.clear()
        self._options[id(route)] = (route, options)
        return options

    @property
    def has_db(self) -> bool:
        """Whether the table lives on a Flask-SQLAlchemy ``db`` (migrations own it then)."""
        return self.extension._db is not None

    def require_db(self) -> Any:
        """The Flask-SQLAlchemy ``db`` that atomic mode needs (C40)."""
        db = self.extension._db
        if db is None:
            raise RuntimeError(
                "@idempotent(atomic=True) needs Idempotency(db=db): the view's writes and the"
                " idempotency record must commit in one database transaction."
            )
        return db

    def scope_for_request(self, req: Any = None, app: Flask | None = None) -> str:
        """The scope of the current request: the registered loader's, else the default (C5).

        ``req`` and ``app``: the request and its app, when the caller has them (each saves
        a context look-up per request).
        """
        loader = self.extension._scope_loader
        if loader is not None:
            scope = loader()
            if scope is not None:
                text = str(scope)
                if text != "":
                    return "scope:" + text
        elif not self._default_scope_told:
            self._tell_default_scope()
        return default_scope(request if req is None else req, app)

    def _tell_default_scope(self) -> None:
        """Warn once per app that keys are scoped by the defaults, and what they risk (C46)."""
        with self._default_scope_lock:
            if self._default_scope_told:
                return
            self._default_scope_told = True
        log.warning(
            "idempotency: no scope_loader is registered, so keys are scoped by the Flask-Login"
            " user when one is logged in, else by a digest of the Authorization header (a client"
            " that refreshes its token between retries gets the view run again), else shared"
            " as 'anonymous'. Register @idempotency.scope_loader returning the tenant or user"
            " id."
        )


class Idempotency:
    """Idempotency-Key handling for the views marked ``@idempotent``.

    ``db`` is a Flask-SQLAlchemy instance: the records table is defined on its
    metadata (so ``flask db migrate`` sees it) and its engine is the store.
    ``engine`` is a SQLAlchemy engine to use instead. ``redis`` is a ready Redis
    client for the cache tier and wake-ups. Constructor arguments win over
    ``app.config``.
    """

    def __init__(
        self,
        app: Flask | None = None,
        *,
        db: Any = None,
        redis: Any = None,
        engine: Engine | None = None,
    ) -> None:
        self._db = db
        self._redis = redis
        self._engine = engine
        self._scope_loader: Callable[[], Any] | None = None
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Put the layer in front of the app's marked views; register the CLI and the store."""
        existing = app.extensions.get(EXTENSION_NAME)
        if existing is not None:
            if existing.extension is self:
                return
            raise RuntimeError("Another Idempotency instance is already registered on this app.")
        settings = Settings.from_config(app.config)
        if settings.atomic and self._db is None:
            raise ValueError("IDEMPOTENCY_ATOMIC needs Idempotency(db=db) (C40).")
        _check_registered_views(app, settings)
        store = self._build_store(app, settings)
        wakeups = WakeupHub(max_waiters=settings.max_waiters)
        cache = self._build_cache(settings, store, wakeups)
        app.extensions[EXTENSION_NAME] = AppState(self, settings, store, cache, wakeups)
        lifecycle.install(app)
        app.add_template_global(forms.idempotency_key_field, "idempotency_key_field")  # C49
        got_request_exception.connect(lifecycle.mark_failed, app, weak=False)
        if self._db is not None:
            atomic.guard_sessions(self._db)
        from .cli import idempotency_cli

        app.cli.add_command(idempotency_cli)
        _warn_unread_environment(app)
        log.info("idempotency: app %r uses %s", app.name, self._describe_tiers(app, settings))

    def scope_loader(self, func: Callable[[], Any]) -> Callable[[], Any]:
        """Register the function that names whose key this is: tenant, account or user (C5)."""
        self._scope_loader = func
        return func

    def once(
        self,
        key: str | Callable[..., Any],
        *,
        scope: str = "jobs",
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        payload: Any = None,
        name: str | None = None,
        atomic: bool = False,
    ) -> Once:
        """Run work outside a request once per key: a context manager and decorator (C50).

        The same claim, lease, fencing and replay as a protected view, on the same
        store; the result (JSON-serialisable) is what a duplicate gets. ``ttl``,
        ``lease`` and ``wait`` default to the app's settings. See :mod:`.jobs`.
        """
        return Once(
            self,
            key,
            scope=scope,
            ttl=ttl,
            lease=lease,
            wait=wait,
            payload=payload,
            name=name,
            atomic=atomic,
        )

    # -- per-app access ---------------------------------------------------------------

    @property
    def state(self) -> AppState:
        """This extension's state on the current app."""
        state = current_app.extensions.get(EXTENSION_NAME)
        if state is None or state.extension is not self:
            raise RuntimeError(
                "Flask-Idempotency is not registered on the current app."
                " Did you forget to call init_app(app)?"
            )
        return state  # type: ignore[no-any-return]

    @property
    def store(self) -> DurableStore:
        """The durable store of the current app."""
        return self.state.store

    # -- saying what is in use (no I/O: read from configuration, never from a server) --

    def _describe_tiers(self, app: Flask, settings: Settings) -> str:
        """``store: <dialect> (<where>), table 'name'; cache: …; wake-ups: …`` for the log."""
        if self._engine is not None:
            store = f"{_describe_url(self._engine.url)} (engine=)"
        elif self._db is not None:
            uri = app.config.get("SQLALCHEMY_DATABASE_URI")
            store = f"{_describe_url(uri) if uri else 'the default engine'} (Flask-SQLAlchemy db=)"
        elif settings.database_uri:
            store = _describe_url(settings.database_uri)
        else:
            store = "sqlite (the default: the instance folder)"
        cache = redis_target(settings, self._redis)
        if cache is None:
            tiers = "cache: none; wake-ups: this process only (no IDEMPOTENCY_REDIS_URL)"
        else:
            tiers = (
                f"cache: Redis {cache}, prefix {settings.redis_prefix!r};"
                " wake-ups: Redis pub/sub across processes"
            )
        return f"store: {store}, table {settings.table!r}; {tiers}"

    # -- building the tiers ---------------------------------------------------------

    def _build_store(self, app: Flask, settings: Settings) -> DurableStore:
        metadata = self._db.metadata if self._db is not None else None
        create_table = settings.create_table
        if self._engine is not None:
            engine = self._engine
            factory: Callable[[], Engine] = lambda: engine  # noqa: E731
        elif self._db is not None:
            db = self._db

            def factory() -> Engine:
                with app.app_context():
                    return db.engine  # type: ignore[no-any-return]

        else:
            uri = settings.database_uri
            if uri is None:
                os.makedirs(app.instance_path, exist_ok=True)
                uri = "sqlite:///" + os.path.join(app.instance_path, "idempotency.sqlite3")
                if create_table is None:
                    create_table = True  # the embedded default sets itself up
            factory = _lazy_engine(uri)
        return DurableStore(
            factory,
            metadata=metadata,
            table_name=settings.table,
            create_table=bool(create_table),
            async_claim=settings.async_claim,
        )

    def _build_cache(
        self, settings: Settings, store: DurableStore, wakeups: WakeupHub
    ) -> ResponseCache:
        if self._redis is None and not settings.redis_url:
            return NoCache()
        from .redis_tier import RedisTier, store_origin

        def origin() -> str:
            # Resolved on first use: with db= or engine= the engine may not exist yet.
            return store_origin(store.engine_without_setup().url, store.table.fullname)

        tier = RedisTier.from_settings(settings, client=self._redis, origin=origin)
        wakeups.channel = tier.notifier
        return tier.cache


def redis_target(settings: Settings, client: Any) -> str | None:
    """Where the Redis tier points, password hidden; ``None`` when there is none."""
    if client is not None:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
        where = kwargs.get("path") or (
            f"{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
            if "host" in kwargs
            else None
        )
        return f"(Redis client {type(client).__name__}{' at ' + where if where else ''})"
    if settings.redis_url:
        return _describe_url(settings.redis_url)
    return None


def _describe_url(url: Any) -> str:
    """A database or Redis URL with its password hidden."""
    try:
        return str(make_url(url).render_as_string(hide_password=True))
    except Exception:  # not a URL SQLAlchemy can parse: show only its scheme
        return str(url).split(":", 1)[0] + "://…"


#: Flask's convention for configuration from the environment: ``FLASK_<KEY>`` read by
#: ``app.config.from_prefixed_env()``.
_FLASK_ENV_PREFIX = "FLASK_"


def _warn_unread_environment(app: Flask) -> None:
    """Name ``IDEMPOTENCY_*`` settings set in the environment that ``app.config`` never got.

    The extension reads ``app.config`` only, like every Flask extension; a variable
    exported for it and never loaded would otherwise be ignored without a word.
    """
    settings = sorted(
        {
            value
            for value in (getattr(ConfigVars, name) for name in dir(ConfigVars))
            if isinstance(value, str) and value.startswith("IDEMPOTENCY_")
        }
    )
    names = [
        f"{prefix}{key}"
        for key in settings
        for prefix in ("", _FLASK_ENV_PREFIX)
        if f"{prefix}{key}" in os.environ and key not in app.config
    ]
    if names:
        log.warning(
            "idempotency: the environment sets %s, but app %r has no such setting in"
            " app.config, so it is not used. Flask-Idempotency reads app.config only: name"
            " the variable FLASK_<SETTING> (e.g. FLASK_IDEMPOTENCY_REDIS_URL) and call"
            " app.config.from_prefixed_env() before init_app, or copy it into app.config.",
            ", ".join(names),
            app.name,
        )


def _check_registered_views(app: Flask, settings: Settings) -> None:
    """Fail at start-up, not at the first request, when a view's options clash with the app's.

    Views registered after ``init_app`` are checked when their first request arrives.
    """
    for endpoint, view in app.view_functions.items():
        route = getattr(view, lifecycle.ROUTE_OPTIONS_ATTR, None)
        if route is not None:
            try:
                EffectiveOptions.merge(settings, route)
            except ValueError as exc:
                raise ValueError(f"@idempotent on {endpoint!r}: {exc}") from None


def _lazy_engine(uri: str) -> Callable[[], Engine]:
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
