"""One request's ownership of a record, from the claim until it settles (C15).

An :class:`Ownership` is made when a request wins the claim and lives in the
request's WSGI environ. It carries what settling needs (the app's state, the
claim and its lock token, the route's options) and the two things that run
while the view runs: the lease heartbeat (C44) and, in transactional mode, the
view's unit of work (C40). It knows its app and endpoint, so settling can report
through the signals without a request context.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from .. import signals
from ..config import EffectiveOptions
from ..records import Claim, Identity
from . import heartbeat
from .unit import Unit

if TYPE_CHECKING:
    from flask import Flask

    from ..state import AppState

log = logging.getLogger("flask_idempotency")


class Teller:
    """What the owner of a record tells: its signals and its lease's log lines, from
    the request's :class:`Ownership` or from the process that adopted a settlement an
    ended one handed on (:class:`.inherit.Heir`). Each names the app that sends the
    signals, the key's identity, the route and when the owner began."""

    __slots__ = ()

    if TYPE_CHECKING:
        app: Flask
        started: float

        @property
        def ident(self) -> Identity: ...
        @property
        def route(self) -> str | None: ...

    def emit(self, signal: Any, **extra: Any) -> None:
        """Send a decision's signal: digest, scope, route and time spent, never the key (C30)."""
        if signal.receivers:
            signals.send(
                signal,
                self.app,
                key_digest=self.ident.key_digest,
                scope=self.ident.scope,
                route=self.route,
                duration=time.perf_counter() - self.started,
                **extra,
            )

    def lease_lost(self, action: str) -> None:
        log.warning(
            "idempotency: lease on %s was taken over before %s; the new owner's record stands",
            self.ident.key_digest[:16],
            action,
        )
        self.emit(signals.lease_lost, action=action)

    def report_lease(self, reason: str) -> None:
        """The renewer's report that the lease could not be renewed (on its thread)."""
        log.warning(
            "idempotency: the lease on %s could not be renewed (%s)",
            self.ident.key_digest[:16],
            reason,
        )
        self.emit(signals.lease_renewal_failed, reason=reason)


@dataclasses.dataclass(slots=True)
class Ownership(Teller):
    """This request owns a record; it must end stored or released (C15).

    With slots: one is made per first execution, and setting its fields is part of
    every one (issue 21)."""

    state: AppState
    ident: Identity
    claim: Claim
    options: EffectiveOptions
    started: float
    #: The app and endpoint the signals name (settling may run after the view returned).
    app: Flask
    route: str | None
    release_requested: bool = False
    failed: bool = False
    settled: bool = False
    #: Transactional mode: the view's transaction, begun once the view starts (C40, C43).
    unit: Unit | None = None
    #: The lease heartbeat's entry while the owner runs (C44).
    lease: heartbeat.Lease | None = None

    # -- the lease heartbeat (C44) ------------------------------------------------------

    def start_heartbeat(self) -> None:
        """Renew the lease while the view runs, unless the app turned heartbeats off."""
        settings = self.state.settings
        if not settings.heartbeat:
            return
        self.lease = heartbeat.start(
            self.state.store,
            self.claim,
            self.lease_seconds,
            settings.max_runtime,
            self.report_lease,
        )

    @property
    def lease_seconds(self) -> float:
        return self.options.lease

    def stop_heartbeat(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            heartbeat.stop(lease)

    def hold_heartbeat(self) -> None:
        """Pause renewals: one under way must not race a row lock or a snapshot."""
        if self.lease is not None:
            heartbeat.hold(self.lease)

    def resume_heartbeat(self) -> None:
        if self.lease is not None and not self.settled:
            heartbeat.resume(self.lease)
