"""An idle wake-up listener sleeps on its socket (issue 15 follow-up: listener idle cost).

The profile showed the listener thread at 7-12% of a worker's GIL samples under load,
because it woke on a 0.5 s tick to read nothing. On a real socket it now waits with
``select`` until a message, its next heartbeat, or ``stop()``. Counted in wake-ups of
the thread (reads), not time. The half-open bound (a heartbeat unanswered within
``answer_timeout`` after ``heartbeat_interval`` of silence) still holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from flask_idempotency.notify import WakeupHub, listener
from tests.conftest import redis_server_binary
from tests.support.redis_server import RedisServer
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.redis]

EVENTUALLY = 20.0


class CountedReads:
    """A real client whose subscriber counts its reads (``get_message`` calls)."""

    def __init__(self, port: int) -> None:
        self._client = redis.Redis(port=port, socket_timeout=10.0)
        self.reads = 0

    def pubsub(self, **kwargs: Any) -> Any:
        inner = self._client.pubsub(**kwargs)
        outer = self

        class Counted:
            def get_message(self, timeout: float = 0.0) -> Any:
                outer.reads += 1
                return inner.get_message(timeout=timeout)

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

        return Counted()


@pytest.fixture(scope="module")
def server(tmp_path_factory: Any) -> Iterator[RedisServer]:
    node = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("idle"))
    try:
        node.start()
    except (OSError, RuntimeError) as exc:
        node.stop()
        pytest.fail(f"could not start redis-server: {exc}")
    yield node
    node.stop()


def _live(subscriber: listener.WakeupListener, hub: WakeupHub) -> None:
    subscriber.ensure(hub)
    assert subscriber.wait_until_live(EVENTUALLY)


def test_an_idle_listener_does_not_wake_on_a_tick(server: RedisServer) -> None:
    """Three idle seconds (heartbeat every 5 s): at most a read or two, not one per 0.5 s
    tick; a message still arrives at once, and ``stop()`` is not held up by the sleep."""
    client = CountedReads(server.port)
    subscriber = listener.WakeupListener(lambda: client, "idem:idle:done")
    hub = WakeupHub()
    try:
        _live(subscriber, hub)
        time.sleep(0.2)
        before = client.reads
        time.sleep(3.0)
        idle_reads = client.reads - before
        assert idle_reads <= 2, f"{idle_reads} reads in 3 idle seconds"
        with hub.parked("e" * 64) as parked:
            redis.Redis(port=server.port).publish("idem:idle:done", '{"k":"' + "e" * 64 + '"}')
            assert parked.wait(EVENTUALLY) is True
        assert subscriber.messages == 1
    finally:
        started = time.monotonic()
        subscriber.stop()
        stopped_in = time.monotonic() - started
    assert stopped_in < 1.0, stopped_in


def test_a_half_open_connection_is_still_caught_by_the_heartbeat(server: RedisServer) -> None:
    """Traffic stalls (a half-open peer): the sleeping listener still sends its heartbeat
    when due and reconnects when the answer does not come (within interval + timeout)."""
    proxy = TcpProxy("127.0.0.1", server.port).start()
    subscriber = listener.WakeupListener(
        lambda: redis.Redis(port=proxy.port, socket_timeout=10.0),
        "idem:halfopen:done",
        heartbeat_interval=0.5,
        answer_timeout=0.5,
    )
    hub = WakeupHub()
    try:
        _live(subscriber, hub)
        proxy.stall()
        stalled = time.monotonic()
        deadline = stalled + EVENTUALLY
        while subscriber.live:
            assert time.monotonic() < deadline, "the half-open connection went unnoticed"
            time.sleep(0.02)
        assert time.monotonic() - stalled < 0.5 + 0.5 + 1.0
        proxy.restore()
        deadline = time.monotonic() + EVENTUALLY
        while subscriber.subscriptions < 2 or not subscriber.live:
            assert time.monotonic() < deadline, "no fresh subscription after the stall"
            time.sleep(0.05)
    finally:
        subscriber.stop()
        proxy.stop()


def test_the_listener_waits_on_descriptors_above_1024(server: RedisServer) -> None:
    """A busy worker's sockets can be numbered past ``select``'s limit of 1024: the idle
    listener still sleeps on its socket and hears messages (``poll``, not ``select``)."""
    import os
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"the descriptor limit is {soft}")  # pragma: no cover - CI has 1024+
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    subscriber = listener.WakeupListener(
        lambda: redis.Redis(port=server.port, socket_timeout=10.0), "idem:high:done"
    )
    hub = WakeupHub()
    try:
        _live(subscriber, hub)
        time.sleep(1.0)  # asleep on its socket by now, or failing and reconnecting
        assert subscriber.subscriptions == 1 and subscriber.live
        with hub.parked("f" * 64) as parked:
            redis.Redis(port=server.port).publish("idem:high:done", '{"k":"' + "f" * 64 + '"}')
            assert parked.wait(EVENTUALLY) is True
        assert subscriber.messages == 1 and subscriber.subscriptions == 1
    finally:
        subscriber.stop()
        for fd in fillers:
            os.close(fd)
