"""The Redis tier: a cache of completed records and the cross-process wake-up channel.

Two small parts on one Redis connection: :class:`RedisCache` (completed records)
and :class:`RedisNotifier` (wake-ups), sharing one :class:`Outage`.

Redis is never the source of truth (C22). It holds only completed records, under
``{prefix}:{origin}:{<digest>}``: the digest is SHA-256 of (scope, key), so neither
the raw key nor the scope ever reaches Redis (C30, R69); the origin is a digest of
the store (database URL without password, and table), so two services sharing one
Redis and prefix never see each other's records or wake-ups (C41). Each cached
value also names its origin and is checked on read. A copy expires after the time
the durable record has left by the *database's* clock (``PX``, C42): neither the
app host's clock nor Redis's has to agree with it. Absence and in-progress state
are never cached: a miss always falls through to the durable store. Completion
promotes the record, then publishes ``{"k": <digest>, "e": "done"}`` on
``{prefix}:{origin}:done``.

Losing Redis changes latency, not outcomes (C24). Commands run with short socket
timeouts and no retries; the first failure marks the tier down for a back-off
(1 s doubling to 10 s) during which Redis is skipped entirely: reads go to the
database, waiters poll. One probe at a time tests whether it came back. Each
outage is logged once as a warning, its end once, and ``store_error`` with
``tier="cache"`` is sent once per outage. No method raises.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from flask import current_app, has_app_context, has_request_context, request

from . import process, signals
from .notify.listener import WakeupListener, listener_for
from .records import Completed, StoredResponse

if TYPE_CHECKING:
    from .config import Settings
    from .notify import WakeupHub

log = logging.getLogger("flask_idempotency")

#: Suffix of the wake-up channel: ``{prefix}:done`` carries both ``done`` and ``released``.
CHANNEL_SUFFIX = "done"
#: The key a parked request sets to ask for its record's wake-up (issue 11).
WAITING_SUFFIX = "waiting"
#: A waiting mark outlives its waiter's own wait by this much (a slow re-read, a late start).
_EXPECT_MARGIN = 1.0


class Outage:
    """Tracks whether Redis is usable; after a failure, skips it for a growing back-off.

    Like a circuit breaker: while down, ``allows()`` is false until the back-off
    passes, then exactly one caller is let through as a probe. Its success ends
    the outage; its failure doubles the back-off (up to ``cap``).
    """

    def __init__(
        self, first: float = 1.0, cap: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._first = first
        self._cap = cap
        self.clock = clock
        self._lock = threading.Lock()
        self._down = False
        self._retry_at = 0.0
        self._backoff = first

    @property
    def down(self) -> bool:
        return self._down

    def allows(self) -> bool:
        """May this call use Redis? While down, only one probe per back-off period."""
        if not self._down:
            return True
        with self._lock:
            now = self.clock()
            if not self._down or now >= self._retry_at:
                self._retry_at = now + self._backoff  # the others skip while the probe runs
                return True
            return False

    def failed(self) -> bool:
        """Record a failure; ``True`` if it starts a new outage."""
        with self._lock:
            started = not self._down
            if started:
                self._backoff = self._first
            else:
                self._backoff = min(self._backoff * 2, self._cap)
            self._down = True
            self._retry_at = self.clock() + self._backoff
            return started

    def succeeded(self) -> bool:
        """Record a success; ``True`` if it ends an outage."""
        if not self._down:
            return False
        with self._lock:
            ended = self._down
            self._down = False
            self._backoff = self._first
            return ended


def store_origin(url: Any, table: str) -> str:
    """A short, stable name for one durable store: its database (no password) and table.

    Two apps on the same database and table are the same store and share records, as
    they should (two workers, two hosts); anything else never does (C41).
    """
    from sqlalchemy.engine import make_url

    parsed = make_url(url).set(password=None)
    text = f"{parsed.render_as_string(hide_password=False)}|{table}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class _Origin:
    """The store's name, resolved on first need (``db=``/``engine=`` resolve lazily)."""

    def __init__(self, origin: str | Callable[[], str]) -> None:
        self._fixed = origin if isinstance(origin, str) else None
        self._resolve = None if isinstance(origin, str) else origin

    def get(self) -> str:
        if self._fixed is None:
            assert self._resolve is not None
            self._fixed = self._resolve()
        return self._fixed


def _names_prefix(prefix: str, origin: str) -> str:
    return f"{prefix}:{origin}" if origin else prefix


