"""Which Redis we talk to: one node, a Sentinel-managed master, or a Cluster (issue 15).

This module turns a URL or a given client into clients with bounded timeouts, and
gives the cluster its wake-up channels. The cache needs nothing topology-specific:
it only sends single-key commands on hash-tagged keys. Wake-ups do:

- one node and Sentinel: ``PUBLISH``/``SUBSCRIBE`` on ``{prefix}:{origin}:done``;
  the Sentinel subscriber re-asks the sentinels who the master is on every
  heartbeat and moves to the new one after a failover;
- Cluster (Redis 7+): sharded pub/sub. Each master gets one channel whose hash tag
  falls in its own slots (``{prefix}:{origin}:done:{w<n>}``); a record's wake-up
  is ``SPUBLISH``-ed on the channel of the master that holds the record's slot, so
  it never crosses the cluster bus. Each process keeps one subscriber connection
  per master; a slot moved away (``sunsubscribe`` from the server), a dead node or a
  changed slot map makes it re-read the topology and subscribe again;
- Cluster before Redis 7: plain ``PUBLISH``, which the cluster broadcasts.

URL forms: ``redis+cluster://[user:password@]host:port,host:port[?...]`` and
``redis+sentinel://[user:password@]host:port,host:port/<master name>[/<db>]``
(``rediss+`` for TLS).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from .notify.listener import readable_now, sockets_of, wait_readable

#: Seconds between two looks at the topology while subscribed (failover, resharding).
TOPOLOGY_CHECK_INTERVAL = 2.0
#: How many candidate tags are hashed to find one per master (16384 slots; plenty).
_TAG_CANDIDATES = 50_000


class TopologyChanged(Exception):
    """The subscriber's view of the masters is out of date: subscribe again."""


def parse_topology(url: str) -> str:
    """``"cluster"``, ``"sentinel"`` or ``"single"`` for an ``IDEMPOTENCY_REDIS_URL``."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("redis+cluster", "rediss+cluster"):
        return "cluster"
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return "sentinel"
    return "single"


def is_cluster_client(client: Any) -> bool:
    try:
        from redis.cluster import RedisCluster
    except ImportError:  # pragma: no cover - redis without cluster support
        return False
    return isinstance(client, RedisCluster)


def _hosts(netloc: str, default_port: int) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    userinfo, _, hostlist = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) or None
    hosts: list[tuple[str, int]] = []
    for part in hostlist.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        hosts.append((host.strip("[]"), int(port) if port else default_port))
    if not hosts:
        raise ValueError("IDEMPOTENCY_REDIS_URL names no host")
    return username, password, hosts


def _retry_once() -> dict[str, Any]:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return {"retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))}


def cluster_from_url(url: str, *, socket_timeout: float, connect_timeout: float) -> Any:
    """A ``RedisCluster`` from ``redis+cluster://h:p,h:p``, failing fast (C24)."""
    from redis.cluster import ClusterNode, RedisCluster

    parts = urlsplit(url)
    username, password, hosts = _hosts(parts.netloc, 6379)
    return RedisCluster(
        startup_nodes=[
            ClusterNode(host, port)  # type: ignore[no-untyped-call]
            for host, port in hosts
        ],
        username=username,
        password=password,
        ssl=parts.scheme.lower().startswith("rediss"),
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        socket_keepalive=True,
        require_full_coverage=False,  # a shard down must not take the others' cache with it
        **_cluster_retry_kwargs(),
    )


def _cluster_retry_kwargs() -> dict[str, Any]:
    """At most one more attempt after a topology refresh: the tier's back-off is ours."""
    import inspect

    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    accepted = inspect.signature(RedisCluster.__init__).parameters
    if "retry" in accepted:
        return {"retry": Retry(NoBackoff(), 1)}
    return {"cluster_error_retry_attempts": 1}  # pragma: no cover - older redis-py


