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

A request to any other view runs nothing of the layer: the one hook the extension
registers wraps the marked views on the app's first request and then takes itself
out (issue 11). Every ``before_request`` hook of the app has run before the layer
decides, so a hook that rejects a request (CSRF, permissions) never claims a key,
and the scope loader sees what those hooks loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Flask, Response, after_this_request, current_app, has_request_context, request

from . import atomic, forms, heartbeat, signals
from .config import TRANSIENT_STATUSES, EffectiveOptions, RouteOptions
from .fingerprint import key_digest, request_fingerprint
from .keys import InvalidKey, parse_key
from .notify import wait_for_owner
from .problems import InvalidKeyProblem, KeyReused, MissingKey, RequestInProgress, StoreUnavailable
from .records import IN_PROGRESS, Claim, Completed, Identity, Record, StoredResponse
from .responses import capture, replay
from .store import StoreError, StoreMisconfigured

if TYPE_CHECKING:
    from .extension import AppState

log = logging.getLogger("flask_idempotency")

#: Attribute ``@idempotent`` sets on a view function.
ROUTE_OPTIONS_ATTR = "__idempotency_options__"
#: Header on a response the view produced without protection (``IDEMPOTENCY_FAIL_OPEN``).
UNPROTECTED_HEADER = "Idempotency-Unprotected"
_STORE_RETRY_AFTER = 3.0
#: Where a request's ownership lives: its WSGI environ, not ``g``. ``g`` belongs to the
#: app context, which a request shares with the next one pushed inside it (a test under
#: ``app.app_context()``, a sub-request made from a view), so state kept there leaks.
_OWNERSHIP_KEY = "flask_idempotency.ownership"
#: Set on the wrapper that stands for a marked view in ``app.view_functions``.
_PROTECTED_ATTR = "__idempotency_protected__"
#: Handler methods a class-based view may carry ``@idempotent`` on.
_HANDLER_NAMES = ("get", "post", "put", "patch", "delete", "head", "options", "trace")


@dataclasses.dataclass
class Ownership:
    """This request owns a record; it must end stored or released (C15)."""

    state: AppState
    ident: Identity
    claim: Claim
    options: EffectiveOptions
    started: float
    release_requested: bool = False
    failed: bool = False
    settled: bool = False
    #: Transactional mode: the view's transaction, begun once the view starts (C40, C43).
    unit: atomic.Unit | None = None
    #: The lease heartbeat's entry while the owner runs (C44).
    lease: heartbeat.Lease | None = None


@dataclasses.dataclass
class _Decision:
    """One protected request while the layer decides what to do with it."""

    state: AppState
    ident: Identity
    options: EffectiveOptions
    started: float
    source: str = "database"


def current_ownership() -> Ownership | None:
    """The claim the current request owns, if any (``None`` outside a request)."""
    if not has_request_context():
        return None
    own: Ownership | None = request.environ.get(_OWNERSHIP_KEY)
    return own


# -- putting the layer in place -------------------------------------------------------


def install(app: Flask) -> None:
    """Put the layer in front of ``app``'s marked views, at its first request.

    Only then is the app's set of views final (Flask refuses new routes after the
    first request) and every ``@idempotent`` applied, in whichever order it was
    stacked with the route decorator. The hook then removes itself, so later
    requests to unmarked views never enter the layer.
    """

    def protect_on_first_request() -> None:
        protect_views(app)
        hooks = app.before_request_funcs.get(None)
        if hooks is not None and protect_on_first_request in hooks:
            # A new list, not an edit: a concurrent first request may be iterating the old one.
            app.before_request_funcs[None] = [h for h in hooks if h is not protect_on_first_request]

    app.before_request(protect_on_first_request)


def protect_views(app: Flask) -> None:
    """Replace each marked view of ``app`` by its protected wrapper (once; idempotent).

    The mark sits on the registered view function, or, for a class-based view, on
    one of its handler methods (``MethodView.post``). Racing callers both wrap the
    registered original, so a view never ends up wrapped twice.
    """
    views = app.view_functions
    for endpoint, view in list(views.items()):
        if not getattr(view, _PROTECTED_ATTR, False) and _marked(view):
            views[endpoint] = _protect(app, view)


