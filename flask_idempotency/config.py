"""Configuration names, defaults, and the settings resolved once per app.

Every key lives in ``app.config`` under the ``IDEMPOTENCY_`` prefix (CONTRACT §2).
Settings are read once in ``init_app`` into a frozen object, so a request never
re-parses configuration and a mistyped value fails at start-up, not at 3 a.m.
"""

from __future__ import annotations

import dataclasses
import math
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


class ConfigVars:
    """The ``app.config`` keys this extension reads."""

    DATABASE_URI = "IDEMPOTENCY_DATABASE_URI"
    REDIS_URL = "IDEMPOTENCY_REDIS_URL"
    HEADER = "IDEMPOTENCY_HEADER"
    REPLAY_HEADER = "IDEMPOTENCY_REPLAY_HEADER"
    METHODS = "IDEMPOTENCY_METHODS"
    REQUIRED = "IDEMPOTENCY_REQUIRED"
    TTL = "IDEMPOTENCY_TTL"
    LEASE = "IDEMPOTENCY_LEASE"
    WAIT = "IDEMPOTENCY_WAIT"
    KEY_MAX_LENGTH = "IDEMPOTENCY_KEY_MAX_LENGTH"
    STRICT_HEADER = "IDEMPOTENCY_STRICT_HEADER"
    STORE_SERVER_ERRORS = "IDEMPOTENCY_STORE_SERVER_ERRORS"
    MAX_BODY_BYTES = "IDEMPOTENCY_MAX_BODY_BYTES"
    REPLAY_HEADERS = "IDEMPOTENCY_REPLAY_HEADERS"
    FAIL_OPEN = "IDEMPOTENCY_FAIL_OPEN"
    REDIS_PREFIX = "IDEMPOTENCY_REDIS_PREFIX"
    TABLE = "IDEMPOTENCY_TABLE"
    PROBLEM_TYPE_BASE = "IDEMPOTENCY_PROBLEM_TYPE_BASE"
    ATOMIC = "IDEMPOTENCY_ATOMIC"
    MAX_WAITERS = "IDEMPOTENCY_MAX_WAITERS"
    CREATE_TABLE = "IDEMPOTENCY_CREATE_TABLE"
    REDIS_SOCKET_TIMEOUT = "IDEMPOTENCY_REDIS_SOCKET_TIMEOUT"
    FORM_FIELD = "IDEMPOTENCY_FORM_FIELD"


@dataclasses.dataclass(frozen=True)
class Settings:
    """Configuration of one app, resolved and validated in ``init_app``."""

    database_uri: str | None = None
    redis_url: str | None = None
    header: str = "Idempotency-Key"
    replay_header: str = "Idempotent-Replayed"
    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    required: bool = False
    ttl: float = 86400.0
    lease: float = 60.0
    wait: float = 5.0
    key_max_length: int = 255
    strict_header: bool = False
    store_server_errors: bool = False
    max_body_bytes: int = 1_048_576
    replay_headers: frozenset[str] = frozenset(
        {"content-type", "content-language", "location", "etag", "last-modified"}
    )
    fail_open: bool = False
    redis_prefix: str = "idem"
    table: str = "idempotency_keys"
    problem_type_base: str = DEFAULT_PROBLEM_TYPE_BASE
    atomic: bool = False
    #: Requests one process parks at once; beyond it duplicates get 409 at once (R86).
    max_waiters: int = 256
    #: Create the table on first use. ``None``: only for the embedded SQLite default.
    create_table: bool | None = None
    #: Seconds a Redis command may take before the tier counts as down (C24).
    redis_socket_timeout: float = 0.1
    #: Form field holding the key when a request has no key header (C49).
    form_field: str = "_idempotency_key"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Settings:
        """Read every ``IDEMPOTENCY_*`` key, falling back to the defaults above."""
        base = cls()
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            name = "IDEMPOTENCY_" + field.name.upper()
            if name in config:
                values[field.name] = config[name]
        settings = dataclasses.replace(base, **values)
        return settings._validated()

    def _validated(self) -> Settings:
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
            raise ValueError("IDEMPOTENCY_LEASE must be shorter than IDEMPOTENCY_TTL.")
        key_max_length = _integer(self.key_max_length, "IDEMPOTENCY_KEY_MAX_LENGTH")
        if not 1 <= key_max_length <= 4096:
            raise ValueError("IDEMPOTENCY_KEY_MAX_LENGTH must be between 1 and 4096.")
        max_body_bytes = _integer(self.max_body_bytes, "IDEMPOTENCY_MAX_BODY_BYTES")
        if max_body_bytes < 0:
            raise ValueError("IDEMPOTENCY_MAX_BODY_BYTES must not be negative.")
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
        return dataclasses.replace(
            self,
            methods=methods,
            replay_headers=replay_headers,
            required=_flag(self.required, "IDEMPOTENCY_REQUIRED"),
            strict_header=_flag(self.strict_header, "IDEMPOTENCY_STRICT_HEADER"),
            store_server_errors=_flag(self.store_server_errors, "IDEMPOTENCY_STORE_SERVER_ERRORS"),
            fail_open=_flag(self.fail_open, "IDEMPOTENCY_FAIL_OPEN"),
            atomic=_flag(self.atomic, "IDEMPOTENCY_ATOMIC"),
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
            max_waiters=max_waiters,
            redis_socket_timeout=_seconds(
                self.redis_socket_timeout, "IDEMPOTENCY_REDIS_SOCKET_TIMEOUT"
            ),
            problem_type_base=base if base.endswith(("/", "#", ":")) else base + "/",
        )


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
        )
        if options.lease >= options.ttl:
            raise ValueError("The lease of an idempotent route must be shorter than its ttl.")
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
