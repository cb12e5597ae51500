"""The cache and wake-ups on every Redis topology: one node, a Cluster, Sentinel (issue 15).

Real servers started on loopback by the suite (tests/support/redis_cluster.py):
a 3-master cluster and a Sentinel group (master, replica, three sentinels), kept
for the session. Rules: C48 (every topology: single node, Cluster with hash-tagged
keys and sharded pub/sub, Sentinel; each changes latency only, never an outcome),
C10 (wake-ups), C22/C23 (replays from the cache, promotion at completion), C24
(losing a node or a failover changes no outcome), C25.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from flask import Flask, jsonify, request
from sqlalchemy.engine import URL

from flask_idempotency import Idempotency, idempotent, signals
from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest
from flask_idempotency.notify import PollSchedule
from flask_idempotency.notify import hub as wakeup
from tests.conftest import redis6_server_binary, redis_server_binary
from tests.support.redis_cluster import RedisCluster3, SentinelGroup, redis_cli
from tests.support.redis_server import RedisServer
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]

EVENTUALLY = 30.0


def _started(server: Any) -> Any:
    try:
        return server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()
        pytest.fail(f"could not start {type(server).__name__}: {exc}")


@pytest.fixture(scope="session")
def single_node(tmp_path_factory: Any) -> Iterator[RedisServer]:
    server = _started(RedisServer(redis_server_binary(), tmp_path_factory.mktemp("single")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: Any) -> Iterator[RedisCluster3]:
    group = _started(RedisCluster3(redis_server_binary(), tmp_path_factory.mktemp("cluster")))
    yield group
    group.stop()


@pytest.fixture(scope="session")
def sentinel_group(tmp_path_factory: Any) -> Iterator[SentinelGroup]:
    group = _started(SentinelGroup(redis_server_binary(), tmp_path_factory.mktemp("sentinel")))
    yield group
    group.stop()


@pytest.fixture(scope="session")
def single_node_redis6(tmp_path_factory: Any) -> Iterator[RedisServer]:
    """Redis 6: no sharded pub/sub; wake-ups go by plain ``PUBLISH``."""
    server = _started(RedisServer(redis6_server_binary(), tmp_path_factory.mktemp("single6")))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cluster_redis6(tmp_path_factory: Any) -> Iterator[RedisCluster3]:
    """A 3-master Redis 6 cluster: ``PUBLISH`` there is broadcast over the cluster bus."""
    group = _started(RedisCluster3(redis6_server_binary(), tmp_path_factory.mktemp("cluster6")))
    yield group
    group.stop()


TOPOLOGY_FIXTURES = {
    "single": "single_node",
    "cluster": "cluster",
    "sentinel": "sentinel_group",
    "single-redis6": "single_node_redis6",
    "cluster-redis6": "cluster_redis6",
}


def shared_servers(item: pytest.Item) -> tuple[str, ...]:
    """The server a test reaches through ``topology_url`` (asked for by name), so that the
    tests of each topology run on one worker and it starts once (tests/support/parallel.py)."""
    callspec = getattr(item, "callspec", None)
    topology = callspec.params.get("topology_url") if callspec is not None else None
    return (TOPOLOGY_FIXTURES[topology],) if topology is not None else ()


@pytest.fixture(params=list(TOPOLOGY_FIXTURES))
def topology_url(request: pytest.FixtureRequest) -> str:
    """The ``IDEMPOTENCY_REDIS_URL`` of each topology (Redis 7, and Redis 6 without
    sharded pub/sub)."""
    server = request.getfixturevalue(TOPOLOGY_FIXTURES[request.param])
    return str(server.url)


class Svc:
    """An app ("a worker process") on the session's PostgreSQL, a table and a Redis URL."""

    def __init__(
        self,
        database_url: str,
        table: str,
        redis_url: str | None,
        client: Any = None,
        **config: Any,
    ) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.sources: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        app = Flask(f"topo_{uuid.uuid4().hex[:6]}")
        app.config.update(
            IDEMPOTENCY_DATABASE_URI=database_url,
            IDEMPOTENCY_TABLE=table,
            IDEMPOTENCY_CREATE_TABLE=True,
            IDEMPOTENCY_REDIS_URL=redis_url,
            IDEMPOTENCY_WAIT=20,
            IDEMPOTENCY_REDIS_SOCKET_TIMEOUT=0.25,
        )
        app.config.update(config)
        if redis_url is None:
            del app.config["IDEMPOTENCY_REDIS_URL"]
        Idempotency(app, redis=client)
        self.app = app
        self.state = app.extensions["idempotency"]
        lock = threading.Lock()

        @app.post("/pay")
        @idempotent
        def pay() -> Any:
            key = request.headers["Idempotency-Key"]
            with lock:
                self.calls[key] += 1
            self.entered.set()
            assert self.gate.wait(EVENTUALLY)
            return jsonify(key=key, body=request.get_json()), 201

        signals.request_replayed.connect(
            lambda sender, **extra: self.sources.append(extra["source"]), app, weak=False
        )

    def post(self, key: str, amount: int = 1) -> Any:
        return self.app.test_client().post(
            "/pay", json={"amount": amount}, headers={"Idempotency-Key": key}
        )

    def drop(self) -> None:
        store = self.state.store
        store.table.drop(store.engine, checkfirst=True)
        store.engine.dispose()