def _marked(view: Callable[..., Any]) -> bool:
    """Whether ``view`` is protected for any method (see :func:`_route_options`)."""
    return any(_route_options(view, name) is not None for name in _HANDLER_NAMES)


def _protect(app: Flask, view: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper that stands for ``view``: decide, run the view as the owner, settle."""
    state: AppState = app.extensions["idempotency"]
    run_view = app.ensure_sync(view)  # a coroutine view runs as Flask would run it
    # A view function's own options are fixed; a class-based view's depend on the method.
    fixed: RouteOptions | None = getattr(view, ROUTE_OPTIONS_ATTR, None)

    @functools.wraps(view)
    def protected(*args: Any, **kwargs: Any) -> Any:
        req = _current_request()  # bound once: each read through the proxy is a context lookup
        route = fixed if fixed is not None else _route_options(view, req.method)
        if route is not None:
            decided = _decide_request(state, req, route, app)
            if isinstance(decided, Ownership):
                return _run_owner(decided, run_view, args, kwargs)
            if decided is not None:
                return decided  # the stored answer (C9)
        return run_view(*args, **kwargs)

    setattr(protected, _PROTECTED_ATTR, True)
    return protected


#: The request object itself, without the attribute proxying of ``request``.
_current_request: Callable[[], Any] = request._get_current_object  # type: ignore[attr-defined]


def _route_options(view: Callable[..., Any], method: str) -> RouteOptions | None:
    """The ``@idempotent`` options of ``view`` for ``method``, if protected."""
    options: RouteOptions | None = getattr(view, ROUTE_OPTIONS_ATTR, None)
    if options is None:
        view_class = getattr(view, "view_class", None)
        if view_class is not None:
            handler = getattr(view_class, method.lower(), None)
            options = getattr(handler, ROUTE_OPTIONS_ATTR, None)
    return options


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
    options = state.effective_options(route)
    if method not in options.methods:
        return None  # C1: a key on another method is ignored
    if options.atomic:
        state.require_db()  # a configuration error must surface before anything is claimed
    started = time.perf_counter()
    settings = state.settings
    try:
        # The environ entry ``req.headers.get(settings.header)`` reads: a WSGI server
        # joins repeated header lines into one value, so it never holds more than one
        # (``getlist`` would scan the whole environ).
        header = req.environ.get(settings.header_environ_key)
        key = (
            parse_key([header], strict=settings.strict_header, max_length=settings.key_max_length)
            if header is not None
            else forms.key_from_form(req, settings)  # C49: no header, maybe a form field
        )
    except InvalidKey as exc:
        raise InvalidKeyProblem(str(exc)) from None  # C3
    if key is None:
        if options.required:
            raise MissingKey(f"This endpoint requires an {settings.header} header.")  # C4
        return None
    scope = state.scope_for_request(req, app)
    ident = Identity(
        scope,
        key_digest(scope, key),
        request_fingerprint(req, forms.omitted_fields(settings, app.config)),
        method,
        req.path,
    )
    decision = _Decision(state, ident, options, started)
    try:
        outcome = _decide(decision)
    except StoreError as exc:
        # The database is down: a cached record may still answer a replay (15.6).
        cached = state.cache.probe(ident.key_digest)
        if cached is None:
            _store_down(decision, exc)  # 503, unless the app fails open
            after_this_request(_mark_unprotected)
            return None
        decision.source = "cache"
        outcome = cached
    if isinstance(outcome, Claim):
        return _own(decision, outcome, req, app)
    return _answer(decision, outcome)


def _decide(decision: _Decision) -> Claim | Completed | Record:
    options = decision.options
    outcome, decision.source = decision.state.look_up(
        decision.ident, ttl=options.ttl, lease=options.lease, guard_locks=options.atomic
    )
    if type(outcome) is Record and _in_flight(decision, outcome):
        outcome = _wait_for_original(decision, outcome)
    return outcome


def _look_up(decision: _Decision) -> Claim | Completed | Record:
    """Cache first (completed records only), then claim or read the durable record."""
    outcome, decision.source = decision.state.look_up(
        decision.ident,
        ttl=decision.options.ttl,
        lease=decision.options.lease,
        guard_locks=decision.options.atomic,
    )
    return outcome


def _in_flight(decision: _Decision, outcome: Claim | Completed | Record) -> bool:
    return (
        isinstance(outcome, Record)
        and outcome.state == IN_PROGRESS
        and outcome.fingerprint == decision.ident.fingerprint
    )


def _wait_for_original(decision: _Decision, record: Record) -> Claim | Completed | Record:
    """Park until the original finishes, then re-check (C10–C12).

    Registered first, checked second: a completion between our last read and
    the wait still wakes us (X1). Each wake-up or poll tick re-reads the
    record; a released record is claimed by whichever waiter gets there first.
    """
    wait = decision.options.wait
    if wait <= 0:
        return record
    parked_at = time.perf_counter()
    current: Claim | Completed | Record = record
    outcome = wait_for_owner(
        decision.state.wakeups,
        decision.ident.key_digest,
        current,
        wait=wait,
        recheck=lambda: _look_up(decision),
        in_flight=lambda found: _in_flight(decision, found),
    )
    _emit(
        signals.request_waited,
        decision,
        waited=time.perf_counter() - parked_at,
        outcome=type(outcome).__name__.lower(),
    )
    return outcome


def _answer(decision: _Decision, outcome: Completed | Record) -> Response:
    """The answer to a request that does not own the record: a replay, else a problem."""
    if outcome.fingerprint != decision.ident.fingerprint:
        _emit(signals.key_mismatch, decision)
        raise KeyReused(
            "This Idempotency-Key was already used with a different request"
            " (another body, query, method or route). Use a new key for a new request."
        )  # C7
    if isinstance(outcome, Completed):
        if signals.request_replayed.receivers:  # (every replay: no arguments built for none)
            _emit(
                signals.request_replayed,
                decision,
                source=decision.source,
                status=outcome.response.status,
            )
        return replay(outcome, decision.state.settings)  # C9
    _emit(signals.request_conflict, decision)
    raise RequestInProgress(
        "A request with this Idempotency-Key is still being processed."
        " Retry later with the same key and body.",
        retry_after=min(outcome.lease_remaining, max(1.0, decision.options.wait)),
    )  # C11


# -- running the view as the owner ---------------------------------------------------


def _own(decision: _Decision, claim: Claim, req: Any, app: Flask) -> Ownership:
    """Take up the claim: the request now owns the record until it settles (C15)."""
    if claim.how == "replaced":
        decision.state.cache.discard(decision.ident.key_digest)  # an old copy must not replay
    elif claim.how == "taken_over":
        _emit(signals.lease_taken_over, decision)
    own = Ownership(decision.state, decision.ident, claim, decision.options, decision.started)
    req.environ[_OWNERSHIP_KEY] = own
    # The response Flask makes of the view (error handlers included) settles the claim,
    # before the app's own after_request hooks, which run again on every replay.
    after_this_request(functools.partial(_settle, own))
    # Whatever ends the request without that (an exception Flask propagates, an exit)
    # releases the claim when Flask closes the request.
    req.close = _closing_unsettled(req, own)
    _start_heartbeat(own, app, req.endpoint)
    if signals.request_executed.receivers:
        _emit(signals.request_executed, decision, how=claim.how)
    return own


def _run_owner(
    own: Ownership, run_view: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    try:
        if own.options.atomic:
            return _run_atomic(own, run_view, args, kwargs)
        return run_view(*args, **kwargs)
    except Exception:
        raise  # Flask answers it: the answer settles the claim (an error handler's 4xx is stored)
    except BaseException:
        _settle_unfinished(own, "exception")  # an exit, an interrupt: no answer will come
        raise


def _closing_unsettled(req: Any, own: Ownership) -> Callable[[], None]:
    """``req.close`` that first releases a claim left unsettled, then closes as before."""
    close = req.close

    def close_request() -> None:
        try:
            _stop_heartbeat(own)
            if not own.settled:
                failed = own.failed or sys.exc_info()[0] is not None
                _settle_unfinished(own, "exception" if failed else "unfinished")
        finally:
            try:
                close()
            finally:
                # The request holds this function, which holds the request: unlinked
                # once closed, the request (its environ, body, ownership) is freed at
                # once rather than left to the cycle collector (issue 11).
                vars(req).pop("close", None)

    return close_request


def _settle_unfinished(own: Ownership, reason: str) -> None:
    """Release a claim no response will settle (C15)."""
    if own.settled:
        return
    own.settled = True
    _stop_heartbeat(own)
    _release(own, reason, None)


def _mark_unprotected(response: Response) -> Response:
    response.headers[UNPROTECTED_HEADER] = "store-unavailable"
    return response


class ThrottledLog:
    """Log a recurring failure once, then at most once per ``every`` seconds with a count.

    During a database outage every protected request fails the same way; one line
    per request would bury everything else in the log.
    """

    def __init__(self, every: float = 10.0) -> None:
        self._every = every
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next = now + self._every
        if suppressed:
            message += f" ({suppressed} more since the last such line)"
        log.warning(message, *args)


def _store_down(decision: _Decision, exc: StoreError) -> None:
    """Answer 503 for a store that cannot claim; return only when the app fails open (C25)."""
    settings = decision.state.settings
    if isinstance(exc, StoreMisconfigured):  # a deployment error: never fail open for it (C45)
        log.error("idempotency: %s", exc)
        _emit(signals.store_error, decision, tier="database", error=str(exc), action="claim")
        raise StoreUnavailable(
            "The idempotency table is not set up, so the request was not processed.",
            retry_after=_STORE_RETRY_AFTER,
        )
    decision.state.outage_log.warning(
        "idempotency: durable store unavailable (%s), e.g. for key %s",
        exc,
        decision.ident.key_digest[:16],
    )
    _emit(signals.store_error, decision, tier="database", error=str(exc), action="claim")
    if settings.fail_open:
        return
    raise StoreUnavailable(
        "The idempotency store is unavailable, so the request was not processed."
        " Retry later with the same key.",
        retry_after=_STORE_RETRY_AFTER,
    )  # C25


# -- settling ------------------------------------------------------------------------


def _settle(own: Ownership, response: Response) -> Response:
    """Store the owner's answer, or release its claim (C15-C19); the response goes on."""
    _stop_heartbeat(own)  # also after a transactional view settled itself
    if own.settled:
        return response
    own.settled = True
    reason = _release_reason(own, response.status_code)
    if reason is not None:
        _release(own, reason, response.status_code)
        return response
    return _store(own, response)


def _release_reason(own: Ownership, status: int) -> str | None:
    """Why this outcome must not be stored, or ``None`` to store it (C16–C19)."""
    if own.release_requested:
        return "view"
    if own.failed:
        return "exception"
    if status in TRANSIENT_STATUSES:
        return "transient-status"
    if status >= 500 and not own.options.store_server_errors:
        return "server-error"
    return None


def _store(own: Ownership, response: Response) -> Response:
    """Complete the record with ``response``; the answer the client gets (C14, C23, C40)."""
    state = own.state
    digest = own.ident.key_digest
    if own.options.atomic:
        return _store_atomic(own, response)
    try:
        stored = capture(response, state.settings)
    except Exception:
        _release(own, "exception", response.status_code)  # a stream that failed mid-buffer
        raise
    try:
        expires_at_ms = _complete_with_retries(state, own.claim, stored)
    except StoreError as exc:
        # The view ran; its client still gets the answer. The claim stays until its
        # lease lapses, so a retry waits rather than running the view again at once.
        log.error("idempotency: could not store the response for %s: %s", digest[:16], exc)
        _emit_owned(signals.store_error, own, tier="database", error=str(exc), action="complete")
        return response
    if expires_at_ms is None:
        _lease_lost(own, "complete")
        return response
    _completed(own, stored, expires_at_ms)
    return response


#: Pauses between attempts to store a response while the database is unreachable.
_COMPLETE_RETRY_PAUSES = (0.05, 0.2, 0.5)


def _complete_with_retries(state: AppState, claim: Claim, stored: StoredResponse) -> int | None:
    """Store the response, riding out a short database blip (a failover, a restart).

    The view's effects already happened: if the response cannot be stored, a retry
    after the lease would run the view a second time, so it is worth holding this
    client's answer back a moment longer for a few more attempts.
    """
    for pause in _COMPLETE_RETRY_PAUSES:
        try:
            return state.store.complete(claim, stored)
        except StoreError:
            time.sleep(pause)
    return state.store.complete(claim, stored)


def _store_atomic(own: Ownership, response: Response, *, retry: bool = False) -> Response:
    """Commit the view's writes and the completion as one transaction (C40).

    Both or neither: if the lease was lost, or the commit failed, the view's
    writes are gone, so its response would be a lie; the client gets a problem
    telling it to retry with the same key. With ``retry``, a serialization
    failure or deadlock propagates as :class:`atomic.Retryable` for the caller to
    run the view again; without, it is answered like any failed commit.
    """
    state = own.state
    try:
        stored = capture(response, state.settings)
    except Exception:
        _release(own, "exception", response.status_code)  # a stream that failed mid-buffer
        raise
    if own.unit is None:
        own.unit = atomic.Unit(state.require_db(), state.store, own.claim, own.options.isolation)
    try:
        expires_at_ms = own.unit.commit(stored)
    except atomic.ViewWriteFailed:
        _release(own, "exception", stored.status)  # like an exception in the view (C17)
        raise
    except atomic.Retryable as exc:
        if retry:
            raise
        return _atomic_store_failed(own, StoreError(str(exc)), "commit", stored.status)
    except StoreError as exc:
        return _atomic_store_failed(own, exc, "commit", stored.status)
    if expires_at_ms is None:
        _lease_lost(own, "complete")
        return _lost_lease_answer()
    _completed(own, stored, expires_at_ms)
    return response


def _begin_unit(own: Ownership) -> Response | None:
    """Begin the view's transaction after the claim (C43); an answer if it cannot run."""
    state = own.state
    if own.unit is None:
        own.unit = atomic.Unit(state.require_db(), state.store, own.claim, own.options.isolation)
    try:
        own.unit.begin()
    except atomic.LeaseLost:
        own.settled = True
        _lease_lost(own, "begin")
        return _lost_lease_answer()
    except StoreError as exc:
        own.settled = True
        return _atomic_store_failed(own, exc, "begin", None)
    return None


def _run_atomic(
    own: Ownership, view: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the view and commit its writes with its record, as one unit of work (C40, C43).

    A serialization failure or deadlock, in the view or at the commit, rolls the
    attempt back; the view runs again in a fresh transaction under the same claim,
    up to the route's ``retries``. Only the last attempt's response is stored.
    Past the retries the claim is released and the client gets 503 with
    Retry-After. The claim itself is never given up between attempts.
    """
    attempts = 0
    while True:
        attempts += 1
        try:
            _hold_heartbeat(own)  # a renewal under way must not race the lock or snapshot
            refused = _begin_unit(own)
            if refused is not None:
                return refused
            assert own.unit is not None
            if not own.unit.locks_row:
                _resume_heartbeat(own)  # a row lock, where taken, holds the key instead
            response = current_app.make_response(view(*args, **kwargs))
            if _release_reason(own, response.status_code) is not None:
                return response  # settling releases it, rolling the writes back
            own.settled = True
            _hold_heartbeat(own)
            return _store_atomic(own, response, retry=True)
        except Exception as exc:
            sqlstate = atomic.retryable_sqlstate(exc)
            if sqlstate is None:
                raise
            own.settled = False
            assert own.unit is not None
            own.unit.rollback()
            _resume_heartbeat(own)
            if attempts > own.options.retries:
                return _out_of_retries(own, attempts, sqlstate)
            _emit_owned(signals.transaction_retried, own, attempt=attempts, sqlstate=sqlstate)
            time.sleep(random.uniform(0.0, 0.005 * attempts))  # let the winner commit first


def _out_of_retries(own: Ownership, attempts: int, sqlstate: str) -> Response:
    """Every attempt conflicted: keep nothing, free the key, tell the client to retry."""
    own.settled = True
    log.warning(
        "idempotency: %s conflicted with concurrent transactions (SQLSTATE %s) %d time(s);"
        " released",
        own.ident.key_digest[:16],
        sqlstate,
        attempts,
    )
    _release(own, "serialization-failure", None)
    return StoreUnavailable(
        f"The request conflicted with concurrent transactions {attempts} time(s) and nothing"
        " was kept. Retry with the same key.",
        retry_after=1.0,
    ).get_response()


def _lost_lease_answer() -> Response:
    return RequestInProgress(
        "Another request took this Idempotency-Key over while this one ran;"
        " this one's changes were rolled back. Retry with the same key to get its result.",
        retry_after=1.0,
    ).get_response()


def _atomic_store_failed(
    own: Ownership, exc: StoreError, action: str, status: int | None
) -> Response:
    log.error("idempotency: atomic %s failed for %s: %s", action, own.ident.key_digest[:16], exc)
    _emit_owned(signals.store_error, own, tier="database", error=str(exc), action=action)
    if not _release(own, f"{action}-failed", status):
        return _lost_lease_answer()  # another request holds the key now: its answer will replay
    return StoreUnavailable(
        "The request could not be committed and nothing was kept. Retry with the same key.",
        retry_after=_STORE_RETRY_AFTER,
    ).get_response()


def _completed(own: Ownership, stored: StoredResponse, expires_at_ms: int) -> None:
    """After the durable commit: promote to the cache, then wake the waiters (C23)."""
    state = own.state
    digest = own.ident.key_digest
    state.announce_completed(digest, Completed(own.ident.fingerprint, expires_at_ms, stored))
    if signals.response_stored.receivers:
        _emit_owned(
            signals.response_stored, own, status=stored.status, body_omitted=stored.body_omitted
        )


def mark_failed(sender: Any, exception: BaseException, **extra: Any) -> None:
    """``got_request_exception`` receiver: an uncaught exception always releases (C17),
    even where a 5xx answer would be stored (``store_server_errors``)."""
    own = current_ownership()
    if own is not None:
        own.failed = True


def _release(own: Ownership, reason: str, status: int | None) -> bool:
    """Give the key back; ``False`` when it was no longer ours (taken over)."""
    state = own.state
    digest = own.ident.key_digest
    if own.options.atomic:
        atomic.abandon(state.require_db())  # nothing the view wrote survives a release
    try:
        released = state.store.release(own.claim)
    except StoreError as exc:
        log.error("idempotency: could not release %s: %s", digest[:16], exc)
        _emit_owned(signals.store_error, own, tier="database", error=str(exc), action="release")
        return True
    if not released:
        _lease_lost(own, "release")
        return False
    state.wakeups.announce(digest, "released")  # C20: one waiter claims it next (C12)
    _emit_owned(signals.claim_released, own, reason=reason, status=status)
    return True


def _start_heartbeat(own: Ownership, app: Flask, endpoint: str | None) -> None:
    """Renew the owner's lease while its view runs (C44), unless the app turned it off."""
    state = own.state
    if not state.settings.heartbeat:
        return

    def report(reason: str) -> None:  # runs on the renewal thread
        log.warning(
            "idempotency: the lease on %s could not be renewed (%s)",
            own.ident.key_digest[:16],
            reason,
        )
        if signals.lease_renewal_failed.receivers:
            signals.send(
                signals.lease_renewal_failed,
                app,
                key_digest=own.ident.key_digest,
                scope=own.ident.scope,
                route=endpoint,
                duration=time.perf_counter() - own.started,
                reason=reason,
            )

    own.lease = heartbeat.start(
        state.store, own.claim, own.options.lease, state.settings.max_runtime, report
    )


def _stop_heartbeat(own: Ownership) -> None:
    lease, own.lease = own.lease, None
    if lease is not None:
        heartbeat.stop(lease)


def _hold_heartbeat(own: Ownership) -> None:
    if own.lease is not None:
        heartbeat.hold(own.lease)


def _resume_heartbeat(own: Ownership) -> None:
    if own.lease is not None and not own.settled:
        heartbeat.resume(own.lease)


def _lease_lost(own: Ownership, action: str) -> None:
    log.warning(
        "idempotency: lease on %s was taken over before %s; the new owner's record stands",
        own.ident.key_digest[:16],
        action,
    )
    _emit_owned(signals.lease_lost, own, action=action)


# -- signals -------------------------------------------------------------------------


def _emit(signal: Any, decision: _Decision, **extra: Any) -> None:
    _send(signal, decision.ident, decision.started, **extra)


def _emit_owned(signal: Any, own: Ownership, **extra: Any) -> None:
    _send(signal, own.ident, own.started, **extra)


def _send(signal: Any, ident: Identity, started: float, **extra: Any) -> None:
    """Every decision's signal carries the digest, scope, route and time spent (C30)."""
    if signal.receivers:
        signals.send(
            signal,
            current_app._get_current_object(),  # type: ignore[attr-defined]
            key_digest=ident.key_digest,
            scope=ident.scope,
            route=request.endpoint,
            duration=time.perf_counter() - started,
            **extra,
        )
