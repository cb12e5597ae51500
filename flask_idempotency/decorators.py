"""``@idempotent`` marks a view; ``release_claim()`` lets a view give its key back (C19).

The decorator records options on the view function and returns the same
function: nothing is resolved until a request arrives, so it works before
``init_app``, on blueprints, with app factories and with several apps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from .config import RouteOptions
from .lifecycle import ROUTE_OPTIONS_ATTR, current_ownership

F = TypeVar("F", bound=Callable[..., Any])


@overload
def idempotent(view: F) -> F: ...


@overload
def idempotent(
    view: None = None,
    *,
    required: bool | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
    methods: Iterable[str] | None = None,
    atomic: bool | None = None,
    store_server_errors: bool | None = None,
    isolation: str | None = None,
    retries: int | None = None,
) -> Callable[[F], F]: ...


def idempotent(
    view: Any = None,
    *,
    required: bool | None = None,
    ttl: float | None = None,
    lease: float | None = None,
    wait: float | None = None,
    methods: Iterable[str] | None = None,
    atomic: bool | None = None,
    store_server_errors: bool | None = None,
    isolation: str | None = None,
    retries: int | None = None,
) -> Any:
    """Protect a view with Idempotency-Key handling.

    Bare (``@idempotent``) it uses the app's ``IDEMPOTENCY_*`` settings; each
    keyword overrides one of them for this view only. In transactional mode
    (``atomic=True``), ``isolation`` (``"READ COMMITTED"``, ``"REPEATABLE READ"``,
    ``"SERIALIZABLE"``) is the level of the view's transaction, and ``retries``
    how often a serialization failure or deadlock runs the view again, in a fresh
    transaction under the same claim (C43).
    """
    options = RouteOptions(
        required=required,
        ttl=ttl,
        lease=lease,
        wait=wait,
        methods=frozenset(methods) if methods is not None else None,
        atomic=atomic,
        store_server_errors=store_server_errors,
        isolation=isolation,
        retries=retries,
    )

    def mark(func: F) -> F:
        setattr(func, ROUTE_OPTIONS_ATTR, options)
        return func

    if view is not None:
        if not callable(view):
            raise TypeError("@idempotent takes a view function, or keyword options only.")
        return mark(view)
    return mark


def release_claim() -> bool:
    """Send this response without storing it, and free the key for a retry (C19).

    Call it from a protected view that rejects the request before any side
    effect (a validation failure, say): the client can fix the request and retry
    with the same key. Returns ``False`` when the request owns no claim.
    """
    own = current_ownership()
    if own is None:
        return False
    own.release_requested = True
    return True


def current_key_digest() -> str | None:
    """The digest of (scope, key) this request owns, or ``None`` when it owns none.

    Stable across every retry of the same request and different for any other
    request or scope, so it makes a good downstream idempotency key, e.g. for a
    payment gateway: ``f"shop-{current_key_digest()[:32]}"``. The raw key never
    leaves the request (C30).
    """
    own = current_ownership()
    return None if own is None else own.ident.key_digest
