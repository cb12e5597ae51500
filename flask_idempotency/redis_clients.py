"""Which Redis we talk to: one node, a Sentinel-managed master, or a Cluster (issue 15).

This module turns a URL or a given client into clients whose commands fail fast:
short socket timeouts, at most one immediate retry on a broken connection, and no
back-off of redis-py's own (the tier's breaker is ours, C24). The cache needs
nothing topology-specific: it only sends single-key commands on hash-tagged keys.
Wake-ups differ by topology (:mod:`.notify.redis`, :mod:`.notify.sentinel`,
:mod:`.notify.cluster`). A Sentinel command client re-asks the sentinels who the
master is every :data:`TOPOLOGY_CHECK_INTERVAL`.

URL forms: ``redis+cluster://[user:password@]host:port,host:port[?...]`` and
``redis+sentinel://[user:password@]host:port,host:port/<master name>[/<db>]``
(``rediss+`` for TLS); anything else is a plain ``redis://`` URL for one node.
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import unquote, urlsplit

#: Seconds between two looks at the topology while subscribed (failover, resharding).
TOPOLOGY_CHECK_INTERVAL = 2.0


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
            "IDEMPOTENCY_REDIS_URL needs the redis package: pip install redis"
            " (Flask-Idempotency's extra 'redis')"
        ) from None

    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        socket_keepalive=True,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        retry_on_timeout=False,
    )