@pytest.fixture
def make_svc(pg_url: URL) -> Iterator[Any]:
    made: list[Svc] = []
    table = f"topo_{uuid.uuid4().hex[:10]}"

    def make(
        redis_url: str | None, database_url: str | None = None, client: Any = None, **config: Any
    ) -> Svc:
        svc = Svc(
            database_url or pg_url.render_as_string(hide_password=False),
            table,
            redis_url,
            client,
            **config,
        )
        made.append(svc)
        return svc

    yield make
    if made:
        made[0].state.store.engine.dispose()
        svc = Svc(pg_url.render_as_string(hide_password=False), table, "redis://127.0.0.1:1/0")
        svc.drop()
        for other in made:
            other.state.store.engine.dispose()


@pytest.fixture
def no_poll_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parked requests re-check only when woken: a lost wake-up becomes a 409."""
    monkeypatch.setattr(wakeup, "PollSchedule", lambda **_: PollSchedule(first=600, cap=600))


# -- C22 / C23 --------------------------------------------------------------------------


def test_i15_c22_c23_replays_come_from_the_cache_on_every_topology(
    make_svc: Any, topology_url: str
) -> None:
    """Completion promotes every record (no cross-slot pipeline on a cluster), so replays
    come from the cache: at least 95% of them (C22, C23, C48; issue 15 item 5)."""
    svc = make_svc(topology_url)
    keys = [f"k{n}-{uuid.uuid4().hex[:6]}" for n in range(40)]
    for key in keys:
        assert svc.post(key).status_code == 201
    for key in keys:
        replay = svc.post(key)
        assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert sum(svc.calls.values()) == len(keys)
    assert svc.sources.count("cache") >= 0.95 * len(keys), collections.Counter(svc.sources)


def test_i15_cluster_records_spread_over_the_shards(make_svc: Any, cluster: RedisCluster3) -> None:
    """Each record's key is hash-tagged by its digest: records land on every master."""
    svc = make_svc(cluster.url)
    for n in range(30):
        svc.post(f"spread-{n}")
    per_node = [int(node.cli("DBSIZE").strip() or 0) for node in cluster.nodes]
    assert all(count > 0 for count in per_node), per_node


def test_i15_c22_c23_c10_a_given_redis_cluster_client_caches_and_wakes(
    make_svc: Any, cluster: RedisCluster3, no_poll_ticks: None
) -> None:
    """``Idempotency(redis=RedisCluster(...))``: completions are promoted (no pipelined
    ``PUBLISH``), replays come from the cache, wake-ups arrive by sharded message."""
    from redis.cluster import ClusterNode, RedisCluster

    def given() -> Any:
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.nodes[0].port)])

    owner, waiter = make_svc(None, client=given()), make_svc(None, client=given())
    keys = [f"given-{n}" for n in range(20)]
    for key in keys:
        assert owner.post(key).status_code == 201
    for key in keys:
        assert owner.post(key).headers["Idempotent-Replayed"] == "true"
    assert owner.sources.count("cache") >= 19
    _listening(waiter)
    woke = [_wake_by_message(owner, waiter, f"given-wake-{n}") for n in range(4)]
    assert max(woke) < 5.0, woke


def test_i15_redis6_cluster_wakes_by_plain_publish(
    make_svc: Any, cluster_redis6: RedisCluster3, no_poll_ticks: None
) -> None:
    """On a Redis 6 cluster (no ``SPUBLISH``) the notifier publishes with plain ``PUBLISH``
    and one ordinary subscription hears every shard's records (issue 15 item 1)."""
    assert "redis_version:6." in cluster_redis6.nodes[0].cli("INFO", "server")
    owner, waiter = make_svc(cluster_redis6.url), make_svc(cluster_redis6.url)
    _listening(waiter)
    notifier = waiter.state.wakeups.channel
    assert notifier._is_sharded() is False
    woke = [_wake_by_message(owner, waiter, f"r6-{n}-{uuid.uuid4().hex[:6]}") for n in range(6)]
    assert max(woke) < 5.0, woke
    assert waiter.state.wakeups.channel.listener.messages >= 6


