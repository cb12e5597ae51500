"""Wake-ups on a Redis Cluster: sharded pub/sub on Redis 7+, plain ``PUBLISH`` before (issue 15).

Each master gets one channel whose hash tag falls in its own slots
(``{prefix}:{origin}:done:{w<n>}``); a record's wake-up is ``SPUBLISH``-ed on the
channel of the master that holds the record's slot, so it never crosses the cluster
bus. Each process keeps one subscriber connection per master
(:class:`ShardedSubscriber`); a slot moved away (``sunsubscribe`` from the server), a
dead node or a changed slot map makes it re-read the topology and subscribe again.
Before Redis 7 the cluster broadcasts a plain ``PUBLISH``. The rest is
:class:`~.redis.RedisNotifier`'s.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from .. import redis_clients
from ..cache.outage import Outage, ShardOutages
from .listener import (
    TopologyChanged,
    WakeupListener,
    listener_for,
    readable_now,
    sockets_of,
    wait_readable,
)
from .redis import RedisNotifier

#: How many candidate tags are hashed to find one per master (16384 slots; plenty).
_TAG_CANDIDATES = 50_000


class ClusterNotifier(RedisNotifier):
    """Wake-ups on a Redis Cluster: sharded pub/sub on Redis 7+, plain ``PUBLISH`` before.

    A record's ``done``/``released`` goes to the channel of the master holding the
    record's slot (the shard channels below).
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
            self._sharded = supports_sharded_pubsub(self._client)
        return self._sharded

    def _tag_for(self, key_digest: str) -> str | None:
        now = time.monotonic()
        if not self._tags:
            self._tags, self._tags_at = shard_tags(self._client), now
        elif now - self._tags_at > redis_clients.TOPOLOGY_CHECK_INTERVAL:
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


# -- the shard channels ----------------------------------------------------------------------


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
    check_interval = redis_clients.TOPOLOGY_CHECK_INTERVAL

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
        if now - self._checked >= redis_clients.TOPOLOGY_CHECK_INTERVAL:
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