class ShardOutages:
    """One :class:`Outage` per cluster master, found from the client's slot map (no I/O)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._by_node: dict[str, Outage] = {}
        self._refreshed = 0.0
        self._refresh_lock = threading.Lock()

    def for_digest(self, key_digest: str, fallback: Outage) -> Outage:
        try:
            outage = self._outage_of(key_digest)
            if outage.down and self._refresh_slot_map():
                # A dead master's replica may have taken its slots: while that master is
                # in its back-off no command reaches it, so nothing else would ever tell
                # the client the slot map changed and its shard would stay dark.
                outage = self._outage_of(key_digest)
        except Exception:
            return fallback  # no slot map yet (the cluster is unreachable): the tier's own
        return outage

    def _outage_of(self, key_digest: str) -> Outage:
        name = str(self._client.get_node_from_key(f"{{{key_digest}}}").name)
        outage = self._by_node.get(name)
        if outage is None:
            outage = self._by_node.setdefault(name, Outage())
        return outage

    def _refresh_slot_map(self) -> bool:
        """Re-read the slot map at most once per topology check interval per process."""
        from .redis_topology import TOPOLOGY_CHECK_INTERVAL

        now = time.monotonic()
        if now - self._refreshed < TOPOLOGY_CHECK_INTERVAL:
            return False
        with self._refresh_lock:
            if now - self._refreshed < TOPOLOGY_CHECK_INTERVAL:
                return False
            self._refreshed = now
        self._client.nodes_manager.initialize()
        return True


# -- the cached value ----------------------------------------------------------------------
#
# ``{origin}\n2\n{fingerprint}\n{expires_at_ms}\n{status}\n{0|1 body omitted}\n{headers as
# compact JSON}\n{body in base64}``: one split, no per-field objects, about a quarter of the
# JSON form's decoding CPU (issue 11). All ASCII, so a client that decodes responses
# reads it too. A value in the JSON form (``{"v":1,…}``) of earlier releases still reads.

_VALUE_V2 = b"2"
#: Decoded header lists by their JSON text: nearly every replay of a route has the same.
_HEADERS_SEEN: dict[bytes, tuple[tuple[str, str], ...]] = {}
_HEADERS_SEEN_MAX = 256


def encode_value(record: Completed) -> bytes:
    """A completed record as the cache stores it (after the origin line)."""
    response = record.response
    return b"\n".join(
        (
            _VALUE_V2,
            record.fingerprint.encode("ascii"),
            b"%d" % record.expires_at_ms,
            b"%d" % response.status,
            b"1" if response.body_omitted else b"0",
            response.headers_json().encode("ascii"),
            base64.b64encode(response.body),
        )
    )


def decode_value(raw: bytes) -> Completed | None:
    """The record in a cached value, either form; ``None`` for anything else."""
    if not raw.startswith(b"2\n"):
        return Completed.from_json(raw)  # written by an earlier release
    try:
        _, fingerprint, expires, status, omitted, headers, body = raw.split(b"\n")
        if omitted not in (b"0", b"1"):
            return None
        return Completed(
            fingerprint.decode("ascii"),
            int(expires),
            StoredResponse(
                int(status),
                _headers(headers),
                base64.b64decode(body, validate=True),
                omitted == b"1",
            ),
        )
    except (ValueError, TypeError, RecursionError):
        return None


def _headers(text: bytes) -> tuple[tuple[str, str], ...]:
    headers = _HEADERS_SEEN.get(text)
    if headers is None:
        pairs = json.loads(text)
        if not isinstance(pairs, list):
            raise ValueError("headers are a list of pairs")
        headers = tuple((str(name), str(value)) for name, value in pairs)
        if len(_HEADERS_SEEN) >= _HEADERS_SEEN_MAX:
            _HEADERS_SEEN.clear()
        _HEADERS_SEEN[text] = headers
    return headers


class _Reader:
    """``GET`` on a plain single-node client, without redis-py's per-command machinery.

    A replay from Redis is one ``GET``; through ``client.get`` about half its CPU
    is redis-py's checkout and return of a pooled connection (a lock, a readiness
    poll, metrics hooks) and its retry and observability wrappers (issue 11). This
    keeps the connections it has used in a list of its own (``pop``/``append`` are
    atomic) and sends a pre-packed command on one. Nothing is given up: the
    connections are the pool's (its ``disconnect()`` closes them too, in use or
    not), they keep the client's socket timeouts (C24), a broken connection is
    retried once as the client's ``Retry`` would (a socket left over from before a
    Redis restart), a timeout never is, and after any error the connection is
    closed before it is reused, so no half-read reply is ever read by another
    command; a connection told to reconnect by a maintenance notice is closed, as
    the client would. At most ``_KEPT`` connections (a quarter of the pool's limit when that
    is lower) are kept aside, so the client's other commands are never starved of
    its pool; one used beyond them goes back to the pool. A forked child drops
    the parent's connections. One reader per pool, shared by every app on it, and
    gone with it; the connections it keeps are closed when its client is collected.
    """

    _KEPT = 16

    def __init__(self, pool: Any, *, retry_broken: bool = True) -> None:
        self._pool = pool
        #: Resend once on a broken connection; a cluster node's reader does not: its caller
        #: re-routes through the cluster client, which refreshes the slot map and retries.
        self._retry_broken = retry_broken
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._kept = max(1, min(self._KEPT, int(pool.max_connections) // 4))
        self._checkout_args = _checkout_args(pool)
        #: Whether connections can be told to reconnect by a maintenance notice (redis-py 8).
        self._notices = hasattr(pool.connection_class, "should_reconnect")

    def get(self, name: bytes) -> Any:
        return self._run([b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(name), name)], 1)[0]

    def set_and_wake(
        self, name: str, value: bytes, ttl_ms: int, waiting: str, publish: tuple[Any, ...]
    ) -> None:
        """``SET name value PX ttl_ms`` (skipped when ``ttl_ms <= 0``) and ``EXISTS waiting``
        sent together, both replies read: the completion's one round trip (C23); then
        ``publish`` (the wake-up command), only if a waiter has asked for it."""
        commands: list[tuple[Any, ...]] = [("EXISTS", waiting)]
        if ttl_ms > 0:
            commands.insert(0, ("SET", name, value, "PX", ttl_ms))
        if self._run(commands, len(commands))[-1]:
            self._run([publish], 1)

    def run_together(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in one write and read every reply; an error reply is returned
        as its exception, not raised, so the caller sees what each command did (a
        ``MOVED`` on one need not mean the other failed)."""
        return self._run(commands, len(commands), errors_as_values=True)

    def _run(
        self, commands: list[Any], replies: int, *, errors_as_values: bool = False
    ) -> list[Any]:
        """Send ``commands`` (pre-packed bytes, or argument tuples) and read ``replies``."""
        if self._pid != os.getpid():
            self._idle, self._pid = [], os.getpid()  # the parent's sockets: never touched
        idle = self._idle
        try:
            conn = idle.pop()
        except IndexError:
            conn = self._pool.get_connection(*self._checkout_args)
        packed = commands if isinstance(commands[0], bytes) else conn.pack_commands(commands)
        try:
            try:
                conn.send_packed_command(packed)
                values = _read_replies(conn, replies, errors_as_values)
            except _connection_error():
                if not self._retry_broken:
                    raise
                # redis-py has closed it; one more try on a new socket, as its Retry does
                conn.send_packed_command(packed)
                values = _read_replies(conn, replies, errors_as_values)
        except BaseException:
            conn.disconnect()  # an error reply may leave the next one unread: never reuse
            self._put_back(conn)
            raise
        self._put_back(conn)
        return values

    def close_kept(self) -> None:
        """Close the connections kept aside: their client is gone (C47).

        Called when the client is collected, before anything it holds is finalized,
        so no socket is ever left for the garbage collector to find open.
        """
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return
            try:
                conn.disconnect()
            except Exception:  # pragma: no cover - closing a socket at collection time
                pass

    def _put_back(self, conn: Any) -> None:
        if self._notices and conn.should_reconnect():  # a maintenance notice
            conn.disconnect()
        if len(self._idle) < self._kept:
            self._idle.append(conn)
        else:
            self._pool.release(conn)


