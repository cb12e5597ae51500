"""Wake-ups across processes on Redis pub/sub (one node, Sentinel): C10, issue 11.

Completion publishes ``{"k": <digest>, "e": "done"}`` (or ``"released"``) on
``{prefix}:{origin}:done``, but only when a waiter asked for it: a parked request
first sets ``{prefix}:{origin}:waiting:{<digest>}`` (:meth:`RedisNotifier.expect`),
whoever settles the record checks for it after the durable commit (see
:mod:`.hub` for why that never loses a wake-up). Each process reads the channel on
one listener thread (:mod:`.listener`). Failures go through the tier's breaker
(:mod:`flask_idempotency.cache.outage`); no method raises.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from ..cache.codec import Origin, names_prefix
from ..cache.outage import Outage, report_failure, report_success
from .listener import WakeupListener, listener_for

if TYPE_CHECKING:
    from .hub import WakeupHub

log = logging.getLogger("flask_idempotency")

#: Suffix of the wake-up channel: ``{prefix}:done`` carries both ``done`` and ``released``.
CHANNEL_SUFFIX = "done"
#: The key a parked request sets to ask for its record's wake-up (issue 11).
WAITING_SUFFIX = "waiting"
#: A waiting mark outlives its waiter's own wait by this much (a slow re-read, a late start).
_EXPECT_MARGIN = 1.0
#: Sets a waiting mark to live at least ``ARGV[1]`` ms, never less than it has left: all
#: the waiters of a record share the mark, and a later one with a shorter wait must not
#: cut short a longer one's wake-up (C53). One command, the same on Redis 6 and 7.
_MARK_SCRIPT = """
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
end
return 1
"""


class RedisNotifier:
    """:class:`~flask_idempotency.notify.CrossProcessChannel` on Redis pub/sub."""

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "idem",
        origin: str | Callable[[], str] = "",
        outage: Outage | None = None,
        listener_key: Hashable | None = None,
        listener_connect: Callable[[], Any] | None = None,
        first_wait: float = 0.5,
    ) -> None:
        self._client = client
        self.prefix = prefix
        self._origin = Origin(origin)
        self.outage = outage or Outage()
        self._connect = listener_connect or (lambda: client)
        # Keyed by the client object itself, not id(client): a later client can never
        # reuse its id and be handed this listener. The registry forgets the listener
        # (and so the client) when the last app using it is gone (9.8).
        self._listener_base = listener_key or ("client", client)
        self._first_wait = first_wait
        #: Whether the server runs scripts (``None``: not asked yet); see :meth:`_mark`.
        self._scripts: bool | None = None
        #: The part of every waiting mark's name before its digest, made once the origin
        #: is known (every completion asks for a mark's name).
        self._waiting_head: str | None = None

    @property
    def channel(self) -> str:
        return f"{names_prefix(self.prefix, self._origin.get())}:{CHANNEL_SUFFIX}"

    def waiting_name(self, key_digest: str) -> str:
        """The key a waiter sets to be woken for ``key_digest``: in the record's hash tag,
        so on a cluster it lives beside the record (one slot, one round trip)."""
        head = self._waiting_head
        if head is None:
            head = self._waiting_head = (
                f"{names_prefix(self.prefix, self._origin.get())}:{WAITING_SUFFIX}:{{"
            )
        return head + key_digest + "}"

    @staticmethod
    def wakeup_payload(key_digest: str, event: str) -> str:
        return json.dumps({"k": key_digest, "e": event}, separators=(",", ":"))

    def ensure_listening(self, hub: WakeupHub) -> bool:
        try:
            return self.listener.ensure(hub)
        except Exception as exc:
            log.warning("idempotency: could not start the wake-up listener: %s", exc)
            return False

    def _outage_for(self, key_digest: str) -> Outage:
        return self.outage

    def expect(self, key_digest: str, seconds: float) -> bool:
        """Record that a waiter of this process waits up to ``seconds`` for ``key_digest``:
        whoever settles it within that time publishes the wake-up (see :mod:`.hub`). The
        record's one mark is extended to cover this wait, never shortened (C53)."""
        outage = self._outage_for(key_digest)
        if not outage.allows():
            return False
        try:
            self._mark(
                self.waiting_name(key_digest), max(1, int((seconds + _EXPECT_MARGIN) * 1000))
            )
        except Exception as exc:
            report_failure(outage, exc, "expect", key_digest)
            return False
        report_success(outage)
        return True

    def _mark(self, name: str, ttl_ms: int) -> None:
        """Make the waiting mark ``name`` live at least ``ttl_ms`` from now, never less than
        it has left: :data:`_MARK_SCRIPT`, or, on a server that refuses scripts (an ACL
        without ``EVAL``, a stand-in like fakeredis), ``SET NX`` then ``PEXPIRE GT``. Both
        only lengthen a mark. Whether scripts run is asked once, with a script of its own,
        so that an error of the real one (a demoted master's ``READONLY``) is a failure.
        """
        from redis.exceptions import ResponseError

        client = self._client
        if self._scripts is None:
            try:
                client.eval("return 1", 0)
                self._scripts = True
            except ResponseError as exc:
                self._scripts = False
                log.info(
                    "idempotency: Redis refuses scripts (%s); waiting marks are set with"
                    " SET NX and PEXPIRE GT",
                    exc,
                )
        if self._scripts:
            client.eval(_MARK_SCRIPT, 1, name, ttl_ms)
            return
        client.set(name, b"1", px=ttl_ms, nx=True)
        try:
            client.pexpire(name, ttl_ms, gt=True)
        except ResponseError:
            pass  # Redis 6 without scripts: no GT; a later, longer waiter is woken by polling

    def publish(self, key_digest: str, event: str) -> None:
        """Wake the processes waiting for ``key_digest``, if any waits (one ``EXISTS``;
        the wake-up itself only when a waiter asked for it)."""
        outage = self._outage_for(key_digest)
        if not outage.allows():
            return
        try:
            if self._client.exists(self.waiting_name(key_digest)):
                self._publish_now(key_digest, event)
        except Exception as exc:
            self._publish_failed()
            report_failure(outage, exc, "publish", key_digest)
            return
        report_success(outage)

    def _publish_now(self, key_digest: str, event: str) -> None:
        self._client.publish(self.channel, self.wakeup_payload(key_digest, event))

    def _publish_failed(self) -> None:
        """Forget what a failed publish may have made stale (a cluster's slot map)."""

    @property
    def listener(self) -> WakeupListener:
        """This process's subscriber for this Redis and channel."""
        channel = self.channel
        connect, first_wait = self._connect, self._first_wait
        return listener_for(
            (self._listener_base, channel),
            lambda: WakeupListener(connect, channel, first_wait=first_wait),
        )

    def close(self) -> None:
        """Stop this process's listener for this Redis (tests, shutdown)."""
        self.listener.stop()
