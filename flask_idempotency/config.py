"""Configuration names, defaults, and the settings resolved once per app.

Every key lives in ``app.config`` under the ``IDEMPOTENCY_`` prefix (CONTRACT §2).
Settings are read once in ``init_app`` into a frozen object, so a request never
re-parses configuration and a mistyped value fails at start-up, not at 3 a.m.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_PROBLEM_TYPE_BASE = "https://flask-idempotency.dev/problems/"

#: Headers never stored or replayed, whatever the allow-list says (R30, X19).
NEVER_REPLAYED = frozenset(
    {
        "set-cookie",
        "date",
        "retry-after",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "www-authenticate",
    }
)

#: Statuses a view may answer that say "try again later": the claim is released,
#: never stored (C16).
TRANSIENT_STATUSES = frozenset({408, 409, 423, 425, 429})
#: Statuses that answer who is asking, not what was done: released, never stored (C16).
CALLER_STATUSES = frozenset({401, 403})

#: Isolation levels a transactional route may ask for, as SQL spells them (C43).
ISOLATION_LEVELS = frozenset({"READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"})


@dataclasses.dataclass(frozen=True)
class Settings:
    """Configuration of one app, resolved and validated in ``init_app``."""

    #: The layer on or off. ``False`` (tests, local development): views marked
    #: ``@idempotent`` run plainly on every request, ``once()`` runs its work every time,
    #: and requests touch neither the store nor Redis (C56).
    enabled: bool = True
    #: The durable store, source of truth for claims and results. Default: the
    #: ``db=`` or ``engine=`` database, else a SQLite file in the app's instance folder.
    database_uri: str | None = None
    #: Redis cache tier and wake-up channel (``redis://…``). Default: none, no cache tier.
    redis_url: str | None = None
    #: The request header that carries the key.
    header: str = "Idempotency-Key"
    #: Set to ``true`` on every replayed response (C9).
    replay_header: str = "Idempotent-Replayed"
    #: Methods a key applies to; on other methods it is ignored (C1). ``GET``, ``HEAD``,
    #: ``OPTIONS``, ``TRACE`` and ``CONNECT`` are refused. A list or one comma-separated string.
    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    #: A protected request without a key is a 400 ``missing-key`` (C4).
    required: bool = False
    #: Seconds a key lives, counted from its first request (C21).
    ttl: float = 86400.0
    #: Seconds an in-progress claim is held before another request may take it over
    #: (C13); must be shorter than the TTL. Renewed every third of it while the view
    #: runs and while its completion waits for the database (C59), so a database outage
    #: is survived without a second run if it is shorter than two thirds of the lease:
    #: choose at least 1.5 x (the longest failover + 1 s); the default covers 39 s.
    lease: float = 60.0
    #: Seconds a duplicate waits for the in-flight original (C10); ``0`` answers 409 at once.
    wait: float = 5.0
    #: Longest key accepted, 1 to 4096 characters (C3).
    key_max_length: int = 255
    #: Accept only the structured-field form ``"key"``; by default a bare ``key`` is the
    #: same key (C2).
    strict_header: bool = False
    #: Store and replay 5xx responses instead of releasing the key (C17).
    store_server_errors: bool = False
    #: Largest response body stored whole; larger ones are stored without their body (C33).
    max_body_bytes: int = 1_048_576
    #: Largest request body a protected request may send, in bytes: the layer reads and
    #: fingerprints the body before the view (and any authentication decorator on it)
    #: runs, so past this it answers 413 ``request-too-large`` without reading it. ``0``
    #: leaves only Flask's ``MAX_CONTENT_LENGTH``.
    max_request_bytes: int = 10_485_760
    #: Response headers stored and replayed. The caching ones are among them, so a
    #: ``no-store`` answer is never replayed as cacheable (C62). ``Set-Cookie``, ``Date``,
    #: ``Retry-After``, ``Content-Length``, ``WWW-Authenticate`` and hop-by-hop headers
    #: are refused.
    replay_headers: frozenset[str] = frozenset(
        {
            "content-type",
            "content-language",
            "location",
            "etag",
            "last-modified",
            "cache-control",
            "vary",
            "expires",
            "content-disposition",
        }
    )
    #: With the database down: ``False`` answers 503; ``True`` runs the view unprotected,
    #: marked with ``Idempotency-Unprotected`` (C25).
    fail_open: bool = False
    #: Namespace of Redis keys and channels.
    redis_prefix: str = "idem"
    #: Name of the records table.
    table: str = "idempotency_keys"
    #: Prefix of the problem ``type`` URIs (C27).
    problem_type_base: str = DEFAULT_PROBLEM_TYPE_BASE
    #: Built-in metrics of every decision (C57): ``prometheus`` (the ``prometheus`` extra;
    #: the default registry), ``opentelemetry`` (the ``opentelemetry`` extra; the global
    #: meter provider), both (a list or one comma-separated string), or none.
    metrics: frozenset[str] = frozenset()
    #: An OpenTelemetry span per protected request (C57; the ``opentelemetry`` extra;
    #: the global tracer provider).
    tracing: bool = False
    #: Transactional mode for every protected route; needs ``db=`` (C40).
    atomic: bool = False
    #: Requests one process parks at once (C10); beyond it a duplicate gets 409 at once
    #: instead of waiting. Keep it below the worker's thread count (see the deployment page).
    max_waiters: int = 256
    #: Create the table on first use. ``None``: only for the embedded SQLite default.
    create_table: bool | None = None
    #: Seconds a Redis command may take before the tier counts as down (C24).
    redis_socket_timeout: float = 0.1
    #: Form field holding the key when a request has no key header (C49).
    form_field: str = "_idempotency_key"
    #: PostgreSQL: commit the claim with ``synchronous_commit = off`` (one fsync wait less
    #: per first execution). A crash or failover can then lose a claim whose owner still
    #: runs, and a retry runs the view at the same time. Off: the claim is durable.
    async_claim: bool = False
    #: Renew a running owner's lease in the background, about every lease/3 (C44).
    heartbeat: bool = True
    #: Seconds after its claim that an owner stops renewing, so a hung view lets go (C44).
    max_runtime: float = 900.0
    #: Where a process that ends (recycled, restarted, deployed) leaves the settlements
    #: the store has not accepted yet, for the next process of the app on this host to
    #: land (C59): a directory on a disk that outlives the process (a volume the next
    #: container mounts, in a container). ``None``: ``flask-idempotency-spool-<uid>`` in
    #: the system's temporary directory. ``False``: no spool; they are dropped at exit.
    spool_dir: str | bool | None = None
    #: Key of the default scope's digest of the ``Authorization`` header: an HMAC, so the
    #: stored scope gives nothing to a wordlist (C30). ``None``: the app's ``SECRET_KEY``;
    #: without either, a secret the store keeps in its own database (C63). Set it to keep
    #: scopes when ``SECRET_KEY`` rotates; changing it changes those scopes.
    scope_secret: str | bytes | None = dataclasses.field(default=None, repr=False)
    #: The request's host in the default scope on every route, not only on routes with a
    #: subdomain or host rule: for an app that picks its tenant from ``Host`` in a hook
    #: (user 5 of ``acme.example.com`` is not user 5 of ``globex.example.com``). A client
    #: that reaches the app under two host names then has two scopes.
    scope_host: bool = False

    def __repr__(self) -> str:
        """Every field but the scope secret, URLs with their passwords masked (C61): an
        error reporter captures the settings among a failing request's locals."""
        shown = []
        for field in dataclasses.fields(self):
            if not field.repr:
                continue
            value = getattr(self, field.name)
            if field.name in ("database_uri", "redis_url") and isinstance(value, str):
                value = masked_url(value)
            shown.append(f"{field.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    @functools.cached_property
    def header_environ_key(self) -> str:
        """Where a WSGI environ holds the key header: the name Werkzeug's ``EnvironHeaders``
        reads, found once instead of on every request."""
        name = self.header.upper().replace("-", "_")
        return name if name in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + name

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Settings:
        """Read every ``IDEMPOTENCY_*`` key, falling back to the defaults above."""
        base = cls()
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = config_key(field.name)
            if name in config:
                values[field.name] = config[name]
        settings = dataclasses.replace(base, **values)
        return settings._validated()

    def _validated(self) -> Settings:
        enabled = _flag(self.enabled, "IDEMPOTENCY_ENABLED")
        if self.redis_url:
            _redis_url(self.redis_url)
        if self.database_uri is not None:
            _database_uri(self.database_uri)
        methods = _upper_set(self.methods, "IDEMPOTENCY_METHODS")
        if self.replay_headers is None:
            raise ValueError("IDEMPOTENCY_REPLAY_HEADERS must be a list of header names.")
        replay_headers = frozenset(
            _header_name(h, "IDEMPOTENCY_REPLAY_HEADERS").lower()
            for h in _as_iterable(self.replay_headers)
        )
        blocked = sorted(replay_headers & NEVER_REPLAYED)
        if blocked:
            raise ValueError(
                f"IDEMPOTENCY_REPLAY_HEADERS may not contain {', '.join(blocked)}:"
                " these headers are per-response or hop-by-hop and are never replayed."
            )
        ttl = _seconds(self.ttl, "IDEMPOTENCY_TTL")
        lease = _seconds(self.lease, "IDEMPOTENCY_LEASE")
        wait = _seconds(self.wait, "IDEMPOTENCY_WAIT", allow_zero=True)
        if lease >= ttl:
            raise ValueError(_lease_not_shorter(lease, ttl, "IDEMPOTENCY_LEASE", "IDEMPOTENCY_TTL"))
        key_max_length = _integer(self.key_max_length, "IDEMPOTENCY_KEY_MAX_LENGTH")
        if not 1 <= key_max_length <= 4096:
            raise ValueError("IDEMPOTENCY_KEY_MAX_LENGTH must be between 1 and 4096.")
        max_body_bytes = _integer(self.max_body_bytes, "IDEMPOTENCY_MAX_BODY_BYTES")
        if max_body_bytes < 0:
            raise ValueError("IDEMPOTENCY_MAX_BODY_BYTES must not be negative.")
        max_request_bytes = _integer(self.max_request_bytes, "IDEMPOTENCY_MAX_REQUEST_BYTES")
        if max_request_bytes < 0:
            raise ValueError("IDEMPOTENCY_MAX_REQUEST_BYTES must not be negative.")
        max_waiters = _integer(self.max_waiters, "IDEMPOTENCY_MAX_WAITERS")
        if max_waiters < 0:
            raise ValueError("IDEMPOTENCY_MAX_WAITERS must not be negative.")
        if not self.header or not self.replay_header:
            raise ValueError("IDEMPOTENCY_HEADER and IDEMPOTENCY_REPLAY_HEADER must be set.")
        _header_name(self.header, "IDEMPOTENCY_HEADER")
        _header_name(self.replay_header, "IDEMPOTENCY_REPLAY_HEADER")
        if not isinstance(self.form_field, str) or not self.form_field:
            raise ValueError("IDEMPOTENCY_FORM_FIELD must be a non-empty form field name.")
        base = self.problem_type_base
        if not isinstance(base, str) or not base:
            raise ValueError("IDEMPOTENCY_PROBLEM_TYPE_BASE must be a URI.")
        secret = self.scope_secret
        if secret is not None and (not isinstance(secret, (str, bytes)) or not secret):
            what = "empty" if isinstance(secret, (str, bytes)) else f"a {type(secret).__name__}"
            raise ValueError(  # the value may be a secret: never in the message
                f"IDEMPOTENCY_SCOPE_SECRET must be a non-empty string or bytes; it is {what}."
            )
        spool_dir = self.spool_dir
        if spool_dir is not None and spool_dir is not False:
            if not isinstance(spool_dir, (str, os.PathLike)) or not str(spool_dir):
                raise ValueError(
                    "IDEMPOTENCY_SPOOL_DIR must be a directory's path, None (the default"
                    " place) or False (no spool)."
                )
            spool_dir = os.fspath(spool_dir)
        return dataclasses.replace(
            self,
            enabled=enabled,
            spool_dir=spool_dir,
            metrics=_metrics(self.metrics),
            tracing=_flag(self.tracing, "IDEMPOTENCY_TRACING"),
            methods=methods,
            replay_headers=replay_headers,
            required=_flag(self.required, "IDEMPOTENCY_REQUIRED"),
            strict_header=_flag(self.strict_header, "IDEMPOTENCY_STRICT_HEADER"),
            store_server_errors=_flag(self.store_server_errors, "IDEMPOTENCY_STORE_SERVER_ERRORS"),
            fail_open=_flag(self.fail_open, "IDEMPOTENCY_FAIL_OPEN"),
            atomic=_flag(self.atomic, "IDEMPOTENCY_ATOMIC"),
            async_claim=_flag(self.async_claim, "IDEMPOTENCY_ASYNC_CLAIM"),
            create_table=(
                None
                if self.create_table is None
                else _flag(self.create_table, "IDEMPOTENCY_CREATE_TABLE")
            ),
            ttl=ttl,
            lease=lease,
            wait=wait,
            key_max_length=key_max_length,
            max_body_bytes=max_body_bytes,
            max_request_bytes=max_request_bytes,
            max_waiters=max_waiters,
            redis_socket_timeout=_seconds(
                self.redis_socket_timeout, "IDEMPOTENCY_REDIS_SOCKET_TIMEOUT"
            ),
            heartbeat=_flag(self.heartbeat, "IDEMPOTENCY_HEARTBEAT"),
            scope_host=_flag(self.scope_host, "IDEMPOTENCY_SCOPE_HOST"),
            max_runtime=_seconds(self.max_runtime, "IDEMPOTENCY_MAX_RUNTIME"),
            problem_type_base=base if base.endswith(("/", "#", ":")) else base + "/",
        )


_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd|sentinel_password)=)[^&#]*", re.I)


def masked_url(url: str) -> str:
    """``url`` with its password shown as ``***``: ``postgresql://app:***@db/app``, and a
    ``?password=`` in the query too (C61). For reprs and logs, never for connecting."""
    scheme, sep, rest = url.partition("://")
    if sep:
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        userinfo, at, hosts = rest[:end].rpartition("@")  # a password may hold a bare "@"
        if at and ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            url = f"{scheme}://{user}:***@{hosts}{rest[end:]}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


def config_key(field_name: str) -> str:
    """The ``app.config`` key of one :class:`Settings` field: ``ttl`` → ``IDEMPOTENCY_TTL``."""
    return PREFIX + field_name.upper()


#: Where a setting's name starts: ``IDEMPOTENCY_`` (C63 also reads ``IDEMPOTENT_…`` and
#: ``IDEMPOTENCE_…`` as attempts at it).
PREFIX = "IDEMPOTENCY_"
_NEAR_PREFIX = "IDEMPOT"


def misspelt_names(names: Iterable[str]) -> list[tuple[str, str | None]]:
    """The names among ``names`` that look like a setting but are none, each with the
    closest setting (``None`` when nothing is close): ``IDEMPOTENCY_TLL`` →
    ``IDEMPOTENCY_TTL`` (C63).

    The list of settings is the fields of :class:`Settings`, so it cannot drift. Names
    are compared after the prefix, where a typo is (the shared prefix would make every
    name look close to every other); a misspelt prefix is compared whole.
    """
    known = [config_key(field.name) for field in dataclasses.fields(Settings)]
    suffixes = {name.removeprefix(PREFIX): name for name in known}
    found: list[tuple[str, str | None]] = []
    for name in names:
        if not isinstance(name, str) or name in known:
            continue
        upper = name.upper()
        if not upper.startswith(_NEAR_PREFIX):
            continue
        if upper in known:  # only the case differs: app.config keys are case-sensitive
            found.append((name, upper))
        elif upper.startswith(PREFIX):
            close = difflib.get_close_matches(upper.removeprefix(PREFIX), suffixes, n=1)
            found.append((name, suffixes[close[0]] if close else None))
        else:
            close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
            found.append((name, close[0] if close else None))
    return found


class _ConfigNames(type):
    """Lets type checkers see every ``ConfigVars.NAME`` as a string; the names are set below."""

    def __getattr__(cls, name: str) -> str:
        raise AttributeError(f"ConfigVars has no {name!r}: no Settings field {name.lower()!r}.")


class ConfigVars(metaclass=_ConfigNames):
    """The ``app.config`` keys this extension reads, e.g. ``ConfigVars.TTL == "IDEMPOTENCY_TTL"``.

    Derived from the fields of :class:`Settings`, so the two lists cannot drift apart.
    """


for _field in dataclasses.fields(Settings):
    setattr(ConfigVars, _field.name.upper(), config_key(_field.name))
del _field


@dataclasses.dataclass(frozen=True)
class RouteOptions:
    """Per-view options given to ``@idempotent``; ``None`` means "use the app setting"."""

    required: bool | None = None
    ttl: float | None = None
    lease: float | None = None
    wait: float | None = None
    methods: frozenset[str] | None = None
    atomic: bool | None = None
    store_server_errors: bool | None = None
    #: Transactional mode only: the view's transaction runs at this level (C43).
    isolation: str | None = None
    #: Transactional mode only: re-runs of the view after 40001/40P01 (C43).
    retries: int | None = None

    def __post_init__(self) -> None:
        if self.methods is not None:
            object.__setattr__(self, "methods", _upper_set(self.methods, "methods"))
        for name in ("ttl", "lease", "wait"):
            value = getattr(self, name)
            if value is not None:
                seconds = _seconds(value, f"@idempotent({name}=...)", allow_zero=name == "wait")
                object.__setattr__(self, name, seconds)
        for name in ("required", "atomic", "store_server_errors"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _flag(value, f"@idempotent({name}=...)"))
        if self.ttl is not None and self.lease is not None and self.lease >= self.ttl:
            raise ValueError("@idempotent(lease=...) must be shorter than its ttl.")
        if self.isolation is not None:
            object.__setattr__(
                self, "isolation", _isolation(self.isolation, "@idempotent(isolation=...)")
            )
        if self.retries is not None:
            retries = _integer(self.retries, "@idempotent(retries=...)")
            if not 0 <= retries <= 100:
                raise ValueError("@idempotent(retries=...) must be between 0 and 100.")
            object.__setattr__(self, "retries", retries)
        if (self.isolation is not None or self.retries is not None) and self.atomic is False:
            raise ValueError("@idempotent(isolation=..., retries=...) need atomic=True.")


@dataclasses.dataclass(frozen=True)
class EffectiveOptions:
    """What one protected request runs with: route options over app settings."""

    required: bool
    ttl: float
    lease: float
    wait: float
    methods: frozenset[str]
    atomic: bool
    store_server_errors: bool
    isolation: str | None = None
    retries: int = 0

    @classmethod
    def merge(cls, settings: Settings, route: RouteOptions) -> EffectiveOptions:
        def pick(name: str) -> Any:
            value = getattr(route, name)
            return getattr(settings, name) if value is None else value

        options = cls(
            required=bool(pick("required")),
            ttl=float(pick("ttl")),
            lease=float(pick("lease")),
            wait=float(pick("wait")),
            methods=pick("methods"),
            atomic=bool(pick("atomic")),
            store_server_errors=bool(pick("store_server_errors")),
            isolation=route.isolation,
            retries=route.retries or 0,
        )
        if options.lease >= options.ttl:
            raise ValueError(
                _lease_not_shorter(
                    options.lease,
                    options.ttl,
                    "IDEMPOTENCY_LEASE" if route.lease is None else "@idempotent(lease=...)",
                    "IDEMPOTENCY_TTL" if route.ttl is None else "@idempotent(ttl=...)",
                )
            )
        if (route.isolation is not None or route.retries is not None) and not options.atomic:
            raise ValueError(
                "isolation= and retries= apply to transactional mode: add atomic=True"
                " (or set IDEMPOTENCY_ATOMIC)."
            )
        return options


def _as_iterable(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return list(value)


#: Methods a key never applies to: they are safe, and replaying them is a bug class (R2).
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})
_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _upper_set(value: Any, name: str) -> frozenset[str]:
    if value is None:
        raise ValueError(f"{name} must name at least one HTTP method.")
    methods: set[str] = set()
    for method in _as_iterable(value):
        if not isinstance(method, str) or not method or not set(method) <= _TCHARS:
            raise ValueError(f"{name}: {method!r} is not an HTTP method name.")
        methods.add(method.upper())
    if not methods:
        raise ValueError(f"{name} must name at least one HTTP method.")
    safe = sorted(methods & SAFE_METHODS)
    if safe:
        raise ValueError(
            f"{name} may not contain {', '.join(safe)}: safe methods are never deduplicated"
            " or replayed; a key sent with them is ignored."
        )
    return frozenset(methods)


