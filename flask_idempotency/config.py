"""Configuration names, defaults, and the settings resolved once per app.

Every key lives in ``app.config`` under the ``IDEMPOTENCY_`` prefix (CONTRACT §2).
Settings are read once in ``init_app`` into a frozen object, so a request never
re-parses configuration and a mistyped value fails at start-up, not at 3 a.m.
"""

from __future__ import annotations

import dataclasses
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
        replay_headers = frozenset(h.lower() for h in _as_iterable(self.replay_headers))
        blocked = sorted(replay_headers & NEVER_REPLAYED)
        if blocked:
            raise ValueError(
                f"IDEMPOTENCY_REPLAY_HEADERS may not contain {', '.join(blocked)}:"
                " these headers are per-response or hop-by-hop and are never replayed."
            )
        for name in ("ttl", "lease"):
            if float(getattr(self, name)) <= 0:
                raise ValueError(f"IDEMPOTENCY_{name.upper()} must be a positive number of seconds.")
        if float(self.wait) < 0:
            raise ValueError("IDEMPOTENCY_WAIT must be zero or a positive number of seconds.")
        if float(self.lease) >= float(self.ttl):
            raise ValueError("IDEMPOTENCY_LEASE must be shorter than IDEMPOTENCY_TTL.")
        if not 1 <= int(self.key_max_length) <= 4096:
            raise ValueError("IDEMPOTENCY_KEY_MAX_LENGTH must be between 1 and 4096.")
        if int(self.max_body_bytes) < 0:
            raise ValueError("IDEMPOTENCY_MAX_BODY_BYTES must not be negative.")
        if not self.header or not self.replay_header:
            raise ValueError("IDEMPOTENCY_HEADER and IDEMPOTENCY_REPLAY_HEADER must be set.")
        base = self.problem_type_base
        return dataclasses.replace(
            self,
            methods=methods,
            replay_headers=replay_headers,
            ttl=float(self.ttl),
            lease=float(self.lease),
            wait=float(self.wait),
            key_max_length=int(self.key_max_length),
            max_body_bytes=int(self.max_body_bytes),
            max_waiters=int(self.max_waiters),
            redis_socket_timeout=float(self.redis_socket_timeout),
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
        for name in ("ttl", "lease"):
            value = getattr(self, name)
            if value is not None and float(value) <= 0:
                raise ValueError(f"@idempotent({name}=...) must be a positive number of seconds.")
        if self.wait is not None and float(self.wait) < 0:
            raise ValueError("@idempotent(wait=...) must be zero or positive.")


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


def _upper_set(value: Any, name: str) -> frozenset[str]:
    methods = frozenset(m.upper() for m in _as_iterable(value))
    if not methods:
        raise ValueError(f"{name} must name at least one HTTP method.")
    return methods
