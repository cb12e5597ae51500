"""The Redis tier an app gets: a cache and a notifier built from settings or a given client.

:class:`RedisTier` reads ``IDEMPOTENCY_REDIS_URL`` (one node, ``redis+sentinel://`` or
``redis+cluster://``, :mod:`.redis_clients`) or takes the app's own client, derives
clients whose commands give up after ``IDEMPOTENCY_REDIS_SOCKET_TIMEOUT`` (C24), and
puts on them the pair the extension uses: :class:`~.cache.redis.RedisCache` and a
notifier (:class:`~.notify.redis.RedisNotifier`, or :class:`~.notify.cluster.ClusterNotifier`
on a Cluster) sharing one breaker. Clients are shared per process by URL
(:mod:`.process`). :func:`store_origin` names the durable store by the identity its
database keeps, so two services on one Redis never see each other's records or
wake-ups (C41).

Nothing here is needed without Redis: the extension imports this module only when a
Redis URL or client is configured.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

from . import process
from . import redis_clients as topology
from ._wire.redis import direct_cluster
from .cache.outage import Outage, ShardOutages
from .cache.redis import RedisCache
from .notify.cluster import ClusterNotifier
from .notify.listener import WakeupListener
from .notify.redis import RedisNotifier
from .notify.sentinel import SentinelSubscriber
from .records import Completed
from .redis_clients import _client_from_url, bounded_client

if TYPE_CHECKING:
    from .config import Settings
    from .notify import WakeupHub


def store_origin(store_id: str, table: str) -> str:
    """A short, stable name for one durable store: its identity and its table (C41).

    ``store_id`` is the random id the store's own database keeps
    (:meth:`~flask_idempotency.store.DurableStore.identity`), never the text of a URL:
    two URLs that read the same may reach two databases. Two apps on the same database
    and table are the same store and share records, as they should (two workers, two
    hosts); anything else never does.
    """
    text = f"{store_id}|{table}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


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
        replay_headers: Iterable[str] | None = None,
        secret: bytes | Callable[[], bytes] | None = None,
    ) -> None:
        self.outage = Outage()
        shards = ShardOutages(client) if cluster else None
        self.cache = RedisCache(
            client,
            prefix=prefix,
            origin=origin,
            outage=self.outage,
            shards=shards,
            replay_headers=replay_headers,
            secret=secret,
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

    def __repr__(self) -> str:
        return f"<RedisTier {self.cache!r}>"  # never a client, a URL or the secret (C61)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        client: Any = None,
        origin: str | Callable[[], str] = "",
        secret: bytes | Callable[[], bytes] | None = None,
    ) -> RedisTier:
        """The tier for an app: from a given ``client`` or the URL, never waiting on Redis
        longer than ``IDEMPOTENCY_REDIS_SOCKET_TIMEOUT`` (C24). ``origin`` and ``secret``:
        the store's name in Redis and the secret its values' MAC is keyed by (C41, C60)."""
        timeout = settings.redis_socket_timeout
        first_wait = min(1.0, max(0.25, 5 * timeout))
        common: dict[str, Any] = {
            "prefix": settings.redis_prefix,
            "origin": origin,
            "first_wait": first_wait,
            "replay_headers": settings.replay_headers,
            "secret": secret,
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
                given = SentinelSubscriber(topology.GivenSentinelMaster(pool), client)
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
            build_subscriber = lambda: SentinelSubscriber(  # noqa: E731
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
