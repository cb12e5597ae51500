"""Hand-written Redis wire code: every place the package goes below redis-py's client API.

Why: a replay from Redis is one ``GET`` and a completion one ``SET`` + ``EXISTS``;
through redis-py's per-command machinery about half their CPU is the checkout and
return of a pooled connection and the retry and observability wrappers (issue 11),
and on a Cluster ``RedisCluster.execute_command`` re-derives the slot owner on every
call (~30 us more). :class:`_Reader` sends pre-packed commands on connections it keeps
aside from the client's own pool; :class:`DirectCluster` sends the hot single-key
commands straight to the client (and the reader) of the node that owns the slot.
The rest of the package uses redis-py's ordinary client API.

redis-py internals touched here (check each on a redis-py upgrade; the differential
tests are ``tests/test_wire_differential.py``: the pre-packed ``GET`` against
``Connection.pack_command`` and the reader's replies against redis-py's client, RESP2
and RESP3, for fuzzed keys, values and commands; and ``tests/test_redis_reader.py`` and
``tests/test_topologies.py``):

- ``ConnectionPool.get_connection()``: before redis-py 6 it requires a command name,
  later releases take none and warn when given one (:func:`_checkout_args` reads its
  signature); ``ConnectionPool.release()``, ``.connection_class``, ``.max_connections``,
  ``.cache`` (client-side caching), and the pool's ``__dict__`` (the reader lives there).
- ``Connection.pack_commands()``, ``.send_packed_command()``, ``.read_response()``,
  ``.disconnect()``, and ``Connection.should_reconnect()`` (maintenance notifications,
  redis-py 8; looked up with ``hasattr``).
- ``Redis.connection`` (a pinned single connection) and the exact classes
  ``redis.Redis``, ``redis.connection.ConnectionPool``, ``Connection``,
  ``SSLConnection``, ``UnixDomainSocketConnection``.
- ``RedisCluster.get_node_from_key()``, ``.get_redis_connection()``, ``ClusterNode.name``.
- The exceptions ``ResponseError``, ``MovedError``, ``AskError``, ``TryAgainError``,
  ``ClusterDownError`` and ``ConnectionError`` (what is retried, what is re-routed).

Fallbacks, checked when a client is first used, not at import (nothing here imports
redis at import time): a client that is not a plain ``redis.Redis`` on a plain
``ConnectionPool`` of TCP, TLS or Unix connections (Sentinel, Cluster, fakes,
wrappers, a client-side cache, a pinned connection), or no redis package, gets no
reader (:func:`_reader_for` returns ``None``) and goes through ``client.get``; a
cluster node without one goes through its own redis-py client.

Tested with redis-py 5.0.0 (the oldest supported set, ``nox -s oldest``) and 8.1.0.

Outside this module the package touches a few more redis-py internals, none of them
wire code: ``PubSub.connection._sock`` (the listener sleeps on the socket,
:mod:`~flask_idempotency.notify.listener`, :mod:`~flask_idempotency.notify.cluster`);
``RedisCluster.nodes_manager`` (``slots_cache``, ``initialize()``,
``connection_kwargs``, ``startup_nodes``: the shard channels, the per-shard outages,
:func:`~flask_idempotency.redis_clients.bounded_cluster`); ``ConnectionPool.connection_kwargs``
and a ``SentinelConnectionPool``'s ``service_name``, ``sentinel_manager`` and
``get_master_address()`` (:mod:`~flask_idempotency.redis_clients`).
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol


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
        #: How the client encodes a name (its ``Encoder``'s settings): the pre-packed
        #: commands write names as its own commands would.
        kwargs = getattr(pool, "connection_kwargs", {})
        self._encoding = (kwargs.get("encoding", "utf-8"), kwargs.get("encoding_errors", "strict"))

    def get(self, name: bytes) -> Any:
        return self._run([b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(name), name)], 1)[0]

    def set_and_wake(
        self,
        name: str,
        value: bytes,
        ttl_ms: int,
        waiting: str,
        publish: Callable[[], tuple[Any, ...]],
    ) -> None:
        """``SET name value PX ttl_ms`` (skipped when ``ttl_ms <= 0``) and ``EXISTS waiting``
        sent together, both replies read: the completion's one round trip (C23); then the
        wake-up command ``publish()`` builds, only if a waiter has asked for it (the
        usual completion has none, and builds none)."""
        packed = _set_and_exists(name, value, ttl_ms, waiting, self._encoding)
        if self._run(packed, 2 if ttl_ms > 0 else 1)[-1]:
            self._run([publish()], 1)

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


#: A value longer than this is sent as a piece of its own, not copied into the command's
#: text (redis-py's ``pack_commands`` cuts at the same size).
_COPIED_VALUE_BYTES = 6000


def _set_and_exists(
    name: str, value: bytes, ttl_ms: int, waiting: str, encoding: tuple[str, str]
) -> list[bytes]:
    """``SET name value PX ttl_ms`` (none when ``ttl_ms <= 0``) and ``EXISTS waiting``,
    packed as redis-py's ``pack_commands`` packs them, the same bytes (a differential
    test checks it), without its per-argument encoding: a completion's commands are
    always these two, with text names (in the client's ``encoding``), a bytes value and
    a whole number."""
    key = waiting.encode(*encoding)
    exists = b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%b\r\n" % (len(key), key)
    if ttl_ms <= 0:
        return [exists]
    record = name.encode(*encoding)
    px = b"%d" % ttl_ms
    head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(record), record, len(value))
    tail = b"\r\n$2\r\nPX\r\n$%d\r\n%b\r\n" % (len(px), px) + exists
    if len(value) > _COPIED_VALUE_BYTES:
        return [head, value, tail]
    return [head + value + tail]


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
    """The fast path on one cluster node's client (see :class:`DirectCluster`):
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
    return DirectCluster(cluster, reader_for=cluster_node_reader)


class _PrePacked(Protocol):
    """What :class:`DirectCluster` needs from a node's fast path (:class:`_Reader`)."""

    def get(self, name: bytes) -> Any: ...

    def run_together(self, commands: list[tuple[Any, ...]]) -> list[Any]: ...


class DirectCluster:
    """A ``RedisCluster`` whose hot single-key commands (the cache's ``GET``/``SET``/``DEL``,
    the wake-up's ``EXISTS`` and ``SPUBLISH``) go straight to the client of the node that owns the
    key's slot in the cached slot map.

    ``RedisCluster.execute_command`` re-derives the target on every call: about 30 us of
    CPU more than the same command on one node (measured 64 vs 35 us per ``GET``), paid on
    every replay and wake-up. With ``reader_for`` (the node's pre-packed fast path) a
    ``GET`` and the completion's ``SET`` + ``SPUBLISH`` skip redis-py's per-command
    machinery too, as on one node. Anything unusual (a moved slot, a dead node,
    ``CLUSTERDOWN``) is retried once through the cluster client, which refreshes the
    slot map as usual; a timeout is not retried (C24: one bounded wait). Everything
    else passes through.
    """

    def __init__(
        self, cluster: Any, reader_for: Callable[[Any], _PrePacked | None] | None = None
    ) -> None:
        self._cluster = cluster
        self._reader_for = reader_for

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cluster, name)

    def get(self, name: str) -> Any:
        if self._reader_for is not None:
            node_client = self._owner_client(name)
            reader = None if node_client is None else self._reader_for(node_client)
            if reader is not None:
                try:
                    return reader.get(name.encode("utf-8"))
                except _rerouted():
                    pass  # the slot moved or the node is gone: re-routed, map refreshed
                return self._cluster.get(name)
        return self._direct("get", name, name)

    def set(self, name: str, value: Any, **options: Any) -> Any:
        return self._direct("set", name, name, value, **options)

    def delete(self, name: str) -> Any:
        return self._direct("delete", name, name)

    def exists(self, name: str) -> Any:
        return self._direct("exists", name, name)

    def spublish(self, channel: str, message: Any) -> Any:
        return self._direct("spublish", channel, channel, message)

    def set_and_wake(
        self,
        name: str,
        value: bytes,
        ttl_ms: int,
        waiting: str,
        command: str,
        channel: str,
        message: str,
    ) -> bool:
        """``SET name value PX ttl_ms`` and ``EXISTS waiting``, pre-packed in one write on the
        connection of the node that owns ``name``'s slot (``waiting`` shares its hash tag),
        both replies read: the completion's one round trip, as on one node. Then, only if
        a waiter asked for it, ``command channel message`` (``SPUBLISH``, or ``PUBLISH``
        before Redis 7) on the same connection. The server runs them in the order sent (C23).

        ``False`` when they cannot go that way: no fast path or slot map, a ``SPUBLISH``
        channel that the slot map puts on another master (a slot moved since its tag was
        chosen), a broken connection, or a ``MOVED``/``ASK``/``TRYAGAIN``/``CLUSTERDOWN``
        reply to any of them. The caller then sends them as separate commands, which
        re-route through the cluster client; whatever already went through is sent again,
        which is harmless (the same value; a wake-up is only a hint to re-read). Any other
        error (a timeout, an error reply) is raised.
        """
        cluster = self._cluster
        try:
            node = cluster.get_node_from_key(name)
            if command == "SPUBLISH" and cluster.get_node_from_key(channel).name != node.name:
                return False
            reader = (
                None
                if self._reader_for is None
                else self._reader_for(cluster.get_redis_connection(node))
            )
        except Exception:
            return False
        if reader is None:
            return False
        try:
            replies = reader.run_together([("SET", name, value, "PX", ttl_ms), ("EXISTS", waiting)])
            _raise_error_reply(replies)
            if replies[-1]:
                _raise_error_reply(reader.run_together([(command, channel, message)]))
        except _rerouted():
            return False
        return True

    def _owner_client(self, key: str) -> Any:
        cluster = self._cluster
        try:
            return cluster.get_redis_connection(cluster.get_node_from_key(key))
        except Exception:
            return None  # no slot map yet: the cluster client finds its way

    def _direct(self, command: str, key: str, *args: Any, **options: Any) -> Any:
        node_client = self._owner_client(key)
        if node_client is not None:
            try:
                return getattr(node_client, command)(*args, **options)
            except _rerouted():
                pass  # the slot moved or the node is gone: re-routed below, map refreshed
        return getattr(self._cluster, command)(*args, **options)


def _raise_error_reply(replies: list[Any]) -> None:
    """Raise the first error reply among ``replies`` (a redirection is one of :func:`_rerouted`)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def _rerouted() -> tuple[type[BaseException], ...]:
    """Errors after which a command is sent again through the cluster client."""
    from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError
    from redis.exceptions import ConnectionError as RedisConnectionError

    return (MovedError, AskError, TryAgainError, ClusterDownError, RedisConnectionError)
