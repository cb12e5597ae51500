"""The request lifecycle: decide, run the view, settle (CONTRACT §3).

A view marked ``@idempotent`` runs inside a wrapper that takes its place in
``app.view_functions`` (:func:`protect_views`); the wrapper is the whole layer:

decide   parse key → scope + fingerprint → cache → durable claim
         → replay | 422 | park and re-check | own the record
run      the view, as the owner (transactional mode: in a unit of work, C40)
settle   the response Flask made of it, error handlers included and before the
         app's ``after_request`` hooks: store it (fenced) → promote → wake
         waiters, or release the claim; whatever ends the request unsettled
         (an exception, an exit) releases it (C15)

The one hook the extension registers runs before every other hook of the app: on the
first request it wraps the marked views, and on a request to a marked view it puts
the body cap in place before any hook can read the body (C31, :mod:`.request_body`);
for any other view it is one dictionary look-up. Every ``before_request`` hook of the
app has run before the layer decides, so a hook that rejects a request (CSRF,
permissions) never claims a key, and the scope loader sees what those hooks loaded.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Flask, Response, after_this_request, current_app, has_request_context, request
from werkzeug.exceptions import RequestEntityTooLarge

from . import forms, misuse, request_body, signals
from .completion import inherit, unanswered
from .completion import settle as completion
from .completion.ownership import Ownership
from .config import EffectiveOptions, RouteOptions
from .decision import InProgress, KeyReused, Outcome, Own, Replay, Unavailable, decide
from .fingerprint import key_digest, request_fingerprint
from .keys import InvalidKey, parse_key
from .marks import ROUTE_OPTIONS_ATTR, marked, route_options, unguarded
from .notify import wait_for_owner
from .problems import (
    InvalidKeyProblem,
    MissingKey,
    RequestInProgress,
    RequestTooLarge,
    RouteMisconfigured,
    StoreUnavailable,
)
from .problems import KeyReused as KeyReusedProblem
from .records import Claim, Completed, Identity, Record
from .request_body import too_large
from .responses import replay
from .store import ClaimUnanswered, StoreError, StoreMisconfigured

if TYPE_CHECKING:
    from .state import AppState

log = logging.getLogger("flask_idempotency")

#: Header on a response the view produced without protection (``IDEMPOTENCY_FAIL_OPEN``).
UNPROTECTED_HEADER = "Idempotency-Unprotected"
_STORE_RETRY_AFTER = 3.0
#: Where a request's ownership lives: its WSGI environ, not ``g``. ``g`` belongs to the
#: app context, which a request shares with the next one pushed inside it (a test under
#: ``app.app_context()``, a sub-request made from a view), so state kept there leaks.
_OWNERSHIP_KEY = "flask_idempotency.ownership"
#: Set on the wrapper that stands for a marked view in ``app.view_functions``.
_PROTECTED_ATTR = "__idempotency_protected__"
#: The wrapper's function that puts a request's body under the cap before any hook.
_BODY_GUARD_ATTR = "__idempotency_body_guard__"


def current_ownership() -> Ownership | None:
    """The claim the current request owns, if any (``None`` outside a request)."""
    if not has_request_context():
        return None
    own: Ownership | None = request.environ.get(_OWNERSHIP_KEY)
    return own


# -- putting the layer in place -------------------------------------------------------


def install(app: Flask) -> None:
    """Put the layer in front of ``app``'s marked views, and their bodies under the cap.

    The views are wrapped at the first request: only then is the app's set of views
    final (Flask refuses new routes after the first request) and every ``@idempotent``
    applied, in whichever order it was stacked with the route decorator.

    The hook is a URL value preprocessor, which Flask runs before every
    ``before_request`` hook, the app's and its blueprints', whenever they were
    registered: a hook that reads the form (Flask-WTF's ``CSRFProtect``, a locale
    switch reading ``request.values``) then reads it through the cap (C31).
    """
    body_guards: dict[str | None, Callable[[Any], None]] = {}
    wrapped: list[bool] = []

    def guard_bodies(endpoint: str | None, values: Any) -> None:
        if not wrapped:
            protect_views(app, body_guards)
            wrapped.append(True)
        guard = body_guards.get(endpoint)
        if guard is not None:
            guard(_current_request())

    app.url_value_preprocessors.setdefault(None, []).insert(0, guard_bodies)


def protect_views(
    app: Flask, body_guards: dict[str | None, Callable[[Any], None]] | None = None
) -> None:
    """Replace each marked view of ``app`` by its protected wrapper (once; idempotent).

    The mark sits on the registered view function, or, for a class-based view, on
    one of its handler methods (``MethodView.post``). Racing callers both wrap the
    registered original, so a view never ends up wrapped twice. ``body_guards`` gets,
    per protected endpoint, what puts its request bodies under the cap.
    """
    views = app.view_functions
    wrapped = {}
    for endpoint, view in list(views.items()):
        if not getattr(view, _PROTECTED_ATTR, False) and marked(view):
            views[endpoint] = protected = _protect(app, view)
            wrapped[endpoint] = view
        else:
            protected = views[endpoint]
        guard = getattr(protected, _BODY_GUARD_ATTR, None)
        if guard is not None and body_guards is not None:
            body_guards[endpoint] = guard
    # Before the first request is answered; what init_app has said is not said again.
    misuse.report(app, app.extensions["idempotency"], wrapped)


def _protect(app: Flask, view: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper that stands for ``view``: decide, run the view as the owner, settle."""
    state: AppState = app.extensions["idempotency"]
    # The view itself, not the guard that refuses to run it in an app without the layer.
    run_view = app.ensure_sync(unguarded(view))  # a coroutine view as Flask
    # A view function's own options are fixed; a class-based view's depend on the method.
    fixed: RouteOptions | None = getattr(view, ROUTE_OPTIONS_ATTR, None)

    def guard_body(req: Any) -> None:
        route = fixed if fixed is not None else route_options(view, req.method)
        if route is not None:
            _limit_body(state, req, route)

    @functools.wraps(view)
    def protected(*args: Any, **kwargs: Any) -> Any:
        req = _current_request()  # bound once: each read through the proxy is a context lookup
        route = fixed if fixed is not None else route_options(view, req.method)
        if route is not None:
            decided = _decide_request(state, req, route, app)
            if isinstance(decided, Ownership):
                return _run_owner(decided, run_view, args, kwargs)
            if decided is not None:
                return decided  # the stored answer (C9)
        return run_view(*args, **kwargs)

    setattr(protected, _PROTECTED_ATTR, True)
    setattr(protected, _BODY_GUARD_ATTR, guard_body)
    return protected


