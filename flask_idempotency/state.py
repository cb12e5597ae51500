"""Per-app state: what the extension keeps for one app, and how it reads its tiers.

``app.extensions["idempotency"]`` holds one :class:`AppState`: the settings, the
durable store, the cache tier, the wake-up hub and the database clock as seen
from this process. Its :meth:`AppState.look_up` is the one lookup that requests
and ``once()`` both decide from (cache first, then the durable claim), and
:meth:`AppState.announce_completed` the one way a completion reaches the cache
and the waiters. Per-process resources (engines, pools, listeners, the renewer)
are not kept here but in :mod:`.process`, their one owner across forks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from flask import Flask, request
from sqlalchemy.engine import make_url

from .cache import NoCache, ResponseCache
from .config import EffectiveOptions, RouteOptions, Settings
from .fingerprint import default_scope
from .logs import ThrottledLog
from .notify import WakeupHub
from .records import COMPLETED, Claim, Completed, Identity, Record
from .store import DurableStore, StoreError
from .store.clock import DatabaseClock


class Extension(Protocol):
    """What the state reads of its :class:`~flask_idempotency.Idempotency` object, live:
    a scope loader may be registered after ``init_app``."""

    _db: Any
    _scope_loader: Callable[[], Any] | None


#: The key of :class:`AppState` in ``app.extensions``.
EXTENSION_NAME = "idempotency"
#: Routes whose merged options :meth:`AppState.effective_options` keeps.
_OPTIONS_KEPT = 1024
log = logging.getLogger("flask_idempotency")


@dataclasses.dataclass
class AppState:
    """Everything the extension keeps for one app, in ``app.extensions["idempotency"]``."""

    extension: Extension
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
    outage_log: ThrottledLog = dataclasses.field(default_factory=lambda: ThrottledLog())
    #: Whether this app has said that it runs on the default scope (once per app): a
    #: plain flag, read on every request without a call.
    _default_scope_told: bool = False
    _default_scope_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: What this app has warned of already (:meth:`warn_once`).
    _warned: set[Any] = dataclasses.field(default_factory=set)

    def __repr__(self) -> str:
        # What an error reporter shows among a failing request's locals: the settings
        # with their URLs' passwords masked, no secret (C61).
        return f"<AppState store={self.store!r} cache={self.cache!r} settings={self.settings!r}>"

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

    def warn_once(self, what: Any, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log a WARNING (or ``level``) the first time ``what`` happens in this app, never
        again: a misuse found at start-up or at the first request, an endpoint whose
        answers are too large to store (C56, C63). A set look-up when it has been said
        already."""
        if what in self._warned:
            return
        with self._default_scope_lock:
            if what in self._warned:
                return
            self._warned.add(what)
        log.log(level, message, *args)

    def stored_without_body(self, endpoint: str | None) -> None:
        """Say once per endpoint that its answers are too large to keep whole (C33, C56)."""
        self.warn_once(
            ("body-omitted", endpoint),
            "idempotency: an answer of %r was larger than IDEMPOTENCY_MAX_BODY_BYTES (%d"
            " bytes), so it was stored without its body: a retry gets its status and headers"
            " with an empty body and 'Idempotency-Replay: omitted' (C33). Raise the limit if"
            " clients need the body on a retry. (Said once per endpoint.)",
            endpoint,
            self.settings.max_body_bytes,
        )

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
        try:
            return default_scope(
                request if req is None else req, app, host=self.settings.scope_host
            )
        except StoreError as exc:  # the store's own secret was needed and is unreadable
            why = (
                "the scope_loader returned nothing for it"
                if loader is not None
                else "no scope_loader is registered"
            )
            raise type(exc)(
                f"this request is scoped by its Authorization header ({why}, and no"
                " Flask-Login user is logged in); that scope's HMAC is keyed by"
                " IDEMPOTENCY_SCOPE_SECRET, else SECRET_KEY, else the store's own secret,"
                f" which could not be read: {exc}"
            ) from exc

    def scope_secret(self, app: Flask) -> str | bytes:
        """What keys the default scope's HMAC of ``Authorization`` (C30, C63):
        ``IDEMPOTENCY_SCOPE_SECRET``, else the app's ``SECRET_KEY``, else the secret the
        store keeps in its own database beside its identity (read once per process,
        never logged), so that no secret has to be configured by hand.

        Raises the store's error when its secret is needed and cannot be read.
        """
        secret = self.settings.scope_secret
        if secret is None:
            secret = app.config.get("SECRET_KEY")
        if secret and isinstance(secret, (str, bytes)):
            return secret
        return self.store.identity().secret

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
            " as 'anonymous'. On a route without a subdomain or host rule the request's host"
            " is not part of it (IDEMPOTENCY_SCOPE_HOST adds it). Register"
            " @idempotency.scope_loader returning the tenant or user id."
        )


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
        return describe_url(settings.redis_url)
    return None


def describe_url(url: Any) -> str:
    """A database or Redis URL with its password hidden."""
    try:
        return str(make_url(url).render_as_string(hide_password=True))
    except Exception:  # not a URL SQLAlchemy can parse: show only its scheme
        return str(url).split(":", 1)[0] + "://…"
