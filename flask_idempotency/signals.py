"""Blinker signals for every decision the layer takes.

Each is sent with the application as sender and these keyword arguments:
``key_digest`` (never the raw key, C30), ``scope``, ``route`` (the endpoint) and
``duration`` (seconds spent in the layer for that decision); some add more, as
noted. Connect receivers to count, log or trace them::

    from flask_idempotency import signals

    @signals.request_replayed.connect_via(app)
    def count_replay(sender, **extra):
        REPLAYS.labels(extra["route"], extra["source"]).inc()
"""

from __future__ import annotations

import logging
from typing import Any

from blinker import Namespace, Signal

log = logging.getLogger("flask_idempotency")
_signals = Namespace()


def send(signal: Signal, sender: Any, **extra: Any) -> None:
    """Send ``signal``; a receiver that raises is logged and never fails the request.

    Receivers count and log; the decision they report (a replay, a stored
    response) has already been taken, and a broken metrics hook must not turn it
    into a 500.
    """
    if not signal.receivers:
        return
    try:
        signal.send(sender, **extra)
    except Exception:
        log.exception(
            "idempotency: a receiver of the %s signal failed", getattr(signal, "name", signal)
        )


#: The view ran as the owner of a new, replaced or taken-over claim. Extra: ``how``.
request_executed = _signals.signal("idempotency-request-executed")
#: A stored response was replayed. Extra: ``source`` (``"cache"`` or ``"database"``), ``status``.
request_replayed = _signals.signal("idempotency-request-replayed")
#: A duplicate parked while the original ran. Extra: ``waited`` (seconds), ``outcome``.
request_waited = _signals.signal("idempotency-request-waited")
#: A duplicate was answered 409: the original is still running.
request_conflict = _signals.signal("idempotency-request-conflict")
#: The key was reused with a different request: 422.
key_mismatch = _signals.signal("idempotency-key-mismatch")
#: A lapsed lease was taken over (the original owner crashed or overran it).
lease_taken_over = _signals.signal("idempotency-lease-taken-over")
#: An owner found its lease taken when it tried to complete or release. Extra: ``action``.
lease_lost = _signals.signal("idempotency-lease-lost")
#: A claim was released, so a retry runs the view again. Extra: ``reason``, ``status``.
claim_released = _signals.signal("idempotency-claim-released")
#: A response was stored. Extra: ``status``, ``body_omitted``.
response_stored = _signals.signal("idempotency-response-stored")
#: A store failed. Extra: ``tier`` (``"database"`` or ``"cache"``), ``error``, ``action``;
#: for a request whose claim failed (``action="claim"``), ``answer``: ``"503"``, or
#: ``"unprotected"`` when ``IDEMPOTENCY_FAIL_OPEN`` ran the view without protection.
store_error = _signals.signal("idempotency-store-error")
#: Transactional mode: a serialization failure or deadlock rolled the view back and it runs
#: again under the same claim (C43). Extra: ``attempt`` (the one that failed), ``sqlstate``.
transaction_retried = _signals.signal("idempotency-transaction-retried")
#: A running owner's lease could not be renewed (C44); sent from the renewal thread.
#: Extra: ``reason``: ``"taken-over"`` (the record is no longer this owner's),
#: ``"store-unavailable"`` (renewals failed until the lease ran out) or
#: ``"max-runtime"`` (renewals stopped at ``IDEMPOTENCY_MAX_RUNTIME``).
lease_renewal_failed = _signals.signal("idempotency-lease-renewal-failed")
#: A completion or release the store refused for now (a failover, a restart) is kept by the
#: owner's process and retried in the background until it lands (C55). Sent when it is
#: kept, when it lands and when it is given up; the later two from the renewal thread.
#: Extra: ``action`` (``"complete"`` or ``"release"``), ``outcome`` (``"deferred"``,
#: ``"landed"`` (this try or an earlier one of its own, C58), ``"fenced"`` (another
#: owner's record stands; ``lease_lost`` follows), ``"gave-up"``, or ``"refused"`` when
#: the process already holds as many as it may keep), ``pending`` (how many this
#: process holds now).
settlement_deferred = _signals.signal("idempotency-settlement-deferred")
