"""Wake-ups on a Sentinel-managed master: a subscriber that follows a failover (issue 15).

``PUBLISH``/``SUBSCRIBE`` work as on one node (:class:`~.redis.RedisNotifier`);
what differs is who the master is. The subscriber re-asks the sentinels on every
topology check and starts again on the new master when it moved: the sentinels drop a
demoted master's subscribers, but not when they cannot reach it (a partition).
"""

from __future__ import annotations

import socket
import time
from typing import Any, Protocol

from .. import redis_clients
from .listener import TopologyChanged, sockets_of


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
    check_interval = redis_clients.TOPOLOGY_CHECK_INTERVAL

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
        if now - self._checked >= redis_clients.TOPOLOGY_CHECK_INTERVAL:
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