#: URL schemes ``IDEMPOTENCY_REDIS_URL`` may have (docs/redis.md).
REDIS_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
)


def _redis_url(url: Any) -> None:
    """Refuse a Redis URL without a scheme Redis understands, naming the setting.

    ``localhost:6379`` would otherwise fail deep in redis-py ("Redis URL must
    specify one of the following schemes") without saying which setting is wrong.
    The value is not repeated when it may hold a password.
    """
    if not isinstance(url, str):
        raise ValueError(f"IDEMPOTENCY_REDIS_URL must be a URL string, not a {type(url).__name__}.")
    scheme = url.split("://", 1)[0].lower() if "://" in url else None
    if scheme in REDIS_SCHEMES:
        return
    shown = repr(url) if "@" not in url else "the value given (not shown: it may hold a password)"
    schemes = ", ".join(name + "://" for name in REDIS_SCHEMES)
    raise ValueError(
        f"IDEMPOTENCY_REDIS_URL must start with one of {schemes} (e.g."
        f" redis://localhost:6379/0); {shown} "
        + (f"has the scheme {scheme!r}." if scheme else "has none.")
    )


def _database_uri(uri: Any) -> None:
    """Refuse what SQLAlchemy cannot read as a URL now, not at the first request's 503.

    The value is never repeated: it may hold a password.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(uri)
    except (ArgumentError, ValueError, TypeError) as exc:
        hosts = str(uri).partition("://")[2].partition("/")[0].rpartition("@")[2]
        several = (
            " Several hosts (libpq's h1:5432,h2:5432) go in the query instead:"
            " postgresql+psycopg2://app@/app?host=h1:5432&host=h2:5432"
            "&target_session_attrs=read-write."
            if "," in hosts
            else ""
        )
        raise ValueError(
            f"IDEMPOTENCY_DATABASE_URI is not a database URL ({exc}). Write"
            " dialect+driver://user:password@host:port/database, e.g."
            " postgresql+psycopg2://app@db.internal:5432/app, or leave it unset for the"
            f" db= / engine= database or the SQLite file in the instance folder.{several}"
        ) from None


def _lease_not_shorter(lease: float, ttl: float, lease_from: str, ttl_from: str) -> str:
    """ "The lease must be shorter than the ttl", naming where each value came from."""

    def origin(name: str, value: float) -> str:
        if name.startswith("IDEMPOTENCY_"):
            default = getattr(Settings, name.removeprefix("IDEMPOTENCY_").lower())
            if value == default:
                return f"{name} = {value:g} s (its default)"
        return f"{name} = {value:g} s"

    return (
        f"The lease must be shorter than the ttl, but {origin(lease_from, lease)} and"
        f" {origin(ttl_from, ttl)}. Set {lease_from} below {ttl:g} (or {ttl_from} above"
        f" {lease:g}). The lease is how long a claim is held before a retry may take it"
        " over; the ttl how long a key lives."
    )


#: What ``IDEMPOTENCY_METRICS`` may name, and the spellings it understands (C57).
METRICS_BACKENDS = {
    "prometheus": "prometheus",
    "opentelemetry": "opentelemetry",
    "otel": "opentelemetry",
}


def _metrics(value: Any) -> frozenset[str]:
    """``"prometheus"``, ``"opentelemetry"``, both, or none (``None``, ``False``, empty)."""
    if value is None or value is False:
        return frozenset()
    if isinstance(value, bool) or not isinstance(value, (str, list, tuple, set, frozenset)):
        raise ValueError(
            "IDEMPOTENCY_METRICS names the library: 'prometheus', 'opentelemetry' or both"
            f" (a list or a comma-separated string), not {value!r}."
        )
    if isinstance(value, str) and value.strip().lower() in _FALSE:
        return frozenset()
    names = set()
    for name in _as_iterable(value):
        backend = METRICS_BACKENDS.get(str(name).strip().lower())
        if backend is None:
            raise ValueError(
                f"IDEMPOTENCY_METRICS: {name!r} is not one of prometheus, opentelemetry."
            )
        names.add(backend)
    return frozenset(names)


def _isolation(value: Any, name: str) -> str:
    """``"serializable"`` or ``"REPEATABLE_READ"`` → the SQL spelling; anything else fails."""
    level = value.strip().upper().replace("_", " ") if isinstance(value, str) else None
    if level not in ISOLATION_LEVELS:
        levels = ", ".join(sorted(ISOLATION_LEVELS))
        raise ValueError(f"{name} must be one of {levels}, not {value!r}.")
    return level


def _header_name(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or not set(value) <= _TCHARS:
        raise ValueError(f"{name}: {value!r} is not a valid HTTP header name.")
    return value


def _seconds(value: Any, name: str, *, allow_zero: bool = False) -> float:
    """A finite number of seconds; a clear error instead of a 500 at the first request."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}.")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}.") from None
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        kind = "zero or a positive" if allow_zero else "a positive"
        raise ValueError(f"{name} must be {kind} number of seconds, not {value!r}.")
    return seconds


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}.")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be an integer, not {value!r}.") from None
    if isinstance(value, float) and number != value:
        raise ValueError(f"{name} must be an integer, not {value!r}.")
    return number


def _flag(value: Any, name: str) -> bool:
    """A boolean; strings from environment variables ("true", "0", …) are understood."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be True or False, not {value!r}.")