def test_i15_cluster_wakeups_do_not_rescan_the_slot_map_while_it_holds(
    make_svc: Any, cluster: RedisCluster3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking that the shard channels still match the slot map is a few look-ups
    (``tags_still_valid``); the 16384-slot scan (~1.4 ms of CPU) runs only when it fails,
    not every topology-check interval on a request thread."""
    from flask_idempotency import redis_clients
    from flask_idempotency.notify import cluster as cluster_notify

    scans = collections.Counter[str]()
    real = cluster_notify.shard_tags

    def counted(client: Any) -> dict[str, str]:
        scans["scan"] += 1
        return real(client)

    monkeypatch.setattr(cluster_notify, "shard_tags", counted)
    monkeypatch.setattr(redis_clients, "TOPOLOGY_CHECK_INTERVAL", 0.0)  # check every time
    svc = make_svc(cluster.url)
    for n in range(20):
        assert svc.post(f"scan-{n}-{uuid.uuid4().hex[:6]}").status_code == 201
    assert scans["scan"] <= 2, scans


def test_i15_cluster_cache_commands_go_straight_to_the_slot_owner_and_follow_moved(
    cluster: RedisCluster3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DirectCluster``: a ``GET``/``SET``/``SPUBLISH`` goes to the slot owner's client
    without ``RedisCluster``'s per-command routing (~30 us CPU less per command), the
    ``GET`` pre-packed on that node's kept connection as on one node; with a stale slot
    map the ``MOVED`` answer is retried through the cluster client (right answer, map
    refreshed)."""
    from flask_idempotency._wire.redis import cluster_node_reader, direct_cluster
    from flask_idempotency.redis_clients import cluster_from_url

    inner = cluster_from_url(cluster.url, socket_timeout=1.0, connect_timeout=1.0)
    direct = direct_cluster(inner)
    routed = collections.Counter[str]()
    real_execute = inner.execute_command

    def counted(*args: Any, **kwargs: Any) -> Any:
        routed[str(args[0])] += 1
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(inner, "execute_command", counted)
    key = f"idem:{{{uuid.uuid4().hex}}}"
    assert direct.set(key, b"v", px=60_000)
    assert direct.get(key) == b"v"
    direct.spublish("idem:done:{w1}", "x")
    assert sum(routed.values()) == 0, routed
    owner = inner.get_node_from_key(key)
    reader = cluster_node_reader(inner.get_redis_connection(owner))
    assert reader is not None and reader._idle, "the GET's connection is kept for the next"
    wrong = next(n for n in inner.get_primaries() if n.name != owner.name)
    monkeypatch.setattr(inner, "get_node_from_key", lambda *_a, **_k: wrong)
    assert direct.get(key) == b"v"  # MOVED from the wrong node: re-routed
    assert routed["GET"] == 1
    inner.close()


# -- C23 on a cluster: the completion's one round trip ----------------------------------------


class _Trace:
    """What a cluster completion sent: the pre-packed pairs (with their replies), the
    commands routed through ``RedisCluster``, and the direct ``SET``/``SPUBLISH`` calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, svc: Svc) -> None:
        from flask_idempotency._wire import redis as redis_wire

        self.events: list[tuple[str, ...]] = []
        real_together = redis_wire._Reader.run_together

        def together(reader: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
            replies = real_together(reader, commands)
            self.events.append(
                (
                    "together",
                    *(f"{c[0]}:{type(r).__name__}" for c, r in zip(commands, replies, strict=True)),
                )
            )
            return replies

        monkeypatch.setattr(redis_wire._Reader, "run_together", together)
        for command in ("set", "exists", "spublish"):
            real_direct = getattr(redis_wire.DirectCluster, command)

            def direct(
                self_: Any, *args: Any, _c: str = command, _r: Any = real_direct, **kw: Any
            ) -> Any:
                self.events.append(("direct", _c.upper()))
                return _r(self_, *args, **kw)

            monkeypatch.setattr(redis_wire.DirectCluster, command, direct)
        self.inner = svc.state.cache._client._cluster  # the RedisCluster behind DirectCluster
        real_execute = self.inner.execute_command

        def routed(*args: Any, **kwargs: Any) -> Any:
            self.events.append(("routed", str(args[0]).upper()))
            return real_execute(*args, **kwargs)

        monkeypatch.setattr(self.inner, "execute_command", routed)


def _messages(svc: Svc) -> int:
    return int(svc.state.wakeups.channel.listener.messages)


def _eventually(check: Any) -> bool:
    deadline = time.monotonic() + EVENTUALLY
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(check())


def _completed() -> Any:
    from flask_idempotency.records import Completed, StoredResponse

    return Completed(
        "f" * 64,
        int(time.time() * 1000) + 3_600_000,
        StoredResponse(201, (("Content-Type", "application/json"),), b'{"ok": true}\n'),
    )


def _holds(node: Any, name: str) -> bool:
    return redis_cli(node.port, "EXISTS", name).strip() == "1"


def test_i15_c23_a_cluster_completion_is_one_round_trip_on_the_slot_owner(
    make_svc: Any, cluster: RedisCluster3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's ``SET`` and the check for a waiter go pre-packed in one write on the
    connection of the master that owns the record's slot, ``SET`` first (C23), as on one
    node: no second round trip, nothing routed through ``RedisCluster``. Where a waiter in
    another process asked for the wake-up, its shard's ``SPUBLISH`` follows on the same
    connection and the waiter hears it; where none did, nothing is published. Every
    replay comes from the cache."""
    owner, waiter = make_svc(cluster.url), make_svc(cluster.url)
    assert owner.post("warm").status_code == 201
    _listening(waiter)
    keys = [f"one-trip-{n}-{uuid.uuid4().hex[:6]}" for n in range(6)]  # on every shard, likely
    for key in keys[3:]:
        assert waiter.state.wakeups.channel.expect(key_digest(ANONYMOUS_SCOPE, key), 10.0)
    trace = _Trace(monkeypatch, owner)
    heard = _messages(waiter)
    for key in keys[:3]:
        assert owner.post(key).status_code == 201
    assert trace.events == [("together", "SET:bytes", "EXISTS:int")] * 3, trace.events
    time.sleep(0.2)
    assert _messages(waiter) == heard  # nobody waited: no listener was woken
    trace.events.clear()
    for key in keys[3:]:
        assert owner.post(key).status_code == 201
    assert (
        trace.events
        == [
            ("together", "SET:bytes", "EXISTS:int"),
            ("together", "SPUBLISH:int"),
        ]
        * 3
    ), trace.events
    assert _eventually(lambda: _messages(waiter) >= heard + 3)
    owner.sources.clear()
    for key in keys:
        assert owner.post(key).headers["Idempotent-Replayed"] == "true"
    assert owner.sources == ["cache"] * 6, owner.sources


def test_i15_c23_c24_a_slot_moved_under_the_completion_falls_back_to_two_commands(
    make_svc: Any, cluster: RedisCluster3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale slot map sends the pair to a master that no longer owns the record's slot:
    the ``SET`` and the check for a waiter answer ``MOVED``, so nothing is published from
    there. The completion then sends the commands one by one, each routed: the copy lands
    on the slot's real owner, and the wake-up follows it (C23); no outage starts and
    nothing is lost (C24)."""
    owner, waiter = make_svc(cluster.url), make_svc(cluster.url)
    assert owner.post("warm").status_code == 201
    _listening(waiter)
    trace = _Trace(monkeypatch, owner)
    cache, inner = owner.state.cache, trace.inner
    digest = uuid.uuid4().hex * 2
    name = cache.record_name(digest)
    right = inner.get_node_from_key(name)
    wrong = next(node for node in inner.get_primaries() if node.name != right.name)
    real = inner.get_node_from_key
    stale = {name, f"{{{digest}}}"}  # the record's key and its hash tag: where the map errs
    monkeypatch.setattr(
        inner, "get_node_from_key", lambda key, replica=False: wrong if key in stale else real(key)
    )
    assert waiter.state.wakeups.channel.expect(digest, 10.0)
    trace.events.clear()
    heard = _messages(waiter)
    record = _completed()
    owner.state.announce_completed(digest, record)
    assert trace.events[0] == ("together", "SET:MovedError", "EXISTS:MovedError"), trace.events
    assert trace.events[1:] == [
        ("direct", "SET"),
        ("routed", "SET"),  # MOVED again from the stale map: routed to the real owner
        ("direct", "EXISTS"),  # does a waiter expect it? (on the real owner)
        ("direct", "SPUBLISH"),  # after the copy exists (C23)
    ], trace.events
    assert _holds(right, name) and not _holds(wrong, name)
    assert _eventually(lambda: _messages(waiter) >= heard + 1)
    assert not cache.outage_for(digest).down and not cache.outage.down
    assert cache.get(digest) == record


def test_i15_c23_a_shard_channel_on_another_master_goes_as_two_commands(
    make_svc: Any, cluster: RedisCluster3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the slot map no longer puts the record's key and its shard channel on one
    master, nothing is sent together: the ``SET`` and then the ``SPUBLISH`` go as two
    commands, each to its own slot's owner (the ``SPUBLISH`` re-routed on ``MOVED``)."""
    owner, waiter = make_svc(cluster.url), make_svc(cluster.url)
    assert owner.post("warm").status_code == 201
    _listening(waiter)
    trace = _Trace(monkeypatch, owner)
    cache, inner = owner.state.cache, trace.inner
    digest = uuid.uuid4().hex * 2
    route = owner.state.wakeups.channel.route(digest)
    assert route is not None and route[0] == "SPUBLISH"
    channel = route[1]
    right = inner.get_node_from_key(channel)
    wrong = next(node for node in inner.get_primaries() if node.name != right.name)
    real = inner.get_node_from_key
    monkeypatch.setattr(
        inner,
        "get_node_from_key",
        lambda key, replica=False: wrong if key == channel else real(key),
    )
    assert waiter.state.wakeups.channel.expect(digest, 10.0)
    trace.events.clear()
    heard = _messages(waiter)
    owner.state.announce_completed(digest, _completed())
    assert trace.events == [
        ("direct", "SET"),
        ("direct", "EXISTS"),
        ("direct", "SPUBLISH"),
        ("routed", "SPUBLISH"),
    ], trace.events
    name = cache.record_name(digest)
    assert _holds(inner.get_node_from_key(name), name)
    assert _eventually(lambda: _messages(waiter) >= heard + 1)
    assert not cache.outage_for(digest).down


def test_i15_c10_a_sharded_subscriber_reads_only_shards_with_data_and_every_buffered_message(
    cluster: RedisCluster3,
) -> None:
    """The cluster listener polls its shard sockets once and reads only the shards that
    have data, not every shard on every message (a redis-py read costs ~7 us of CPU even
    when nothing is there); two messages that arrive in one read are both delivered,
    though the second is already in the client's buffer where no poll sees it."""
    from flask_idempotency.notify.cluster import ShardedSubscriber
    from flask_idempotency.notify.listener import wait_readable
    from flask_idempotency.redis_clients import cluster_from_url

    subscriber = cluster_from_url(cluster.url, socket_timeout=10.0, connect_timeout=1.0)
    publisher = cluster_from_url(cluster.url, socket_timeout=1.0, connect_timeout=1.0)
    base = f"idem:sharded-read-{uuid.uuid4().hex[:6]}:done"

    def channel(tag: str) -> str:
        return f"{base}:{{{tag}}}"

    pubsub = ShardedSubscriber(subscriber, channel).pubsub()
    try:
        pubsub.subscribe(base)
        deadline = time.monotonic() + EVENTUALLY
        while (pubsub.get_message(timeout=0.5) or {}).get("type") != "subscribe":
            assert time.monotonic() < deadline, "no subscribe acknowledgement"
        while pubsub.get_message(timeout=0.0) is not None:
            pass
        reads = collections.Counter[str]()
        for name, shard in pubsub._subs.items():
            real_get = shard.get_message

            def counted(*args: Any, _n: str = name, _g: Any = real_get, **kwargs: Any) -> Any:
                reads[_n] += 1
                return _g(*args, **kwargs)

            shard.get_message = counted
        busy, tag = next(iter(pubsub._tags.items()))
        node = publisher.get_node(node_name=busy)
        pipe = publisher.get_redis_connection(node).pipeline(transaction=False)
        pipe.spublish(channel(tag), "first")
        pipe.spublish(channel(tag), "second")
        assert pipe.execute() == [1, 1]
        assert wait_readable(pubsub.sockets() or [], EVENTUALLY)
        time.sleep(0.05)  # both messages in the socket: one read takes them both
        got = []
        while len(got) < 2 and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=1.0)
            if message is not None and message["type"] == "message":
                got.append(message["data"])
        assert got == [b"first", b"second"]
        assert set(reads) == {busy}, reads  # the quiet shards were never read
    finally:
        pubsub.close()
        subscriber.close()
        publisher.close()


# -- C10 ------------------------------------------------------------------------------------


def _wake_by_message(
    owner: Svc, waiter: Svc, key: str, while_parked: Any = lambda: time.sleep(0.05)
) -> float:
    """The owner holds ``key``; the waiter parks; ``while_parked()``; the owner finishes:
    seconds to wake."""
    owner.gate.clear()
    owner.entered.clear()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(owner.post, key)
        assert owner.entered.wait(EVENTUALLY)
        second = pool.submit(waiter.post, key)
        deadline = time.monotonic() + EVENTUALLY
        while waiter.state.wakeups.parked_count == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        while_parked()
        released = time.monotonic()
        owner.gate.set()
        assert first.result(EVENTUALLY).status_code == 201
        answer = second.result(EVENTUALLY)
        woke = time.monotonic() - released
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.headers["Idempotent-Replayed"] == "true"
    return woke


def _listening(svc: Svc) -> None:
    hub = svc.state.wakeups
    with svc.app.app_context():
        assert hub.channel.ensure_listening(hub) or hub.channel.listener.wait_until_live(EVENTUALLY)


def test_i15_c10_wakeups_cross_processes_by_message_on_every_topology(
    make_svc: Any, topology_url: str, no_poll_ticks: None
) -> None:
    """A duplicate parked in another process is woken by the owner's message, never by
    polling (polls are 10 minutes apart here): on a cluster, for records on every shard
    (sharded pub/sub, one channel per master; C10, C48)."""
    owner = make_svc(topology_url)
    waiter = make_svc(topology_url, IDEMPOTENCY_REDIS_PREFIX="idem")  # same store, own app
    _listening(waiter)
    woke = [_wake_by_message(owner, waiter, f"wake-{n}-{uuid.uuid4().hex[:6]}") for n in range(6)]
    assert max(woke) < 5.0, woke
    assert sum(owner.calls.values()) == 6 and sum(waiter.calls.values()) == 0


# -- C24: a node lost, a failover, mid-load ----------------------------------------------


def _load(svc: Svc, seconds: float, during: Any) -> tuple[collections.Counter[int], list[str]]:
    """Unique keys, each sent three times by concurrent clients, while ``during`` runs."""
    statuses: collections.Counter[int] = collections.Counter()
    keys: list[str] = []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client(n: int) -> None:
        i = 0
        while time.monotonic() < stop:
            key = f"load-{n}-{i}-{uuid.uuid4().hex[:4]}"
            i += 1
            with lock:
                keys.append(key)
            for _ in range(3):
                status = svc.post(key).status_code
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    during()
    for t in threads:
        t.join(EVENTUALLY * 2)
    return statuses, keys


def test_i15_c24_a_cluster_master_killed_mid_load_changes_no_outcome(
    make_svc: Any, tmp_path: Any
) -> None:
    """A master of the cluster SIGKILLed under load: no 5xx, one execution per key; the
    other shards keep caching (C24, C48)."""
    group = _started(RedisCluster3(redis_server_binary(), tmp_path / "doomed"))
    try:
        svc = make_svc(group.url)
        statuses, keys = _load(svc, 6.0, lambda: (time.sleep(2.0), group.nodes[1].kill()))
        assert set(statuses) == {201}, statuses
        assert all(svc.calls[key] == 1 for key in keys)
        after = [f"after-{n}" for n in range(30)]
        for key in after:
            svc.post(key)
        cached_before = svc.sources.count("cache")
        for key in after:
            assert svc.post(key).headers["Idempotent-Replayed"] == "true"
        assert svc.sources.count("cache") - cached_before >= 10  # two shards of three serve
    finally:
        group.stop()


def _sentinel_svc(make_svc: Any, group: SentinelGroup, form: str) -> Any:
    """An app on the Sentinel group, by URL or by ``redis=Sentinel(...).master_for(...)``."""
    if form == "url":
        return make_svc(group.url)
    from redis.sentinel import Sentinel

    sentinels = Sentinel([("127.0.0.1", s.port) for s in group.sentinels], socket_timeout=1.0)
    return make_svc(None, client=sentinels.master_for(group.service, socket_timeout=1.0))


def _subscribers_on(port: int, channel: str) -> int:
    out = redis_cli(port, "PUBSUB", "NUMSUB", channel).split()
    return int(out[1]) if len(out) > 1 else 0


def test_i15_c24_c10_a_cluster_master_killed_its_replica_promoted_serves_and_wakes_again(
    make_svc: Any, tmp_path: Any, no_poll_ticks: None
) -> None:
    """3 masters + 3 replicas; a master SIGKILLed under load and its replica promoted: no
    5xx, one execution per key; afterwards replays come from the cache on every shard and
    waiters are woken by message from every shard, the promoted one included (the
    per-shard listener follows the new master; C24, C22, C10)."""
    group = _started(RedisCluster3(redis_server_binary(), tmp_path / "replicated", replicas=1))
    try:
        svc = make_svc(group.url)
        waiter = make_svc(group.url)
        _listening(waiter)
        doomed = group.masters()[1]
        statuses, keys = _load(svc, 6.0, lambda: (time.sleep(2.0), doomed.kill()))
        assert set(statuses) == {201}, statuses
        assert all(svc.calls[key] == 1 for key in keys)
        promoted = group.wait_promoted(doomed)
        deadline = time.monotonic() + EVENTUALLY
        n = 0
        cached_in_a_row = 0
        while True:
            # The listener re-reads the slot map and subscribes on the new master, and the
            # cache leaves the dead shard's back-off: both in their own time, so wait for
            # both (15 replays in a row from the cache: a shard still dark would have been
            # hit with a chance of 1 - (2/3)**15, over 99.7 %).
            listener = waiter.state.wakeups.channel.listener
            if listener.live and listener.subscriptions >= 2 and cached_in_a_row >= 15:
                break
            assert time.monotonic() < deadline, "the cluster did not recover from the promotion"
            n += 1
            key = f"after-promotion-warmup-{n}-{uuid.uuid4().hex[:6]}"
            svc.post(key)
            before = svc.sources.count("cache")
            svc.post(key)
            cached_in_a_row = cached_in_a_row + 1 if svc.sources.count("cache") > before else 0
            if cached_in_a_row < 15:
                time.sleep(0.05)
        after = [f"after-promotion-{n}-{uuid.uuid4().hex[:6]}" for n in range(30)]
        for key in after:
            assert svc.post(key).status_code == 201
        cached_before = svc.sources.count("cache")
        for key in after:
            assert svc.post(key).headers["Idempotent-Replayed"] == "true"
        assert svc.sources.count("cache") - cached_before >= 0.95 * len(after)
        assert int(promoted.cli("DBSIZE").strip() or 0) > 0  # records landed on the new master
        woke = [
            _wake_by_message(svc, waiter, f"after-promotion-wake-{n}-{uuid.uuid4().hex[:6]}")
            for n in range(9)
        ]
        assert max(woke) < 5.0, woke
    finally:
        group.stop()


@pytest.mark.parametrize("form", ["url", "client"])
def test_i15_c24_a_sentinel_failover_mid_load_changes_no_outcome_and_wakeups_follow(
    make_svc: Any, sentinel_group: SentinelGroup, no_poll_ticks: None, form: str
) -> None:
    """``SENTINEL FAILOVER`` under load: no 5xx, one execution per key, and afterwards
    the listener is subscribed on the new master and wakes waiters from it by message,
    for the URL form and for a given ``Sentinel.master_for()`` client (C24, C10)."""
    svc = _sentinel_svc(make_svc, sentinel_group, form)
    waiter = _sentinel_svc(make_svc, sentinel_group, form)
    _listening(waiter)
    channel = waiter.state.wakeups.channel.channel
    assert _subscribers_on(sentinel_group.master_port(), channel) >= 1
    new_master: list[int] = []
    statuses, keys = _load(
        svc, 6.0, lambda: (time.sleep(2.0), new_master.append(sentinel_group.failover()))
    )
    assert set(statuses) == {201}, statuses
    assert all(svc.calls[key] == 1 for key in keys)
    deadline = time.monotonic() + EVENTUALLY
    while True:  # the subscriber notices the new master within a heartbeat or two
        listener = waiter.state.wakeups.channel.listener
        if listener.live and _subscribers_on(new_master[0], channel) >= 1:
            break
        assert time.monotonic() < deadline, "the listener did not follow the new master"
        time.sleep(0.1)
    n = 0
    while svc.state.cache.outage.down:  # the command client's back-off ends
        assert time.monotonic() < deadline, "the cache never came back after the failover"
        n += 1
        svc.post(f"after-failover-warmup-{n}")
        time.sleep(0.2)
    woke = _wake_by_message(svc, waiter, f"after-failover-{uuid.uuid4().hex[:6]}")
    assert woke < 5.0
    sentinel_group.wait_settled()


def test_i15_c10_a_given_sentinel_client_subscribes_where_its_sentinels_say_the_master_is(
    make_svc: Any, sentinel_group: SentinelGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``redis=Sentinel(...).master_for(...)``: when the sentinels name a new master while
    the old one keeps our connection open (they could not reach it to drop its clients:
    a partition), the listener moves to the new master within a topology check, as the URL
    form does, instead of listening where nobody publishes any more (C10, C24)."""
    from redis.sentinel import Sentinel

    sentinels = Sentinel([("127.0.0.1", s.port) for s in sentinel_group.sentinels])
    waiter = make_svc(None, client=sentinels.master_for(sentinel_group.service))
    _listening(waiter)
    channel = waiter.state.wakeups.channel.channel
    master = sentinel_group.master_port()
    other = (
        sentinel_group.replica.port
        if master == sentinel_group.master.port
        else sentinel_group.master.port
    )
    assert _subscribers_on(master, channel) == 1
    monkeypatch.setattr(sentinels, "discover_master", lambda service: ("127.0.0.1", other))
    deadline = time.monotonic() + 10.0
    while _subscribers_on(other, channel) < 1:
        assert time.monotonic() < deadline, "the listener stayed on the old master"
        time.sleep(0.1)
    assert _subscribers_on(master, channel) == 0


# -- 15.6: double fault ---------------------------------------------------------------------


def test_i15_6_c25_database_down_while_redis_backs_off_still_replays_from_the_cache(
    make_svc: Any, pg_url: URL, single_node: RedisServer
) -> None:
    """Redis failed a moment ago (the tier is in its back-off) and is healthy again; then
    the database is cut: a replay is answered from the cache after one probe, not 503."""
    pg_proxy = TcpProxy(pg_url.host or "127.0.0.1", pg_url.port or 5432).start()
    redis_proxy = TcpProxy("127.0.0.1", single_node.port).start()
    try:
        database = pg_url.set(host="127.0.0.1", port=pg_proxy.port)
        svc = make_svc(
            f"redis://127.0.0.1:{redis_proxy.port}/0",
            database_url=database.render_as_string(hide_password=False),
        )
        first = svc.post("double-fault")
        assert first.status_code == 201
        redis_proxy.cut()
        assert svc.post("double-fault").status_code == 201  # Redis fails: back-off begins
        assert svc.state.cache.outage.down
        redis_proxy.restore()
        pg_proxy.cut()
        svc.state.store.engine.dispose()
        replay = svc.post("double-fault")
        assert replay.status_code == 201, replay.get_data(as_text=True)
        assert replay.headers["Idempotent-Replayed"] == "true" and replay.data == first.data
        assert svc.post("never-seen").status_code == 503
    finally:
        pg_proxy.restore()
        redis_proxy.stop()
        time.sleep(0.1)
        pg_proxy.stop()


# -- issue 22 item 2: a shorter waiter never cancels another's wake-up (C53) -------------------


def test_i22_2_c53_a_later_shorter_wait_never_shortens_the_waiting_mark_on_every_topology(
    make_svc: Any, topology_url: str
) -> None:
    """All waiters of a record share one waiting mark: a later waiter with a shorter wait
    leaves the longer expiry in place, and a longer one extends it (C53)."""
    svc = make_svc(topology_url)
    notifier = svc.state.wakeups.channel
    digest = key_digest(ANONYMOUS_SCOPE, f"mark-{uuid.uuid4().hex}")
    name = notifier.waiting_name(digest)
    assert notifier.expect(digest, 10.0)
    assert notifier.expect(digest, 0.2)  # a once(wait=0.2), or an app with a shorter wait
    assert 9_000 < notifier._client.pttl(name) <= 11_000
    assert notifier.expect(digest, 30.0)
    assert 29_000 < notifier._client.pttl(name) <= 31_000


def test_i22_2_c53_c10_a_shorter_waiter_does_not_cancel_a_longer_ones_wakeup_on_every_topology(
    make_svc: Any, topology_url: str, no_poll_ticks: None
) -> None:
    """A waiter parks for 20 s; another one, in an app whose wait is 0.3 s (another version
    mid-deploy), parks after it and gives up with 409. Past the short waiter's mark (its
    wait and a second), the original finishes: the long waiter is still woken by message,
    not left to its 20 s (polls are 10 minutes apart here; C53, C10)."""
    owner = make_svc(topology_url)
    waiter = make_svc(topology_url)
    brief = make_svc(topology_url, IDEMPOTENCY_WAIT=0.3)
    _listening(waiter)

    def a_shorter_waiter_comes_and_goes() -> None:
        assert brief.post(key).status_code == 409
        time.sleep(1.6)  # the short waiter's own wait and its mark's margin have passed

    key = f"short-and-long-{uuid.uuid4().hex[:6]}"
    woke = _wake_by_message(owner, waiter, key, a_shorter_waiter_comes_and_goes)
    assert woke < 5.0, woke


# -- issue 22 item 3: a cached copy never outlives its record (C53, C21, C42) ------------------


def _late(call: Any) -> Any:
    """``call``, a quarter of a second late."""

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.25)
        return call(*args, **kwargs)

    return slowed


def _completed_copies_expire_with_their_records(svc: Svc) -> None:
    """Three first executions; each one's cached copy has no more time left than its
    record by the database clock (three records: on a cluster, most likely on two shards
    or three)."""
    for n in range(3):
        key = f"expiry-{n}-{uuid.uuid4().hex[:6]}"
        assert svc.post(key).status_code == 201
        digest = key_digest(ANONYMOUS_SCOPE, key)
        row = svc.state.store.get(digest)
        left = svc.state.clock.remaining_ms(row.expires_at_ms)
        copy_left = svc.state.cache._client.pttl(svc.state.cache.record_name(digest))
        assert 0 < copy_left <= left + 5, (copy_left, left)


def test_i22_3_c53_a_completions_copy_expires_with_its_record_however_slow_the_encoding(
    make_svc: Any, topology_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's copy (one round trip with the check for a waiter; on a cluster, on
    the slot owner's connection) lives no longer than its record has left by the database
    clock, even when encoding the value takes a quarter of a second (a large body on a
    busy worker): the time it has left is read after encoding (C53, C21, C42)."""
    from flask_idempotency.cache import redis as cache_redis

    svc = make_svc(topology_url)
    monkeypatch.setattr(cache_redis, "encode_value", _late(cache_redis.encode_value))
    _completed_copies_expire_with_their_records(svc)


def test_i22_3_c53_a_completion_late_on_its_way_to_redis_gets_its_expiry_set_again(
    make_svc: Any, topology_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's ``SET`` reaches Redis a quarter of a second after its ``PX`` was
    read (a slow link, a worker thread off the CPU): it took longer than the margin to
    answer, so its expiry is set again, and the copy still expires with its record
    (C53, C42). Each topology's path is slowed: the pre-packed pair on one node and on
    a cluster's slot owner, the pipeline of a Sentinel client."""
    import redis.client

    from flask_idempotency._wire import redis as wire

    monkeypatch.setattr(wire._Reader, "set_and_wake", _late(wire._Reader.set_and_wake))
    monkeypatch.setattr(wire.DirectCluster, "set_and_wake", _late(wire.DirectCluster.set_and_wake))
    monkeypatch.setattr(redis.client.Pipeline, "execute", _late(redis.client.Pipeline.execute))
    svc = make_svc(topology_url)
    _completed_copies_expire_with_their_records(svc)