def _read_replies(conn: Any, count: int, errors_as_values: bool) -> list[Any]:
    if not errors_as_values:
        return [conn.read_response() for _ in range(count)]
    from redis.exceptions import ResponseError

    values: list[Any] = []
    for _ in range(count):
        try:
            values.append(conn.read_response())
        except ResponseError as exc:  # the whole error reply was read: the stream is aligned
            values.append(exc)
    return values


def _checkout_args(pool: Any) -> tuple[str, ...]:
    """What ``pool.get_connection`` needs: redis-py before 6 requires a command name,
    later releases take none (and warn when given one)."""
    try:
        parameter = inspect.signature(pool.get_connection).parameters.get("command_name")
    except (TypeError, ValueError):  # pragma: no cover - a builtin or odd pool
        return ()
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        return ("GET",)
    return ()


#: Where a pool's reader lives: on the pool itself, so the two go together. (A weak-keyed
#: map would keep every pool for ever: a kept connection refers back to its pool.)
_READER_ATTR = "_flask_idempotency_reader"
#: Marks a client whose collection closes the connections its pool's reader keeps.
_FINALIZER_ATTR = "_flask_idempotency_finalizer"


def _connection_error() -> type[BaseException]:
    import redis

    return redis.ConnectionError


def _reader_for(client: Any, *, retry_broken: bool = True) -> _Reader | None:
    """The fast ``GET`` for ``client``, or ``None`` when it is not a plain one.

    Plain: a ``redis.Redis`` on a ``redis.ConnectionPool`` of TCP, TLS or Unix
    socket connections, with no client-side cache and no pinned connection.
    Anything else (Sentinel, Cluster, fakes, wrappers) uses ``client.get``.
    ``retry_broken`` applies to the reader made now (one per pool).
    """
    try:
        import redis
        from redis.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection
    except ImportError:  # pragma: no cover - the tier is only built with redis installed
        return None
    if type(client) is not redis.Redis:
        return None
    pool = client.connection_pool
    if (
        type(pool) is not ConnectionPool
        or pool.connection_class
        not in (redis.Connection, SSLConnection, UnixDomainSocketConnection)
        or getattr(client, "connection", None) is not None
        or getattr(pool, "cache", None) is not None
        or not isinstance(getattr(pool, "max_connections", None), int)
    ):
        return None
    attributes = getattr(pool, "__dict__", None)
    if attributes is None:
        return None
    reader: _Reader | None = attributes.get(_READER_ATTR)
    if reader is None:
        reader = attributes.setdefault(_READER_ATTR, _Reader(pool, retry_broken=retry_broken))
    if not client.__dict__.get(_FINALIZER_ATTR):  # once per client, however many apps
        client.__dict__[_FINALIZER_ATTR] = True
        weakref.finalize(client, reader.close_kept)
    return reader


