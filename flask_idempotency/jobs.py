"""``idempotency.once(key)``: a request's guarantees for work outside a request (CONTRACT C50).

Queue consumers, webhook handlers and scheduled jobs see the same message twice
(at-least-once delivery, a redelivery after a crashed consumer, a retried
task). ``once`` runs the work once per key and hands every duplicate the stored
result, on the same table and Redis tier as the request path and through the
same store calls: the claim is the atomic upsert, a crashed consumer's claim
lapses after its lease and is taken over by one conditional UPDATE, every later
write of the owner is fenced by its lock token, and a duplicate that arrives
while the work runs parks until the owner finishes.

    with idempotency.once(f"invoice-mail:{invoice.id}") as run:
        if run.owned:
            send_mail(invoice)
            run.result = {"sent": True}
    print(run.result)

    @idempotency.once(lambda invoice_id: f"invoice-mail:{invoice_id}")
    def send_invoice_mail(invoice_id: int) -> dict: ...

The result must be JSON-serialisable: it is stored like a response body. An
exception in the work releases the claim, so the next delivery runs it again.
With ``atomic=True`` and ``Idempotency(db=db)``, the work's writes through
``db.session`` commit in one transaction with the record (as C40): a consumer
killed at any instant leaves both or neither.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from flask import current_app

from . import signals
from .completion import deferred, heartbeat, inherit, spool
from .completion import unit as atomic
from .completion.ownership import Teller
from .decision import InProgress, KeyReused, Outcome, Own, Replay, Unavailable, decide
from .fingerprint import _digest, key_digest
from .notify import wait_for_owner
from .records import Claim, Completed, Identity, Record, StoredResponse
from .store import StoreError, StoreRefused

if TYPE_CHECKING:
    from .state import AppState


class _Extension(Protocol):
    """What ``once`` needs of the extension: its state on the current app."""

    @property
    def state(self) -> AppState: ...


log = logging.getLogger("flask_idempotency")

F = TypeVar("F", bound=Callable[..., Any])

#: The ``method`` column of a record written by ``once`` (requests hold HTTP methods).
JOB_METHOD = "ONCE"
_JSON = "application/json"


class OnceError(Exception):
    """Base of the errors ``once`` raises instead of running the work."""


class JobInProgress(OnceError):
    """Another consumer runs this key now and did not finish within ``wait``: retry later."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class JobKeyReused(OnceError):
    """The key was already used for other work (another name or payload): a caller bug (C7)."""


class JobLeaseLost(OnceError):
    """Atomic work outlived its lease and another consumer took the key over; this run's
    writes were rolled back (C14). The new owner's result stands."""


class Run(Teller):
    """One pass through ``once``: either the owner (``owned``) or a duplicate with ``result``.

    It tells its signals and lease lines as a request's owner does (:class:`Teller`), its
    route named ``once:<name>``."""

    ident: Identity

    def __init__(self, ident: Identity) -> None:
        self.ident = ident
        #: True when this caller must do the work; set :attr:`result` before leaving the block.
        self.owned = False
        #: The work's result: what the owner set, or what a duplicate got from the store.
        self.result: Any = None
        #: The stored result was too large to keep (``IDEMPOTENCY_MAX_BODY_BYTES``, C33).
        self.result_omitted = False
        #: Where a duplicate's result came from: ``"cache"`` or ``"database"``.
        self.source: str | None = None
        self._claim: Claim | None = None
        self._state: AppState | None = None
        self._atomic = False
        #: Atomic work's transaction, begun after the claim (C40, C43).
        self._unit: atomic.Unit | None = None
        #: The lease heartbeat's entry while the owner works (C44).
        self._lease: heartbeat.Lease | None = None
        self.started = time.perf_counter()
        self._lease_seconds = 0.0
        #: The app the work runs in: deferred settlements report from another thread.
        self.app: Any = None

    @property
    def key_digest(self) -> str:
        """Digest of (scope, key): a downstream idempotency key for this work (C30)."""
        return self.ident.key_digest

    # -- what a deferred settlement needs of its owner (C55, completion.deferred.Owner) --

    @property
    def state(self) -> AppState:
        assert self._state is not None
        return self._state

    @property
    def claim(self) -> Claim:
        assert self._claim is not None
        return self._claim

    @property
    def route(self) -> str:
        """The job as the signals and the spool name it: ``once:<name>``."""
        return "once:" + self.ident.path

    @property
    def lease_seconds(self) -> float:
        return self._lease_seconds

    def report_lease(self, reason: str) -> None:
        """As a request's owner reports it, the log line naming the job, not its digest."""
        log.warning("idempotency: the lease on %s could not be renewed (%s)", self.route, reason)
        self.emit(signals.lease_renewal_failed, reason=reason)