def _limit_body(state: AppState, req: Any, route: RouteOptions) -> None:
    """Put the cap on the body of a request the layer will read the body of: one with a
    key header (the fingerprint) or a form (its key may be a field, C49), on a method
    the route protects. A request without either is left as it came: the layer reads
    nothing of it and the view runs as without the layer (C4)."""
    try:
        methods = state.effective_options(route).methods
    except ValueError:
        return  # a misconfigured route: its wrapper says so
    if req.method not in methods:
        return
    settings = state.settings
    if settings.header_environ_key in req.environ or req.mimetype in forms.FORM_MIMETYPES:
        request_body.limit(req, settings.max_request_bytes)


#: The request object itself, without the attribute proxying of ``request``.
_current_request: Callable[[], Any] = request._get_current_object  # type: ignore[attr-defined]


# -- deciding --------------------------------------------------------------------------


def _decide_request(
    state: AppState, req: Any, route: RouteOptions, app: Flask
) -> Response | Ownership | None:
    """What to do with a request to a protected view: the answer to send instead of
    running the view, the ownership under which the view runs, or ``None`` to run it
    without protection (no key, another method, a failed-open store).

    Raises the layer's problems (400, 409, 422, 503).
    """
    method = req.method
    try:
        options = state.effective_options(route)
    except ValueError as exc:  # reported at start-up (misuse.py); fail closed, this route only
        if method not in misuse.keyed_methods(state.settings, route):
            return None  # C1
        raise RouteMisconfigured(
            "This route's idempotency options clash with the app's settings, so it cannot"
            f" be served safely: {exc}"
        ) from None
    if method not in options.methods:
        return None  # C1: a key on another method is ignored
    if options.atomic and not state.has_db:  # reported at start-up too (misuse.py)
        raise RouteMisconfigured(misuse.ATOMIC_NEEDS_DB)  # before anything is claimed
    started = time.perf_counter()
    settings = state.settings
    try:
        # The environ entry ``req.headers.get(settings.header)`` reads: a WSGI server
        # joins repeated header lines into one value, so it never holds more than one
        # (``getlist`` would scan the whole environ).
        header = req.environ.get(settings.header_environ_key)
        if header is not None:
            key = parse_key(
                [header], strict=settings.strict_header, max_length=settings.key_max_length
            )
            request_body.limit(req, settings.max_request_bytes)  # (in place since the hook)
        elif req.mimetype in forms.FORM_MIMETYPES:  # C49: no header, maybe a form field
            request_body.limit(req, settings.max_request_bytes)
            key = forms.key_in_form(request_body.form(req)[0], settings)
        else:
            key = None
    except InvalidKey as exc:
        raise InvalidKeyProblem(str(exc)) from None  # C3
    if key is None:
        if options.required:
            raise MissingKey(f"This endpoint requires an {settings.header} header.")  # C4
        return None
    try:
        scope = state.scope_for_request(req, app)
    except StoreError as exc:  # the store's own scope secret is unreadable (C63)
        _store_down(state, None, started, exc, action="scope")  # 503, unless failing open
        after_this_request(_mark_unprotected)
        return None
    try:
        fingerprint = request_fingerprint(req, forms.omitted_fields(settings, app.config))
    except RequestTooLarge:
        raise
    except RequestEntityTooLarge:  # Werkzeug's own limit (MAX_CONTENT_LENGTH)
        raise too_large(settings.max_request_bytes) from None
    ident = Identity(scope, key_digest(scope, key), fingerprint, method, req.path)
    guard_locks = options.atomic

    def look_up() -> tuple[Outcome, str]:
        inherit.pick_up(state, app)  # C59: what an ended process handed on, before the claim
        try:
            return state.look_up(
                ident, ttl=options.ttl, lease=options.lease, guard_locks=guard_locks
            )
        except ClaimUnanswered as exc:  # may commit later: undo it in the background (C58)
            unanswered.keep_release(state, ident, options, started, app, req.endpoint, exc)
            raise

    def park(
        record: Record, recheck: Callable[[], Outcome], going: Callable[[Outcome], bool]
    ) -> Outcome:
        return _wait_for_original(state, ident, started, options.wait, record, recheck, going)

    verdict = decide(
        look_up,
        ident.fingerprint,
        park=park if options.wait > 0 else None,
        cached=lambda: state.cache.probe(ident.key_digest),  # the database is down (15.6)
    )
    if type(verdict) is Own:
        return _own(state, ident, options, started, verdict.claim, req, app)
    if type(verdict) is Replay:
        completed = verdict.completed
        if signals.request_replayed.receivers:  # (every replay: no arguments built for none)
            _send(
                signals.request_replayed,
                ident,
                started,
                source=verdict.source,
                status=completed.response.status,
            )
        return replay(completed, settings)  # C9
    if type(verdict) is KeyReused:
        _send(signals.key_mismatch, ident, started)
        raise KeyReusedProblem(
            "This Idempotency-Key was already used with a different request"
            " (another body, query, method or route). Use a new key for a new request."
        )  # C7
    if type(verdict) is InProgress:
        _send(signals.request_conflict, ident, started)
        raise RequestInProgress(
            "A request with this Idempotency-Key is still being processed."
            " Retry later with the same key and body.",
            retry_after=min(verdict.record.lease_remaining, max(1.0, options.wait)),
        )  # C11
    assert isinstance(verdict, Unavailable)
    _store_down(state, ident, started, verdict.error)  # 503, unless the app fails open
    after_this_request(_mark_unprotected)
    return None


