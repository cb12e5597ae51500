"""The cache of completed records on Redis (single node, Sentinel, Cluster): C22–C24.

Redis is never the source of truth (C22). It holds only completed records, under
``{prefix}:{origin}:{<digest>}`` (:mod:`.codec`); each cached value also names its
origin and carries a MAC under the store's own secret (C60), both checked on read
before anything else: a value that fails them is a miss, served from the database.
A copy expires after the time the durable record has left by the *database's*
clock (``PX``, C42): neither the app host's clock nor Redis's has to agree with it.
That time is read after the value is encoded, less :data:`EXPIRY_MARGIN_MS` for the
trip to Redis, and read again if the ``SET`` took longer than the margin to answer:
a copy never outlives its record (C53). Absence
and in-progress state are never cached: a miss always falls through to the durable
store. Completion promotes the record and, in the same round trip, asks whether a
waiter wants its wake-up (:mod:`..notify`). A value read back is replayed only if
the app could have stored it (:class:`~.codec.ReplayHeaders`, C22).

Losing Redis changes latency, not outcomes (C24): every call goes through the
tier's breaker (:mod:`.outage`), and no method raises. A plain single-node client
reads through the pre-packed fast path of :mod:`flask_idempotency._wire.redis`.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._wire.redis import _reader_for
from ..config import Settings
from ..logs import ThrottledLog
from ..notify.cluster import ClusterNotifier
from ..notify.redis import RedisNotifier
from ..records import Completed
from ..responses import BODY_HEADERS
from .cluster import promote_and_publish_on_shard
from .codec import (
    ForeignOrigin,
    Origin,
    ReplayHeaders,
    Unauthenticated,
    UnsafeValue,
    ValueMac,
    decode_value,
    encode_value,
    names_prefix,
)
from .outage import Outage, ShardOutages, report_failure, report_success

log = logging.getLogger("flask_idempotency")

#: Milliseconds a cached copy's expiry is set short of its record's: the time between
#: reading what the record has left and Redis running the ``SET`` (sending the value,
#: the trip to Redis), during which ``PX`` has not started counting. A ``SET`` that took
#: longer than this to answer may have started late: its expiry is set again (C53).
EXPIRY_MARGIN_MS = 50
#: The secret of a cache built without the store's (tools, tests that build a tier by
#: hand): drawn per process, so what it writes is readable by this process alone.
_PROCESS_SECRET = secrets.token_bytes(32)


class RedisCache:
    """:class:`~flask_idempotency.cache.ResponseCache` on Redis (single node, Sentinel, Cluster).

    Only single-key commands, each on a hash-tagged key: the same code runs on a
    cluster, where a record's key lives in its digest's slot. ``replay_headers``: the
    app's ``IDEMPOTENCY_REPLAY_HEADERS`` (the defaults if not given); a cached value
    with any other header is not replayed (C22). ``secret``: the store's secret, or how
    to read it (with the origin, from the store's identity); every value is sealed
    and checked with a MAC under a key derived from it (C60). Without one, a secret
    drawn for this process (tools and tests that build a cache by hand).
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "idem",
        origin: str | Callable[[], str] = "",
        outage: Outage | None = None,
        shards: ShardOutages | None = None,
        replay_headers: Iterable[str] | None = None,
        secret: bytes | Callable[[], bytes] | None = None,
    ) -> None:
        self._client = client
        self.prefix = prefix
        self._origin = Origin(origin)
        self.outage = outage or Outage()
        self._shards = shards
        self._secret = _PROCESS_SECRET if secret is None else secret
        self._mac: ValueMac | None = None
        self._foreign_logged = False
        self._unauthenticated_logged = False
        #: What a cached value's headers may be: what the app stores (C22).
        allowed = Settings.replay_headers if replay_headers is None else replay_headers
        self._replay_headers = ReplayHeaders({*allowed, *BODY_HEADERS})
        self._unsafe_log = ThrottledLog()
        self._reader = _reader_for(client)
        #: The part of every record name before its digest, and the origin as bytes,
        #: made once the origin is known (every read used to format them again).
        self._name_head: str | None = None
        self._origin_bytes: bytes | None = None

    def outage_for(self, key_digest: str | None) -> Outage:
        """The back-off that guards this record's node: on a cluster, one per master, so a
        lost shard does not switch the cache off for the others."""
        if self._shards is None or key_digest is None:
            return self.outage
        return self._shards.for_digest(key_digest, self.outage)

    @property
    def origin(self) -> str:
        return self._origin.get()

    def record_name(self, key_digest: str) -> str:
        """The Redis key of a completed record: the digest only, in a hash tag (R70)."""
        head = self._name_head
        if head is None:
            head = self._name_head = f"{names_prefix(self.prefix, self.origin)}:{{"
        return head + key_digest + "}"

    def __repr__(self) -> str:
        # Never the client (its URL) nor the secret (C61): the names it uses.
        origin = self._origin_bytes.decode("ascii") if self._origin_bytes else "(not read yet)"
        return f"<RedisCache prefix={self.prefix!r} origin={origin}>"

    def _value_mac(self) -> ValueMac:
        """The MAC of this store's values, keyed once per process from the store's secret
        (read with the origin, in the same identity read)."""
        mac = self._mac
        if mac is None:
            secret = self._secret
            mac = self._mac = ValueMac(secret if isinstance(secret, bytes) else secret())
        return mac

    def _encode(self, name: str, record: Completed) -> bytes:
        return encode_value(
            record, origin=self._origin_ascii(), name=name.encode("utf-8"), mac=self._value_mac()
        )

    def _origin_ascii(self) -> bytes:
        """The origin as the first line of every cached value, encoded once."""
        ours = self._origin_bytes
        if ours is None:
            ours = self._origin_bytes = self.origin.encode("ascii")
        return ours

    def _encoded_with_ttl(
        self, name: str, record: Completed, ttl_ms: int, called: float
    ) -> tuple[bytes, int, float]:
        """The cached value under ``name``, then the ``PX`` it may have: ``ttl_ms`` (what
        the record had left at ``called``) less the time encoding took and
        :data:`EXPIRY_MARGIN_MS`, and the moment that was read (C53)."""
        value = self._encode(name, record)
        now = time.monotonic()
        return value, ttl_ms - int((now - called) * 1000) - EXPIRY_MARGIN_MS, now

    def _expire_again_if_late(self, name: str, px: int, read_at: float) -> None:
        """After a ``SET name … PX px`` whose ``px`` was read at ``read_at``: if the answer
        took longer than the margin, the ``SET`` may have run late and the copy would
        outlive its record; set its expiry again from now (a time not positive deletes
        it). Redis runs this one a trip after it is sent too: within the margin again."""
        taken_ms = int((time.monotonic() - read_at) * 1000)
        if taken_ms > EXPIRY_MARGIN_MS:
            self._client.pexpire(name, px - taken_ms)

    def _decode(self, raw: bytes | str, key_digest: str) -> Completed | None:
        if isinstance(raw, str):
            raw = raw.encode("utf-8")
        try:
            return decode_value(
                raw,
                origin=self._origin_ascii(),
                name=self.record_name(key_digest).encode("utf-8"),
                mac=self._value_mac(),
                headers=self._replay_headers,
            )
        except Unauthenticated as exc:
            # Written or altered by something without the store's secret (another service
            # sharing the Redis), moved from another key, or from an earlier release: a
            # miss, so the answer comes from the database and the read-through repairs it.
            if not self._unauthenticated_logged:
                self._unauthenticated_logged = True
                log.warning(
                    "idempotency: a cached record under %s is not this store's (%s); ignored,"
                    " read from the database. A value in Redis is replayed only with the MAC"
                    " this store's secret gives it (C60). (Said once per process.)",
                    key_digest[:16],
                    exc,
                )
            return None
        except ForeignOrigin as exc:
            if not self._foreign_logged:
                self._foreign_logged = True
                log.warning(
                    "idempotency: a cached record under %s was written by another store"
                    " (origin %s, not %s); ignored. Do two services share one Redis prefix?",
                    key_digest[:16],
                    exc,
                    self.origin,
                )
            return None
        except UnsafeValue as exc:
            # Authentic, but not replayable by this app's settings now (a header taken off
            # the allow-list since): a miss, and the read-through repairs it.
            self._unsafe_log.warning(
                "idempotency: a cached record under %s is not safe to replay (%s); ignored,"
                " read from the database",
                key_digest[:16],
                exc,
            )
            return None

    def _read(self, key_digest: str) -> Any:
        # Not a bound method chosen once and kept: that would make the cache a reference
        # cycle, freed only by the garbage collector, sockets and all (C47).
        if self._reader is not None:
            return self._reader.get(self.record_name(key_digest).encode("utf-8"))
        return self._client.get(self.record_name(key_digest))

    def get(self, key_digest: str) -> Completed | None:
        outage = self.outage_for(key_digest)
        if not outage.allows():
            return None
        try:
            raw = self._read(key_digest)
        except Exception as exc:
            self._failed(exc, "get", key_digest)
            return None
        report_success(outage)
        if raw is None:
            return None
        try:
            record = self._decode(raw, key_digest)
        except Exception:
            record = None
        if record is None:
            # Not ours or corrupt: ignore it; the durable read that follows overwrites it.
            log.debug("idempotency: ignored an unreadable cached record %s", key_digest[:16])
        return record

    def probe(self, key_digest: str) -> Completed | None:
        """One read that ignores the back-off: the database is down, and a cached record
        could still answer a replay (15.6). Never raises; does not start an outage."""
        try:
            raw = self._read(key_digest)
        except Exception:
            return None
        self._succeeded(key_digest)
        try:
            return None if raw is None else self._decode(raw, key_digest)
        except Exception:
            return None

    def promote(self, key_digest: str, record: Completed, ttl_ms: int) -> None:
        called = time.monotonic()
        if ttl_ms <= EXPIRY_MARGIN_MS or not self.outage_for(key_digest).allows():
            return
        try:
            name = self.record_name(key_digest)
            value, px, read_at = self._encoded_with_ttl(name, record, ttl_ms, called)
            if px <= 0:
                return
            self._client.set(name, value, px=px)
            self._expire_again_if_late(name, px, read_at)
        except Exception as exc:
            self._failed(exc, "promote", key_digest)
            return
        self._succeeded(key_digest)

    def promote_and_publish(
        self, key_digest: str, record: Completed, ttl_ms: int, notifier: Any, event: str
    ) -> bool:
        """Promote and ask for waiters in one round trip (C23), then publish the wake-up if
        one waits, when ``notifier`` publishes on this cache's Redis; ``False``, having
        done nothing, otherwise. ``ttl_ms`` is what the record has left now (C53).

        On a cluster both go to the master that owns the record's slot, whose shard
        channel the wake-up uses (:func:`.cluster.promote_and_publish_on_shard`)."""
        if (
            type(notifier) is ClusterNotifier
            and self._shards is not None
            and notifier._client is self._client
            and notifier._shards is self._shards
        ):
            return promote_and_publish_on_shard(self, key_digest, record, ttl_ms, notifier, event)
        if not (
            type(notifier) is RedisNotifier
            and self._shards is None
            and notifier._client is self._client
            and notifier.outage is self.outage
        ):
            return False
        called = time.monotonic()
        if not self.outage.allows():
            return True  # skipped, as the two calls would have been
        waiting = notifier.waiting_name(key_digest)
        name = self.record_name(key_digest)
        try:
            value, px, read_at = self._encoded_with_ttl(name, record, ttl_ms, called)
            if self._reader is not None:
                self._reader.set_and_wake(
                    name,
                    value,
                    px,
                    waiting,
                    lambda: (
                        "PUBLISH",
                        notifier.channel,
                        notifier.wakeup_payload(key_digest, event),
                    ),  # built only when a waiter asked for it
                )
            else:
                pipe = self._client.pipeline(transaction=False)
                if px > 0:
                    pipe.set(name, value, px=px)
                pipe.exists(waiting)
                if pipe.execute()[-1]:
                    notifier._publish_now(key_digest, event)
            if px > 0:
                self._expire_again_if_late(name, px, read_at)
        except Exception as exc:
            self._failed(exc, "promote", key_digest)
            return True
        self._succeeded()
        return True

    def discard(self, key_digest: str) -> None:
        if not self.outage_for(key_digest).allows():
            return
        try:
            self._client.delete(self.record_name(key_digest))
        except Exception as exc:
            self._failed(exc, "discard", key_digest)
            return
        self._succeeded(key_digest)

    def ping(self) -> bool:
        """Whether Redis answers now (respects the outage back-off); for health checks."""
        if not self.outage.allows():
            return False
        try:
            self._client.ping()
        except Exception as exc:
            self._failed(exc, "ping", None)
            return False
        self._succeeded()
        return True

    def _failed(self, exc: BaseException, action: str, key_digest: str | None) -> None:
        report_failure(self.outage_for(key_digest), exc, action, key_digest)

    def _succeeded(self, key_digest: str | None = None) -> None:
        report_success(self.outage_for(key_digest))