def cluster_node_reader(node_client: Any) -> _Reader | None:
    """The fast path on one cluster node's client (see :class:`~.redis_topology.DirectCluster`):
    made once per node pool, then one attribute look-up per command. It never resends
    on a broken connection; the cluster client does, after refreshing its slot map."""
    reader: _Reader | None = getattr(
        getattr(node_client, "connection_pool", None), _READER_ATTR, None
    )
    if reader is None:
        reader = _reader_for(node_client, retry_broken=False)
    return reader


def direct_cluster(cluster: Any) -> Any:
    """``cluster`` with its hot commands sent straight to the slot owner, pre-packed."""
    from .redis_topology import DirectCluster

    return DirectCluster(cluster, reader_for=cluster_node_reader)


class RedisCache:
    """:class:`~flask_idempotency.cache.ResponseCache` on Redis (single node, Sentinel, Cluster).

    Only single-key commands, each on a hash-tagged key: the same code runs on a
    cluster, where a record's key lives in its digest's slot.
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "idem",
        origin: str | Callable[[], str] = "",
        outage: Outage | None = None,
        shards: ShardOutages | None = None,
    ) -> None:
        self._client = client
        self.prefix = prefix
        self._origin = _Origin(origin)
        self.outage = outage or Outage()
        self._shards = shards
        self._foreign_logged = False
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
            head = self._name_head = f"{_names_prefix(self.prefix, self.origin)}:{{"
        return head + key_digest + "}"

    def _encode(self, record: Completed) -> bytes:
        return self.origin.encode("ascii") + b"\n" + encode_value(record)

    def _decode(self, raw: bytes | str, key_digest: str) -> Completed | None:
        if isinstance(raw, str):
            raw = raw.encode("utf-8")
        origin, sep, body = raw.partition(b"\n")
        if not sep:
            return None  # an older format, or not ours: a miss
        ours = self._origin_bytes
        if ours is None:
            ours = self._origin_bytes = self.origin.encode("ascii")
        if origin != ours:
            if not self._foreign_logged:
                self._foreign_logged = True
                log.warning(
                    "idempotency: a cached record under %s was written by another store"
                    " (origin %s, not %s); ignored. Do two services share one Redis prefix?",
                    key_digest[:16],
                    origin[:16].decode("ascii", "replace"),
                    self.origin,
                )
            return None
        return decode_value(body)

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
        _report_success(outage)
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
        if ttl_ms <= 0 or not self.outage_for(key_digest).allows():
            return
        try:
            self._client.set(self.record_name(key_digest), self._encode(record), px=ttl_ms)
        except Exception as exc:
            self._failed(exc, "promote", key_digest)
            return
        self._succeeded(key_digest)

    def promote_and_publish(
        self, key_digest: str, record: Completed, ttl_ms: int, notifier: Any, event: str
    ) -> bool:
        """Promote and ask for waiters in one round trip (C23), then publish the wake-up if
        one waits, when ``notifier`` publishes on this cache's Redis; ``False``, having
        done nothing, otherwise.

        On a cluster both go to the master that owns the record's slot, whose shard
        channel the wake-up uses (:meth:`_promote_and_publish_on_shard`)."""
        if (
            type(notifier) is ClusterNotifier
            and self._shards is not None
            and notifier._client is self._client
            and notifier._shards is self._shards
        ):
            return self._promote_and_publish_on_shard(key_digest, record, ttl_ms, notifier, event)
        if not (
            type(notifier) is RedisNotifier
            and self._shards is None
            and notifier._client is self._client
            and notifier.outage is self.outage
        ):
            return False
        if not self.outage.allows():
            return True  # skipped, as the two calls would have been
        waiting = notifier.waiting_name(key_digest)
        try:
            if self._reader is not None:
                self._reader.set_and_wake(
                    self.record_name(key_digest),
                    self._encode(record),
                    ttl_ms,
                    waiting,
                    ("PUBLISH", notifier.channel, notifier.wakeup_payload(key_digest, event)),
                )
            else:
                pipe = self._client.pipeline(transaction=False)
                if ttl_ms > 0:
                    pipe.set(self.record_name(key_digest), self._encode(record), px=ttl_ms)
                pipe.exists(waiting)
                if pipe.execute()[-1]:
                    notifier._publish_now(key_digest, event)
        except Exception as exc:
            self._failed(exc, "promote", key_digest)
            return True
        self._succeeded()
        return True

    def _promote_and_publish_on_shard(
        self, key_digest: str, record: Completed, ttl_ms: int, notifier: ClusterNotifier, event: str
    ) -> bool:
        """The record's ``SET`` and the check for a waiter in one write on the slot owner's
        connection (the waiting key shares the record's hash tag), then, if a waiter
        asked, its shard's ``SPUBLISH`` on the same connection: the shard channel is
        tagged onto the same master. ``False`` (the commands follow one by one, each
        routed and checked on its own) when the shard is in its back-off, the slot map
        no longer puts the channel on the record's master, or a reply says the slot
        moved (``DirectCluster.set_and_wake``); whatever went through already is sent
        again in the same order (C23), which is harmless.
        """
        outage = self.outage_for(key_digest)
        if ttl_ms <= 0 or outage.down:
            return False
        try:
            together = self._client.set_and_wake
            route = notifier.route(key_digest)
        except Exception:
            return False  # no slot map yet: the two commands report the outage
        if route is None:
            return False
        try:
            done = together(
                self.record_name(key_digest),
                self._encode(record),
                ttl_ms,
                notifier.waiting_name(key_digest),
                *route,
                notifier.wakeup_payload(key_digest, event),
            )
        except Exception as exc:
            notifier.forget_tags()
            _report_failure(outage, exc, "promote", key_digest)
            return True
        if done:
            _report_success(outage)
        return bool(done)

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
        _report_failure(self.outage_for(key_digest), exc, action, key_digest)

    def _succeeded(self, key_digest: str | None = None) -> None:
        _report_success(self.outage_for(key_digest))


class RedisNotifier:
    """:class:`~flask_idempotency.wakeup.CrossProcessChannel` on Redis pub/sub."""

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
        self._origin = _Origin(origin)
        self.outage = outage or Outage()
        self._connect = listener_connect or (lambda: client)
        # Keyed by the client object itself, not id(client): a later client can never
        # reuse its id and be handed this listener. The registry forgets the listener
        # (and so the client) when the last app using it is gone (9.8).
        self._listener_base = listener_key or ("client", client)
        self._first_wait = first_wait

    @property
    def channel(self) -> str:
        return f"{_names_prefix(self.prefix, self._origin.get())}:{CHANNEL_SUFFIX}"

    def waiting_name(self, key_digest: str) -> str:
        """The key a waiter sets to be woken for ``key_digest``: in the record's hash tag,
        so on a cluster it lives beside the record (one slot, one round trip)."""
        return f"{_names_prefix(self.prefix, self._origin.get())}:{WAITING_SUFFIX}:{{{key_digest}}}"

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
        whoever settles it within that time publishes the wake-up (see :mod:`.wakeup`)."""
        outage = self._outage_for(key_digest)
        if not outage.allows():
            return False
        try:
            self._client.set(
                self.waiting_name(key_digest),
                b"1",
                px=max(1, int((seconds + _EXPECT_MARGIN) * 1000)),
            )
        except Exception as exc:
            _report_failure(outage, exc, "expect", key_digest)
            return False
        _report_success(outage)
        return True

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
            _report_failure(outage, exc, "publish", key_digest)
            return
        _report_success(outage)

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


class ClusterNotifier(RedisNotifier):
    """Wake-ups on a Redis Cluster: sharded pub/sub on Redis 7+, plain ``PUBLISH`` before.

    A record's ``done``/``released`` goes to the channel of the master holding the
    record's slot (see :mod:`~flask_idempotency.redis_topology`).
    """

    def __init__(
        self,
        client: Any,
        *,
        subscriber: Callable[[], Any],
        shards: ShardOutages | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, **kwargs)
        self._subscriber = subscriber
        self._shards = shards
        self._sharded: bool | None = None
        self._tags: dict[str, str] = {}
        self._tags_at = 0.0

    def shard_channel(self, tag: str) -> str:
        return f"{self.channel}:{{{tag}}}"

    def _is_sharded(self) -> bool:
        if self._sharded is None:
            from .redis_topology import supports_sharded_pubsub

            self._sharded = supports_sharded_pubsub(self._client)
        return self._sharded

    def _tag_for(self, key_digest: str) -> str | None:
        from .redis_topology import (
            TOPOLOGY_CHECK_INTERVAL,
            shard_tag_for_key,
            shard_tags,
            tags_still_valid,
        )

        now = time.monotonic()
        if not self._tags:
            self._tags, self._tags_at = shard_tags(self._client), now
        elif now - self._tags_at > TOPOLOGY_CHECK_INTERVAL:
            if not tags_still_valid(self._client, self._tags):  # cheap; a rescan only if not
                self._tags = shard_tags(self._client)
            self._tags_at = now
        tag = shard_tag_for_key(self._client, f"{{{key_digest}}}", self._tags)
        if tag is None:
            # The client's slot map moved on (a replica promoted) since the tags were read.
            self._tags, self._tags_at = shard_tags(self._client), now
            tag = shard_tag_for_key(self._client, f"{{{key_digest}}}", self._tags)
        return tag

    def route(self, key_digest: str) -> tuple[str, str] | None:
        """The command and channel of this record's wake-up: ``SPUBLISH`` on the channel of
        the master holding its slot (``None`` if none does), or ``PUBLISH`` before Redis 7."""
        if not self._is_sharded():
            return ("PUBLISH", self.channel)
        tag = self._tag_for(key_digest)
        return None if tag is None else ("SPUBLISH", self.shard_channel(tag))

    def forget_tags(self) -> None:
        """A failover or resharding: look at the slot map again before the next wake-up."""
        self._tags = {}

    def _outage_for(self, key_digest: str) -> Outage:
        if self._shards is None:
            return self.outage
        return self._shards.for_digest(key_digest, self.outage)

    def _publish_now(self, key_digest: str, event: str) -> None:
        route = self.route(key_digest)
        if route is None:
            raise RuntimeError("no master owns this record's slot")
        command, channel = route
        payload = self.wakeup_payload(key_digest, event)
        if command == "SPUBLISH":
            self._client.spublish(channel, payload)
        else:
            self._client.publish(channel, payload)

    def _publish_failed(self) -> None:
        self.forget_tags()

    @property
    def listener(self) -> WakeupListener:
        channel = self.channel
        first_wait = self._first_wait
        if self._is_sharded():
            from .redis_topology import ShardedSubscriber

            subscriber = self._subscriber
            shard_channel = self.shard_channel

            def connect() -> Any:
                return ShardedSubscriber(subscriber(), shard_channel)

        else:
            connect = self._subscriber
        return listener_for(
            (self._listener_base, channel),
            lambda: WakeupListener(connect, channel, first_wait=first_wait),
        )


class RedisTier:
    """A cache and a notifier on one Redis client: the pair the extension builds."""

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "idem",
        origin: str | Callable[[], str] = "",
        listener_key: Hashable | None = None,
        listener_connect: Callable[[], Any] | None = None,
        first_wait: float = 0.5,
        cluster: bool = False,
    ) -> None:
        self.outage = Outage()
        shards = ShardOutages(client) if cluster else None
        self.cache = RedisCache(
            client, prefix=prefix, origin=origin, outage=self.outage, shards=shards
        )
        self.notifier: RedisNotifier
        if cluster:
            self.notifier = ClusterNotifier(
                client,
                subscriber=listener_connect or (lambda: client),
                shards=shards,
                prefix=prefix,
                origin=origin,
                outage=self.outage,
                listener_key=listener_key,
                first_wait=first_wait,
            )
        else:
            self.notifier = RedisNotifier(
                client,
                prefix=prefix,
                origin=origin,
                outage=self.outage,
                listener_key=listener_key,
                listener_connect=listener_connect,
                first_wait=first_wait,
            )

    # The pair's calls, for tools and tests that hold a tier rather than an app.
    def get(self, key_digest: str) -> Completed | None:
        return self.cache.get(key_digest)

    def promote(self, key_digest: str, record: Completed, ttl_ms: int) -> None:
        self.cache.promote(key_digest, record, ttl_ms)

    def discard(self, key_digest: str) -> None:
        self.cache.discard(key_digest)

    def record_name(self, key_digest: str) -> str:
        return self.cache.record_name(key_digest)

    def ping(self) -> bool:
        return self.cache.ping()

    @property
    def channel(self) -> str:
        return self.notifier.channel

    @property
    def listener(self) -> WakeupListener:
        return self.notifier.listener

    def ensure_listening(self, hub: WakeupHub) -> bool:
        return self.notifier.ensure_listening(hub)

    def expect(self, key_digest: str, seconds: float) -> bool:
        return self.notifier.expect(key_digest, seconds)

    def publish(self, key_digest: str, event: str) -> None:
        self.notifier.publish(key_digest, event)

    def close(self) -> None:
        self.notifier.close()

    @classmethod
    def from_settings(
        cls, settings: Settings, client: Any = None, origin: str | Callable[[], str] = ""
    ) -> RedisTier:
        """The tier for an app: from a given ``client`` or the URL, never waiting on Redis
        longer than ``IDEMPOTENCY_REDIS_SOCKET_TIMEOUT`` (C24)."""
        from . import redis_topology as topology

        timeout = settings.redis_socket_timeout
        first_wait = min(1.0, max(0.25, 5 * timeout))
        common: dict[str, Any] = {
            "prefix": settings.redis_prefix,
            "origin": origin,
            "first_wait": first_wait,
        }
        if client is not None:
            if topology.is_cluster_client(client):
                bounded = direct_cluster(
                    topology.bounded_cluster(
                        client, socket_timeout=timeout, connect_timeout=timeout
                    )
                )
                subscriber: list[Any] = []

                def cluster_subscriber() -> Any:
                    if not subscriber:
                        subscriber.append(
                            topology.bounded_cluster(
                                client, socket_timeout=10.0, connect_timeout=max(1.0, timeout)
                            )
                        )
                    return subscriber[0]

                return cls(
                    bounded,
                    listener_key=("client", client),
                    listener_connect=cluster_subscriber,
                    cluster=True,
                    **common,
                )
            # Commands get the bounded client; the listener keeps the given one (its
            # reads are bounded by its own ticks and heartbeat, in its own thread).
            bounded = bounded_client(client, socket_timeout=timeout, connect_timeout=timeout)
            listener_connect: Callable[[], Any] = lambda: client  # noqa: E731
            pool = topology.sentinel_pool(client)
            if pool is not None:  # Sentinel.master_for(): follow failovers as the URL form does
                bounded = topology.following_sentinel(bounded)
                given = topology.SentinelSubscriber(topology.GivenSentinelMaster(pool), client)
                listener_connect = lambda: given  # noqa: E731
            return cls(
                bounded,
                listener_key=("client", client),
                listener_connect=listener_connect,
                **common,
            )
        url = settings.redis_url
        assert url, "RedisTier needs IDEMPOTENCY_REDIS_URL or a client"
        kind = topology.parse_topology(url)
        slow = max(1.0, timeout)
        if kind == "cluster":
            # RedisCluster reads the slot map when built: not at init_app, on first use.
            build_commands: Callable[[], Any] = lambda: _Lazy(  # noqa: E731
                lambda: direct_cluster(
                    topology.cluster_from_url(url, socket_timeout=timeout, connect_timeout=timeout)
                )
            )
            build_subscriber: Callable[[], Any] = lambda: topology.cluster_from_url(  # noqa: E731
                url, socket_timeout=10.0, connect_timeout=slow
            )
        elif kind == "sentinel":

            def master() -> topology.SentinelMaster:
                return process.shared(
                    ("redis-sentinel", url, timeout),
                    lambda: topology.SentinelMaster(
                        url, socket_timeout=timeout, connect_timeout=timeout
                    ),
                )

            build_commands = lambda: master().command_client(  # noqa: E731
                socket_timeout=timeout, connect_timeout=timeout
            )
            build_subscriber = lambda: topology.SentinelSubscriber(  # noqa: E731
                master(), master().client(socket_timeout=10.0, connect_timeout=slow)
            )
        else:
            build_commands = lambda: _client_from_url(  # noqa: E731
                url, socket_timeout=timeout, connect_timeout=timeout
            )
            build_subscriber = lambda: _client_from_url(  # noqa: E731
                url, socket_timeout=10.0, connect_timeout=slow
            )
        # One command client per URL and timeout in this process, shared by its apps (9.8).
        command_client = process.shared(("redis-commands", url, timeout), build_commands)

        def subscriber_client() -> Any:
            # Built in the listener thread on first need; a blocking read must not be
            # cut short by the command timeout, so it gets its own, longer one.
            return process.shared(("redis-subscriber", url), build_subscriber)

        return cls(
            command_client,
            listener_key=("url", url),
            listener_connect=subscriber_client,
            cluster=kind == "cluster",
            **common,
        )