def _wait_for_original(
    state: AppState,
    ident: Identity,
    started: float,
    wait: float,
    record: Record,
    recheck: Callable[[], Outcome],
    going: Callable[[Outcome], bool],
) -> Outcome:
    """Park until the original finishes, then re-check (C10–C12).

    Registered first, checked second: a completion between our last read and
    the wait still wakes us (X1). Each wake-up or poll tick re-reads the
    record; a released record is claimed by whichever waiter gets there first.
    """
    parked_at = time.perf_counter()
    current: Claim | Completed | Record = record
    outcome = wait_for_owner(
        state.wakeups, ident.key_digest, current, wait=wait, recheck=recheck, in_flight=going
    )
    _send(
        signals.request_waited,
        ident,
        started,
        waited=time.perf_counter() - parked_at,
        outcome=type(outcome).__name__.lower(),
    )
    return outcome


def _store_down(
    state: AppState,
    ident: Identity | None,
    started: float,
    exc: StoreError,
    action: str = "claim",
) -> None:
    """Answer 503 for a store that cannot claim (or, ``action="scope"``, give the secret
    a request's default scope is keyed by); return only when the app fails open (C25).

    A missing or mismatched table is a deployment error: never fail open for it (C45).
    """
    misconfigured = isinstance(exc, StoreMisconfigured)
    fail_open = state.settings.fail_open and not misconfigured
    if misconfigured:
        log.error("idempotency: %s", exc)
    else:
        state.outage_log.warning(
            "idempotency: durable store unavailable (%s), e.g. for key %s",
            exc,
            ident.key_digest[:16] if ident is not None else "(not named: no scope)",
        )
    answer = "unprotected" if fail_open else "503"
    _send(
        signals.store_error,
        ident,
        started,
        tier="database",
        error=str(exc),
        action=action,
        answer=answer,
    )
    if fail_open:
        return
    raise StoreUnavailable(
        "The idempotency table is not set up, so the request was not processed."
        if misconfigured
        else "The idempotency store is unavailable, so the request was not processed."
        " Retry later with the same key.",
        retry_after=_STORE_RETRY_AFTER,
    )  # C25


