"""The ``Idempotency`` extension object: configuration, wiring, per-app state."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from flask import Flask, current_app, got_request_exception
from sqlalchemy import Engine

from . import forms, lifecycle, misuse
from .cache import NoCache, ResponseCache
from .completion.unit import guard_sessions
from .config import ConfigVars, Settings, misspelt_names
from .jobs import Once
from .notify import WakeupHub
from .problems import IdempotencyProblem
from .state import EXTENSION_NAME, AppState, describe_url, redis_target
from .store import DurableStore
from .store.connect import lazy_engine
from .store.drivers import check_driver

log = logging.getLogger("flask_idempotency")


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
        _warn_misspelt(app)
        settings = Settings.from_config(app.config)
        if settings.atomic and self._db is None:
            raise ValueError("IDEMPOTENCY_ATOMIC needs Idempotency(db=db) (C40).")
        store = self._build_store(app, settings)
        wakeups = WakeupHub(max_waiters=settings.max_waiters)
        cache = self._build_cache(settings, store, wakeups)
        state = AppState(self, settings, store, cache, wakeups)
        app.extensions[EXTENSION_NAME] = state
        if settings.enabled:  # the views registered by now; the rest at the first request
            misuse.report(app, state, app.view_functions)
        app.add_template_global(forms.idempotency_key_field, "idempotency_key_field")  # C49
        _answer_problems(app)
        if settings.enabled:  # else marked views run plainly: no hook, no store, no Redis (C56)
            lifecycle.install(app)
            got_request_exception.connect(lifecycle.mark_failed, app, weak=False)
            if self._db is not None:
                guard_sessions(self._db)
            if settings.metrics or settings.tracing:
                from . import telemetry

                telemetry.install(app, settings)
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
            store = f"{describe_url(self._engine.url)} (the engine given as engine=)"
        elif self._db is not None:
            uri = app.config.get("SQLALCHEMY_DATABASE_URI")
            where = describe_url(uri) if uri else "its default engine"
            store = f"{where} (Flask-SQLAlchemy's database, given as db=)"
        elif settings.database_uri:
            store = describe_url(settings.database_uri)
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
        described = f"store: {store}, table {settings.table!r}; {tiers}"
        if not settings.enabled:
            described += (
                "; DISABLED (IDEMPOTENCY_ENABLED = False): marked views run unprotected, and"
                " neither the store nor Redis is used by requests"
            )
        return described

    # -- building the tiers ---------------------------------------------------------

    def _build_store(self, app: Flask, settings: Settings) -> DurableStore:
        metadata = self._db.metadata if self._db is not None else None
        create_table = settings.create_table
        if self._engine is not None:
            engine = self._engine
            factory: Callable[[], Engine] = lambda: engine  # noqa: E731
        elif self._db is not None:
            db = self._db
            # Named here, not as a ModuleNotFoundError from deep in Flask-SQLAlchemy, when
            # init_app runs before db.init_app (which builds the engine at once) (C51).
            check_driver(app.config.get("SQLALCHEMY_DATABASE_URI"), "SQLALCHEMY_DATABASE_URI")

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
            check_driver(uri)  # a missing driver fails here, not at the first request (C51)
            factory = lazy_engine(uri)
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
        from .tier import RedisTier, store_origin

        def origin() -> str:
            # Resolved on first use of the tier, once per process: the id the store's
            # database keeps, never the URL's text (C41). Until it can be read the tier
            # stays off (store/identity.py), and requests use the database alone.
            return store_origin(store.identity().id, store.table.fullname)

        def secret() -> bytes:
            # Read in the same identity read as the origin: only the store's database
            # holds it, so only its apps can seal a value the cache replays (C60).
            return store.identity().secret

        try:
            tier = RedisTier.from_settings(
                settings, client=self._redis, origin=origin, secret=secret
            )
        except ValueError as exc:  # redis-py's words alone would not say which setting
            if self._redis is not None:
                raise
            where = describe_url(settings.redis_url)
            raise ValueError(f"IDEMPOTENCY_REDIS_URL = {where!r}: {exc}") from exc
        wakeups.channel = tier.notifier
        return tier.cache


#: Flask's convention for configuration from the environment: ``FLASK_<KEY>`` read by
#: ``app.config.from_prefixed_env()``.
_FLASK_ENV_PREFIX = "FLASK_"


def _answer_problems(app: Flask) -> None:
    """Answer the layer's problems as their own problem+json documents (C27), even in an
    app whose handler for ``HTTPException`` reshapes every error.

    flask-smorest and APIFlask register such a handler, which turned a ``missing-key``
    into their own JSON error and made the answers the API's OpenAPI description
    promises (C64) untrue. Flask prefers a handler for ``IdempotencyProblem`` to one
    for ``HTTPException`` or ``Exception`` (it walks the exception's classes), and a
    handler for a status code, a blueprint's, or the app's own for
    ``IdempotencyProblem`` (registered before or after this) to this default.
    """
    handlers = app.error_handler_spec.get(None, {}).get(None, {})
    if IdempotencyProblem not in handlers:
        app.register_error_handler(IdempotencyProblem, _problem_document)


def _problem_document(problem: IdempotencyProblem) -> Any:
    return problem.get_response()


def _warn_misspelt(app: Flask) -> None:
    """Name each ``IDEMPOTENCY_*`` key of ``app.config``, and each ``FLASK_IDEMPOTENCY_*``
    variable of the environment, that is no setting, with the closest one (C63).

    Unknown keys are ignored as in every Flask extension, which turns a typo
    (``IDEMPOTENCY_TLL = 5``) into a default nobody chose. A variable that
    ``from_prefixed_env()`` has already copied into ``app.config`` is named once, as
    the key. Only the ``FLASK_`` form of the environment is read: unprefixed
    ``IDEMPOTENCY_*`` variables may be anyone's (a test suite's, say).
    """
    for name, closest in misspelt_names(app.config):
        log.warning(
            "idempotency: app.config sets %r, which is no Flask-Idempotency setting, so it is"
            " ignored; %s",
            name,
            f"did you mean {closest}?" if closest else "the settings: docs/configuration.md.",
        )
    unprefixed = {
        name.removeprefix(_FLASK_ENV_PREFIX): name
        for name in os.environ
        if name.startswith(_FLASK_ENV_PREFIX)
        and name.removeprefix(_FLASK_ENV_PREFIX) not in app.config
    }
    for name, closest in misspelt_names(unprefixed):
        log.warning(
            "idempotency: the environment sets %s, which names no Flask-Idempotency setting"
            " (FLASK_ + a setting's name), so it is ignored; %s",
            unprefixed[name],
            f"did you mean {_FLASK_ENV_PREFIX}{closest}?"
            if closest
            else "the settings: docs/configuration.md.",
        )


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