class Once:
    """Context manager and decorator returned by :meth:`Idempotency.once`."""

    def __init__(
        self,
        extension: _Extension,
        key: str | Callable[..., Any],
        *,
        scope: str = "jobs",
        ttl: float | None = None,
        lease: float | None = None,
        wait: float | None = None,
        payload: Any = None,
        name: str | None = None,
        atomic: bool = False,
    ) -> None:
        if not callable(key) and (not isinstance(key, str) or not key):
            raise ValueError("once() needs a non-empty key, or a function of the job's arguments.")
        if not isinstance(scope, str) or not scope:
            raise ValueError("once(scope=...) must be a non-empty string.")
        self._extension = extension
        self._key = key
        self._scope = scope
        self._ttl = ttl
        self._lease = lease
        self._wait = wait
        self._payload = payload
        self._name = name
        self._atomic = atomic
        #: Open ``with`` blocks, per thread: one ``Once`` may be shared by several threads.
        self._local = threading.local()

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> Run:
        if callable(self._key):
            raise TypeError("once(key=<function>) is a decorator; give a string key to `with`.")
        run = self._begin(self._key, self._name or "once", self._payload)
        self._open_runs().append(run)
        return run

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        run = self._open_runs().pop()
        if not run.owned:
            return
        if exc is not None:
            self._release(run, "exception")
            return
        self._complete(run)

    def _open_runs(self) -> list[Run]:
        runs: list[Run] | None = getattr(self._local, "runs", None)
        if runs is None:
            runs = self._local.runs = []
        return runs

    # -- decorator -------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        name = self._name or f"{func.__module__}.{func.__qualname__}"
        signature = inspect.signature(func)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = self._key_for(signature, args, kwargs)
            run = self._begin(key, name, self._payload)
            if not run.owned:
                return run.result
            try:
                run.result = func(*args, **kwargs)
            except BaseException:
                self._release(run, "exception")
                raise
            self._complete(run)
            return run.result

        return wrapper  # type: ignore[return-value]

    def _key_for(self, signature: inspect.Signature, args: Any, kwargs: Any) -> str:
        if callable(self._key):
            key = self._key(*args, **kwargs)
        else:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            key = self._key.format(**bound.arguments) if "{" in self._key else self._key
        if not isinstance(key, str) or not key:
            raise ValueError(f"once(): the key function returned {key!r}, not a non-empty string.")
        return key

    # -- the lifecycle -----------------------------------------------------------------

    def _begin(self, key: str, name: str, payload: Any) -> Run:
        state = self._extension.state
        settings = state.settings
        ttl = settings.ttl if self._ttl is None else float(self._ttl)
        lease = settings.lease if self._lease is None else float(self._lease)
        wait = settings.wait if self._wait is None else float(self._wait)
        if not 0 < lease < ttl:
            raise ValueError("once(): the lease must be positive and shorter than the ttl.")
        if self._atomic:
            state.require_db()
        scope = "job:" + self._scope
        ident = Identity(
            scope=scope,
            key_digest=key_digest(scope, key),
            fingerprint=job_fingerprint(name, payload),
            method=JOB_METHOD,
            path=name,
        )
        run = Run(ident)
        if not settings.enabled:  # the layer is off (C56): the work runs, nothing is kept
            run.owned = True
            return run
        run._state = state
        run._atomic = self._atomic
        run._lease_seconds = lease
        run.app = current_app._get_current_object()  # type: ignore[attr-defined]
        inherit.pick_up(state, run.app)  # C59: what an ended process handed on, first
        verdict = decide(
            lambda: state.look_up(ident, ttl=ttl, lease=lease, guard_locks=run._atomic),
            ident.fingerprint,
            park=functools.partial(_wait_for_owner, state, run, wait) if wait > 0 else None,
        )
        if type(verdict) is Unavailable:
            exc = verdict.error
            run.emit(signals.store_error, tier="database", error=str(exc), action="claim")
            raise exc
        if type(verdict) is Own:
            claim = verdict.claim
            run.owned = True
            run._claim = claim
            if claim.how == "replaced":
                state.cache.discard(ident.key_digest)
            elif claim.how == "taken_over":
                run.emit(signals.lease_taken_over)
            run.emit(signals.request_executed, how=claim.how)
            _start_heartbeat(state, run, lease)
            if self._atomic:
                self._begin_unit(run)
            return run
        if type(verdict) is KeyReused:
            run.emit(signals.key_mismatch)
            raise JobKeyReused(
                f"once(): key {ident.key_digest[:16]}… was already used for other work"
                " (another job name or payload). Use a new key for new work."
            )
        if type(verdict) is Replay:
            run.source = verdict.source
            run.result, run.result_omitted = _decode(verdict.completed.response)
            run.emit(signals.request_replayed, source=run.source, status=200)
            return run
        assert type(verdict) is InProgress
        run.emit(signals.request_conflict)
        raise JobInProgress(
            "once(): another consumer is running this key; retry later.",
            retry_after=max(0.1, verdict.record.lease_remaining),
        )

    def _complete(self, run: Run) -> None:
        if run._state is None:
            return  # IDEMPOTENCY_ENABLED = False: nothing to store
        state, claim = run._state, run._claim
        assert state is not None and claim is not None
        _stop_heartbeat(run)  # the completion is fenced; a renewal must not race it
        try:
            body = json.dumps(run.result, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            self._release(run, "unserialisable-result")
            raise TypeError(f"once(): the result must be JSON-serialisable: {exc}") from exc
        omitted = len(body) > state.settings.max_body_bytes
        stored = StoredResponse(
            200, (("Content-Type", _JSON),), b"" if omitted else body, body_omitted=omitted
        )
        if run._unit is not None:
            try:
                expires_at_ms = run._unit.commit(stored)
            except atomic.ViewWriteFailed:
                self._release(run, "exception")
                raise
            except atomic.Retryable as exc:  # a serialization failure: the queue retries it
                self._release(run, "commit-failed")
                raise StoreError(str(exc)) from exc
            except StoreError as exc:
                run.emit(signals.store_error, tier="database", error=str(exc), action="commit")
                self._release(run, "commit-failed")
                raise
            if expires_at_ms is None:
                run.lease_lost("complete")
                raise JobLeaseLost(
                    "once(): another consumer took this key over while the work ran;"
                    " its writes were rolled back."
                )
        else:
            stored = state.store.fitting(stored)  # a body the database would refuse (C58)
            omitted = stored.body_omitted
            try:
                try:
                    expires_at_ms = state.store.complete(claim, stored)
                except StoreRefused as exc:
                    if omitted:
                        raise
                    # Refused for good (C58): stored without its result as C33 stores a
                    # large one, or the key given back where even that is refused (below);
                    # once, never kept.
                    run.emit(
                        signals.store_error, tier="database", error=str(exc), action="complete"
                    )
                    log.error(
                        "idempotency: once(): the database refused the completion of %s (%s);"
                        " storing it without its result (C33)",
                        run.key_digest[:16],
                        exc,
                    )
                    stored, omitted = stored.without_body(), True
                    expires_at_ms = state.store.complete(claim, stored)
            except StoreRefused as exc:
                run.emit(signals.store_error, tier="database", error=str(exc), action="complete")
                log.error(
                    "idempotency: once(): the database refused the completion of %s even"
                    " without its result (%s); the key is released",
                    run.key_digest[:16],
                    exc,
                )
                self._release(run, "store-refused")
                return
            except StoreError as exc:
                # The work is done: the process keeps the result and stores it once the
                # store answers again (C55); a duplicate meanwhile waits or gets
                # JobInProgress. Only when it keeps too many does the caller see the error.
                if not deferred.keep(
                    run,
                    "complete",
                    lambda: state.store.complete(claim, stored, kept=True),
                    functools.partial(_completion_landed, run, stored, omitted),
                    size=len(stored.body),
                    error=exc,
                    handover=_handover(run, "complete", response=stored),
                ):
                    raise
                return
            if expires_at_ms is None:
                run.lease_lost("complete")
                return
        _completion_landed(run, stored, omitted, expires_at_ms)

    def _begin_unit(self, run: Run) -> None:
        """Begin atomic work's transaction after the claim, so that it sees the claim (C43)."""
        state, claim = run._state, run._claim
        assert state is not None and claim is not None
        run._unit = atomic.Unit(state.require_db(), state.store, claim, None)
        if run._lease is not None:
            heartbeat.hold(run._lease)  # a renewal under way must not race the lock or snapshot
        try:
            run._unit.begin()
            if run._lease is not None and not run._unit.locks_row:
                heartbeat.resume(run._lease)  # a row lock, where taken, holds the key instead
        except atomic.LeaseLost:
            _stop_heartbeat(run)
            run.owned = False
            run.lease_lost("begin")
            raise JobLeaseLost("once(): the key was taken over before the work began.") from None
        except (atomic.Retryable, StoreError) as exc:
            self._release(run, "begin-failed")
            raise StoreError(str(exc)) from exc

    def _release(self, run: Run, reason: str) -> None:
        """Give the key back so the next delivery runs the work (C17, C20)."""
        if run._state is None:
            return  # IDEMPOTENCY_ENABLED = False: nothing was claimed
        state, claim = run._state, run._claim
        assert state is not None and claim is not None
        _stop_heartbeat(run)
        run.owned = False
        if run._unit is not None:
            run._unit.rollback()  # nothing the work wrote survives a release
        try:
            released = state.store.release(claim)
        except StoreError as exc:
            deferred.keep(
                run,
                "release",
                lambda: state.store.release(claim, kept=True),
                lambda released: _released(run, bool(released), reason),
                size=0,
                error=exc,
                handover=_handover(run, "release", reason=reason),
            )
            return
        _released(run, released, reason)


def _handover(run: Run, action: str, **what: Any) -> spool.Handover:
    """What another process needs to land this settlement once this one ended (C59)."""
    return spool.Handover(action, run.claim, run.ident, run.lease_seconds, run.route, **what)


def _released(run: Run, released: bool, reason: str) -> None:
    if not released:
        run.lease_lost("release")
        return
    run.state.wakeups.announce(run.key_digest, "released")
    run.emit(signals.claim_released, reason=reason, status=None)


def _completion_landed(
    run: Run, stored: StoredResponse, omitted: bool, expires_at_ms: int | None
) -> None:
    """After the durable commit (now or deferred): promote, wake, tell (C23)."""
    if expires_at_ms is None:
        run.lease_lost("complete")
        return
    completed = Completed(run.ident.fingerprint, expires_at_ms, stored)
    run.state.announce_completed(run.key_digest, completed)  # C23: after the commit
    if omitted:
        run.state.stored_without_body(run.route)
    run.emit(signals.response_stored, status=200, body_omitted=omitted)


def _start_heartbeat(state: AppState, run: Run, lease: float) -> None:
    """Renew the owner's lease while the work runs (C44), unless the app turned it off."""
    if not state.settings.heartbeat:
        return
    run._lease = heartbeat.start(
        state.store, run.claim, lease, state.settings.max_runtime, run.report_lease
    )


def _stop_heartbeat(run: Run) -> None:
    if run._lease is not None:
        heartbeat.stop(run._lease)
        run._lease = None


def job_fingerprint(name: str, payload: Any) -> str:
    """What makes two calls the same work: the job's name and its canonical payload."""
    try:
        canonical = json.dumps(
            payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"once(payload=...) must be JSON-serialisable: {exc}") from exc
    return _digest(b"once1", name.encode("utf-8"), canonical.encode("utf-8"))


def _wait_for_owner(
    state: AppState,
    run: Run,
    wait: float,
    record: Record,
    recheck: Callable[[], Outcome],
    going: Callable[[Outcome], bool],
) -> Outcome:
    """Park until the owner finishes or its lease lapses (C10–C13), as a request does."""
    parked_at = time.perf_counter()
    current: Claim | Completed | Record = record
    outcome = wait_for_owner(
        state.wakeups, run.key_digest, current, wait=wait, recheck=recheck, in_flight=going
    )
    run.emit(
        signals.request_waited,
        waited=time.perf_counter() - parked_at,
        outcome=type(outcome).__name__.lower(),
    )
    return outcome


def _decode(response: StoredResponse) -> tuple[Any, bool]:
    if response.body_omitted:
        return None, True
    return json.loads(response.body) if response.body else None, False