def _mark_unprotected(response: Response) -> Response:
    response.headers[UNPROTECTED_HEADER] = "store-unavailable"
    return response


# -- running the view as the owner ---------------------------------------------------


def _own(
    state: AppState,
    ident: Identity,
    options: EffectiveOptions,
    started: float,
    claim: Claim,
    req: Any,
    app: Flask,
) -> Ownership:
    """Take up the claim: the request now owns the record until it settles (C15)."""
    if claim.how == "replaced":
        state.cache.discard(ident.key_digest)  # an old copy must not replay
    own = Ownership(state, ident, claim, options, started, app, req.endpoint)
    if claim.how == "taken_over":
        own.emit(signals.lease_taken_over)
    req.environ[_OWNERSHIP_KEY] = own
    # The response Flask makes of the view (error handlers included) settles the claim,
    # before the app's own after_request hooks, which run again on every replay.
    after_this_request(functools.partial(completion.settle, own))
    # Whatever ends the request without that (an exception Flask propagates, an exit)
    # releases the claim when Flask closes the request.
    req.close = _closing_unsettled(req, own)
    own.start_heartbeat()
    if signals.request_executed.receivers:
        own.emit(signals.request_executed, how=claim.how)
    return own


def _run_owner(
    own: Ownership, view: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    try:
        return completion.run_view(own, view, args, kwargs)
    except Exception:
        raise  # Flask answers it: the answer settles the claim (an error handler's 4xx is stored)
    except BaseException:
        completion.settle_unfinished(own, "exception")  # an exit, an interrupt: no answer will come
        raise


def _closing_unsettled(req: Any, own: Ownership) -> Callable[[], None]:
    """``req.close`` that first releases a claim left unsettled, then closes as before."""
    close = req.close

    def close_request() -> None:
        try:
            own.stop_heartbeat()
            if not own.settled:
                failed = own.failed or sys.exc_info()[0] is not None
                completion.settle_unfinished(own, "exception" if failed else "unfinished")
        finally:
            try:
                close()
            finally:
                # The request holds this function, which holds the request: unlinked
                # once closed, the request (its environ, body, ownership) is freed at
                # once rather than left to the cycle collector (issue 11).
                vars(req).pop("close", None)

    return close_request


def mark_failed(sender: Any, exception: BaseException, **extra: Any) -> None:
    """``got_request_exception`` receiver: an uncaught exception always releases (C17),
    even where a 5xx answer would be stored (``store_server_errors``)."""
    own = current_ownership()
    if own is not None:
        own.failed = True


# -- signals -------------------------------------------------------------------------


def _send(signal: Any, ident: Identity | None, started: float, **extra: Any) -> None:
    """Every decision's signal carries the digest, scope, route and time spent (C30);
    ``None`` for the first two when the scope could not be made (the store is down)."""
    if signal.receivers:
        signals.send(
            signal,
            current_app._get_current_object(),  # type: ignore[attr-defined]
            key_digest=None if ident is None else ident.key_digest,
            scope=None if ident is None else ident.scope,
            route=request.endpoint,
            duration=time.perf_counter() - started,
            **extra,
        )
