"""``@idempotent`` marks a view; ``release_claim()`` lets a view give its key back (C19).

The decorator records options on the view function: nothing is resolved until a
request arrives, so it works before ``init_app``, on blueprints, with app
factories and with several apps. It returns a thin guard around the view whose
only job is to refuse to run the view in an app that never initialised the
extension (C56): there no layer exists, so without the guard a view marked
``required=True`` would run unprotected on every request, without a word. In an
app with the extension the layer puts its own wrapper in place of the guard on
the first request and calls the view itself, so a protected request never runs
the guard, and an unmarked view is never touched at all.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from flask import current_app, has_request_context, request

from .config import RouteOptions
from .lifecycle import current_ownership
from .marks import GUARDED_ATTR, ROUTE_OPTIONS_ATTR
from .state import EXTENSION_NAME

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
        # On the function too: stacked above the route decorator, the function is what
        # Flask registered, and the mark must still be found there.
        setattr(func, ROUTE_OPTIONS_ATTR, options)
        return _guarded(func)

    if view is not None:
        if not callable(view):
            raise TypeError("@idempotent takes a view function, or keyword options only.")
        return mark(view)
    return mark


def _guarded(view: F) -> F:
    """``view`` behind a check that the app it runs in has the extension (C56).

    Outside an app context (a view called as a plain function, in a unit test)
    there is nothing to protect and the view just runs. A class is returned as it
    is (marked): wrapping it would take ``as_view`` away.
    """
    if inspect.isclass(view):
        return view
    if inspect.iscoroutinefunction(view):

        @functools.wraps(view)
        async def guarded_coroutine(*args: Any, **kwargs: Any) -> Any:
            _require_extension(view)
            return await view(*args, **kwargs)

        guard: Any = guarded_coroutine
    else:

        @functools.wraps(view)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            _require_extension(view)
            return view(*args, **kwargs)

        guard = guarded
    setattr(guard, GUARDED_ATTR, (guard, view))  # see marks.unguarded
    return guard  # type: ignore[no-any-return]


def _require_extension(view: Callable[..., Any]) -> None:
    try:
        registered = EXTENSION_NAME in current_app.extensions
    except RuntimeError:  # no app context: called as a plain function
        return
    if not registered:
        _refuse(view)


def _refuse(view: Callable[..., Any]) -> None:
    endpoint = request.endpoint if has_request_context() else None
    what = f"endpoint {endpoint!r}" if endpoint else f"view {view.__qualname__!r}"
    raise RuntimeError(
        f"{what} is marked @idempotent, but Flask-Idempotency is not initialised on app"
        f" {current_app.name!r}, so the view was not run (it would have run unprotected)."
        " Did you forget to call init_app? Call idempotency.init_app(app), or"
        " Idempotency(app), where the app is created."
    )


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