def bounded_cluster(client: Any, *, socket_timeout: float, connect_timeout: float) -> Any:
    """A ``RedisCluster`` on the same nodes and credentials as ``client``, with our timeouts."""
    from redis.cluster import ClusterNode, RedisCluster

    manager = client.nodes_manager
    settings = dict(getattr(manager, "connection_kwargs", {}) or {})
    kept = {
        name: settings[name]
        for name in ("username", "password", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
        if settings.get(name) is not None
    }
    nodes = [ClusterNode(node.host, node.port) for node in client.get_nodes()]  # type: ignore[no-untyped-call]
    if not nodes:
        nodes = list(manager.startup_nodes.values())
    return RedisCluster(
        startup_nodes=nodes,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        socket_keepalive=True,
        require_full_coverage=False,
        **kept,
        **_cluster_retry_kwargs(),
    )


class _PrePacked(Protocol):
    """What :class:`DirectCluster` needs from a node's fast path (``redis_tier._Reader``)."""

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


class SentinelMaster:
    """A ``redis+sentinel://`` URL: the sentinels and the master's clients."""

    def __init__(self, url: str, *, socket_timeout: float, connect_timeout: float) -> None:
        from redis.sentinel import Sentinel

        parts = urlsplit(url)
        username, password, hosts = _hosts(parts.netloc, 26379)
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(
                "IDEMPOTENCY_REDIS_URL: redis+sentinel://host:port,host:port/<master name>[/<db>]"
            )
        self.service = unquote(path[0])
        self.db = int(path[1]) if len(path) > 1 else 0
        self._auth = {"username": username, "password": password}
        self._ssl = parts.scheme.lower().startswith("rediss")
        self.sentinel = Sentinel(  # type: ignore[no-untyped-call]
            hosts,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            sentinel_kwargs={
                "socket_timeout": socket_timeout,
                "socket_connect_timeout": connect_timeout,
            },
        )

    def client(self, *, socket_timeout: float, connect_timeout: float) -> Any:
        options: dict[str, Any] = dict(
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            socket_keepalive=True,
            db=self.db,
            **self._auth,
            **_retry_once(),
        )
        if self._ssl:
            options["ssl"] = True
        return self.sentinel.master_for(self.service, **options)  # type: ignore[no-untyped-call]

    def command_client(self, *, socket_timeout: float, connect_timeout: float) -> Any:
        """The master's client for commands, re-checking who the master is every couple of
        seconds: pooled connections to a demoted master would otherwise go on publishing
        there (a replica accepts ``PUBLISH`` and reads) until the sentinels kill them."""
        return following_sentinel(
            self.client(socket_timeout=socket_timeout, connect_timeout=connect_timeout)
        )

    def master_address(self) -> tuple[str, int]:
        host, port = self.sentinel.discover_master(self.service)  # type: ignore[no-untyped-call]
        return str(host), int(port)


class _FollowingClient:
    def __init__(self, client: Any) -> None:
        self._client = client
        self._checked = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        now = time.monotonic()
        if now - self._checked >= TOPOLOGY_CHECK_INTERVAL:
            self._checked = now
            try:
                # Asks the sentinels; drops the pool's connections if the master moved.
                self._client.connection_pool.get_master_address()
            except Exception:
                pass
        return getattr(self._client, name)


class GivenSentinelMaster:
    """The master behind a given ``Sentinel(...).master_for(...)`` client: asks the
    client's own sentinels where it is, as :class:`SentinelMaster` does for a URL."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def master_address(self) -> tuple[str, int]:
        host, port = self._pool.sentinel_manager.discover_master(self._pool.service_name)
        return str(host), int(port)


def sentinel_pool(client: Any) -> Any | None:
    """The ``SentinelConnectionPool`` of a client made by ``Sentinel.master_for``, else None."""
    pool = getattr(client, "connection_pool", None)
    if hasattr(pool, "service_name") and hasattr(pool, "sentinel_manager"):
        return pool
    return None


def following_sentinel(client: Any) -> Any:
    """A command client on a Sentinel-managed master that re-checks who the master is."""
    return _FollowingClient(client)


class _MasterAddress(Protocol):
    def master_address(self) -> tuple[str, int]: ...


class SentinelSubscriber:
    """What the listener's ``connect`` returns for Sentinel: a client whose subscriptions
    notice a failover (the master moved) and start again on the new master. The sentinels
    drop a demoted master's subscribers, but not when they cannot reach it (a partition):
    the subscriber must not rely on that."""

    def __init__(self, master: _MasterAddress, client: Any) -> None:
        self._master = master
        self._client = client

    def pubsub(self, **kwargs: Any) -> Any:
        return _FollowMaster(self._master, self._client.pubsub(**kwargs))


class _FollowMaster:
    #: The listener reads at least this often, so a moved master is noticed in time.
    check_interval = TOPOLOGY_CHECK_INTERVAL

    def __init__(self, master: _MasterAddress, inner: Any) -> None:
        self._master = master
        self._inner = inner
        self._address: tuple[str, int] | None = None
        self._checked = 0.0

    def subscribe(self, *channels: str) -> None:
        self._address = self._master.master_address()
        self._checked = time.monotonic()
        self._inner.subscribe(*channels)

    def get_message(self, timeout: float = 0.0) -> Any:
        now = time.monotonic()
        if now - self._checked >= TOPOLOGY_CHECK_INTERVAL:
            self._checked = now
            address: tuple[str, int] | None
            try:
                address = self._master.master_address()
            except Exception:
                address = self._address  # sentinels unreachable: keep what works
            if address != self._address:
                raise TopologyChanged(f"the master moved to {address}")
        return self._inner.get_message(timeout=timeout)

    def ping(self, message: str) -> None:
        self._inner.ping(message)

    def sockets(self) -> list[socket.socket] | None:
        return sockets_of(self._inner)

    def close(self) -> None:
        self._inner.close()


# -- cluster wake-ups ---------------------------------------------------------------------


def shard_tags(cluster: Any) -> dict[str, str]:
    """For each master (by ``host:port``), a channel hash tag that falls in its slots.

    Deterministic from the slot map: every process with the same view of the cluster
    picks the same tag, and a failover (same slots, new master) keeps it.
    """
    slots = cluster.nodes_manager.slots_cache
    owner_of: dict[int, str] = {}
    for slot, nodes in slots.items():
        if nodes:
            owner_of[slot] = nodes[0].name
    masters = set(owner_of.values())
    tags: dict[str, str] = {}
    for n in range(_TAG_CANDIDATES):
        tag = f"w{n}"
        owner = owner_of.get(cluster.keyslot(tag))
        if owner is not None and owner not in tags:
            tags[owner] = tag
            if len(tags) == len(masters):
                break
    return tags


def tags_still_valid(cluster: Any, tags: dict[str, str]) -> bool:
    """Whether ``tags`` still names one channel per master, each in its master's slots.

    A handful of dictionary look-ups, so it can run every couple of seconds on the hot
    path; :func:`shard_tags` scans all 16384 slots and runs only when this says no.
    """
    try:
        if {node.name for node in cluster.get_primaries()} != set(tags):
            return False
        for master, tag in tags.items():
            node = cluster.get_node_from_key(tag)
            if node is None or node.name != master:
                return False
    except Exception:
        return False
    return True


def shard_tag_for_key(cluster: Any, key: str, tags: dict[str, str]) -> str | None:
    node = cluster.get_node_from_key(key)
    return None if node is None else tags.get(node.name)


class ShardedSubscriber:
    """What the listener's ``connect`` returns on a cluster: one ``SSUBSCRIBE`` connection
    per master, presented to the listener as one pub/sub object."""

    def __init__(self, cluster: Any, channel_for_tag: Callable[[str], str]) -> None:
        self._cluster = cluster
        self._channel_for_tag = channel_for_tag

    def pubsub(self, **kwargs: Any) -> Any:
        return _ShardedPubSub(self._cluster, self._channel_for_tag)


class _ShardedPubSub:
    check_interval = TOPOLOGY_CHECK_INTERVAL

    def __init__(self, cluster: Any, channel_for_tag: Callable[[str], str]) -> None:
        self._cluster = cluster
        self._channel_for_tag = channel_for_tag
        self._subs: dict[str, Any] = {}  # master name -> its node's PubSub
        self._tags: dict[str, str] = {}
        self._pending: set[str] = set()
        #: Shards that just gave a message: more may sit in the client's buffer, which no
        #: poll of the socket shows, so they are read again until they give nothing.
        self._maybe_buffered: set[str] = set()
        self._pongs_due = 0
        self._checked = 0.0

    def subscribe(self, *_channels: str) -> None:
        """Subscribe to every master's channel (the listener's own channel name is unused)."""
        self._cluster.nodes_manager.initialize()  # a fresh slot map after any failure
        self._tags = shard_tags(self._cluster)
        self._checked = time.monotonic()
        for node in self._cluster.get_primaries():
            tag = self._tags.get(node.name)
            if tag is None:
                continue
            pubsub = self._cluster.get_redis_connection(node).pubsub()
            self._subs[node.name] = pubsub
            channel = self._channel_for_tag(tag)
            pubsub.ssubscribe(channel)
            self._pending.add(node.name)
            self._maybe_buffered.add(node.name)
        if not self._subs:
            raise TopologyChanged("the cluster has no reachable master")

    def get_message(self, timeout: float = 0.0) -> Any:
        now = time.monotonic()
        if now - self._checked >= TOPOLOGY_CHECK_INTERVAL:
            self._checked = now
            if not tags_still_valid(self._cluster, self._tags):
                raise TopologyChanged("the cluster's slot map changed")
        deadline = now + timeout
        while True:
            for name in self._to_read():
                message = self._subs[name].get_message(timeout=0.0)
                if message is None:
                    self._maybe_buffered.discard(name)
                    continue
                self._maybe_buffered.add(name)
                translated = self._translate(name, message)
                if translated is not None:
                    return translated
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._wait_readable(min(remaining, 0.25))

    def _to_read(self) -> list[str]:
        """The shards that may have a message now: one ``poll`` of all their sockets, not a
        read attempt on each (an empty redis-py read costs ~7 us of CPU and system calls,
        each a chance for a busy request thread to take the GIL), plus those that may hold
        one in their buffer."""
        by_fd: dict[int, str] = {}
        for name, pubsub in self._subs.items():
            sock = getattr(getattr(pubsub, "connection", None), "_sock", None)
            if sock is None:
                return list(self._subs)  # not connected: redis-py's read connects or raises
            by_fd[sock.fileno()] = name
        ready = readable_now(by_fd)
        return [name for fd, name in by_fd.items() if fd in ready or name in self._maybe_buffered]

    def sockets(self) -> list[socket.socket] | None:
        """Every shard connection's socket (``None`` until all are connected)."""
        found: list[socket.socket] = []
        for pubsub in self._subs.values():
            sockets = sockets_of(pubsub)
            if not sockets:
                return None
            found.extend(sockets)
        return found or None

    def _wait_readable(self, timeout: float) -> None:
        sockets = []
        for pubsub in self._subs.values():
            sock = getattr(getattr(pubsub, "connection", None), "_sock", None)
            if sock is None:
                time.sleep(min(timeout, 0.01))  # not connected yet: poll briefly
                return
            sockets.append(sock)
        if sockets:
            wait_readable(sockets, timeout)

    def _translate(self, name: str, message: dict[str, Any]) -> dict[str, Any] | None:
        kind = message.get("type")
        if isinstance(kind, bytes):
            kind = kind.decode()
        if kind == "smessage":
            return {"type": "message", "data": message.get("data")}
        if kind == "ssubscribe":
            self._pending.discard(name)
            return {"type": "subscribe"} if not self._pending else None
        if kind == "sunsubscribe":
            # The server moved the slot away (resharding, failover): subscribe anew.
            raise TopologyChanged("a shard channel's slot moved")
        if kind == "pong":
            self._pongs_due -= 1
            return {"type": "pong"} if self._pongs_due <= 0 else None
        return None

    def ping(self, message: str) -> None:
        self._pongs_due = len(self._subs)
        for pubsub in self._subs.values():
            pubsub.ping(message)

    def close(self) -> None:
        for pubsub in self._subs.values():
            try:
                pubsub.close()
            except Exception:
                pass
        self._subs.clear()


def supports_sharded_pubsub(cluster: Any) -> bool:
    """Redis 7 or later on the cluster's nodes (``SPUBLISH``/``SSUBSCRIBE``)."""
    try:
        info = cluster.get_redis_connection(cluster.get_primaries()[0]).info("server")
        major = int(str(info.get("redis_version", "0")).split(".")[0])
    except Exception:
        return True  # unknown now: try sharded; a failure marks the tier down and retries
    return major >= 7