class _Lazy:
    """A client built on first use; a failure to build is a failed command (C24)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._slot: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(process.once(self._slot, self._build), name)


# -- outage bookkeeping (shared by the cache and the notifier) ------------------------


def _report_failure(
    outage: Outage, exc: BaseException, action: str, key_digest: str | None
) -> None:
    if not outage.failed():
        return
    log.warning(
        "idempotency: Redis unavailable (%s: %s); serving from the database and"
        " polling for wake-ups until it is back",
        type(exc).__name__,
        exc,
    )
    if signals.store_error.receivers:
        signals.send(
            signals.store_error,
            current_app._get_current_object() if has_app_context() else None,  # type: ignore[attr-defined]
            key_digest=key_digest,
            scope=None,
            route=request.endpoint if has_request_context() else None,
            duration=0.0,
            tier="cache",
            error=f"{type(exc).__name__}: {exc}",
            action=action,
        )


def _report_success(outage: Outage) -> None:
    if outage.succeeded():
        log.info("idempotency: Redis is reachable again; cache and wake-ups resumed")


#: Connection settings that belong to the given pool and must not be copied to ours.
_NOT_COPIED = frozenset(
    {
        "socket_timeout",
        "socket_connect_timeout",
        "retry",
        "retry_on_timeout",
        "retry_on_error",
        "maint_notifications_pool_handler",
    }
)


def bounded_client(client: Any, *, socket_timeout: float, connect_timeout: float) -> Any:
    """A client on the same server as ``client`` whose every command gives up after
    ``socket_timeout`` (C24, 9.2), built from the given client's pool settings.

    A client whose settings cannot be read is refused at start-up: a Redis that
    accepts connections and never answers would otherwise hang every request.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if pool is None or not isinstance(kwargs, dict):
        raise ValueError(
            "Idempotency(redis=...) needs a redis-py client (redis.Redis or"
            f" redis.RedisCluster); got {type(client).__name__}."
        )
    settings = {
        name: value
        for name, value in kwargs.items()
        if name not in _NOT_COPIED and not name.startswith("orig_")
    }
    settings.update(
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )
    pool_class = type(pool)
    extra: dict[str, Any] = {}
    if hasattr(pool, "service_name") and hasattr(pool, "sentinel_manager"):
        extra = {"service_name": pool.service_name, "sentinel_manager": pool.sentinel_manager}
    try:
        new_pool = pool_class(
            connection_class=pool.connection_class,
            max_connections=getattr(pool, "max_connections", None) or 2**31,
            **extra,
            **settings,
        )
    except TypeError as exc:
        raise ValueError(
            f"Idempotency(redis=...): cannot derive a client with bounded timeouts from"
            f" {type(client).__name__} ({exc}); pass IDEMPOTENCY_REDIS_URL instead."
        ) from None
    derived = redis.Redis(connection_pool=new_pool)
    derived.auto_close_connection_pool = True  # closing (or collecting) it closes its sockets
    return derived


def _client_from_url(url: str, *, socket_timeout: float, connect_timeout: float) -> Any:
    """A client that fails fast: short timeouts, and the back-off is ours.

    One immediate retry on a broken connection only: after a Redis restart the pool
    still holds sockets to the old server, and the first command on each would
    otherwise count as a new outage. A server that is really down refuses the
    retry at once; a timeout is never retried.
    """
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise RuntimeError(
            "IDEMPOTENCY_REDIS_URL needs the redis package: pip install 'Flask-Idempotency[redis]'"
        ) from None

    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        socket_keepalive=True,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        retry_on_timeout=False,
    )
