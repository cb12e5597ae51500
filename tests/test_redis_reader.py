"""The cache's own ``GET`` on a plain client (issue 11): as safe as ``client.get``.

A replay from Redis reads through :class:`~flask_idempotency._wire.redis._Reader`,
which keeps pooled connections aside instead of checking them out of redis-py's
pool on every read. Each test names the guarantee it keeps: a stale socket after
a Redis restart is retried once and starts no outage, a timeout is an outage
(C24) and the timed-out connection is never read again, a forked child never
uses its parent's sockets, and a value without the store's MAC (an earlier
release's included) is a miss (C60). Real redis-server (the fast path is for real
clients only).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from flask_idempotency import redis_clients
from flask_idempotency._wire import redis as redis_wire
from flask_idempotency.cache import codec
from flask_idempotency.cache.redis import RedisCache
from flask_idempotency.records import Completed, StoredResponse

RECORD = Completed(
    "f" * 64,
    4_102_444_800_000,
    StoredResponse(201, (("Content-Type", "application/json"),), b'{"id": "pay_1"}\n\x00\xff'),
)


def fast_cache(url: str, timeout: float = 0.5) -> RedisCache:
    client = redis_clients._client_from_url(url, socket_timeout=timeout, connect_timeout=timeout)
    cache = RedisCache(client, prefix="reader", origin="o" * 16)
    assert cache._reader is not None, "a client from a URL reads through the fast path"
    return cache


def test_c9_c60_round_trip_is_exact_and_a_value_without_a_mac_is_a_miss(redis_server):
    """C9: what the cache writes it reads back exactly. C60: values of earlier releases
    (JSON, or the line form without a MAC) and a sealed value moved to another record's
    key are misses, read from the database, not errors."""
    cache = fast_cache(redis_server.url)
    cache.promote("d1", RECORD, 60_000)
    assert cache.get("d1") == RECORD
    assert cache.get("absent") is None
    origin = cache.origin.encode()
    sealed = cache._client.get(cache.record_name("d1"))
    unsealed = origin + b"\n2\n" + sealed.split(b"\n", 3)[3]  # the line form of before
    for value in (origin + b"\n" + RECORD.to_json(), unsealed, sealed):
        cache._client.set(cache.record_name("d2"), value, px=60_000)
        assert cache.get("d2") is None
    assert not cache.outage.down


def test_c41_a_value_of_another_origin_is_a_miss(redis_server):
    cache = fast_cache(redis_server.url)
    other = RedisCache(cache._client, prefix="reader", origin="x" * 16)
    other.promote("d1", RECORD, 60_000)
    assert other.get("d1") == RECORD
    assert cache.get("d1") is None


def test_c24_a_restart_leaves_stale_sockets_that_are_retried_once_not_an_outage(redis_server):
    cache = fast_cache(redis_server.url)
    cache.promote("d1", RECORD, 60_000)
    assert cache.get("d1") == RECORD
    kept = list(cache._reader._idle)
    assert kept, "the connection is kept aside for the next read"
    redis_server.restart()
    assert cache.get("d1") is None  # a new, empty server: a miss, not an error
    assert not cache.outage.down
    cache.promote("d1", RECORD, 60_000)
    assert cache.get("d1") == RECORD


def test_c23_commands_sent_together_each_get_their_own_reply_and_an_error_reply_is_kept(
    redis_server,
):
    """``run_together`` (the cluster's ``SET`` + ``SPUBLISH``): an error reply to one
    command is handed back, not raised, and the replies after it are still read, so the
    connection stays in step and is reused."""
    import redis

    cache = fast_cache(redis_server.url)
    reader = cache._reader
    replies = reader.run_together(
        [("SET", "together", "v"), ("INCR", "together"), ("GET", "together")]
    )
    assert replies[0] == b"OK" and replies[2] == b"v"
    assert isinstance(replies[1], redis.ResponseError)
    kept = list(reader._idle)
    assert kept and all(conn._sock is not None for conn in kept)
    assert reader.get(b"together") == b"v"  # the same connection, reply by reply in step
    assert reader._idle == kept


def test_c24_a_cluster_node_reader_does_not_resend_on_a_broken_connection(redis_server):
    """A reader made with ``retry_broken=False`` (a cluster node's) raises on a stale socket
    instead of resending: ``DirectCluster`` re-routes through the cluster client, which
    refreshes its slot map first."""
    import redis

    client = redis_clients._client_from_url(
        redis_server.url, socket_timeout=0.5, connect_timeout=0.5
    )
    reader = redis_wire._Reader(client.connection_pool, retry_broken=False)
    assert reader.get(b"absent") is None
    redis_server.restart()
    with pytest.raises(redis.ConnectionError):
        reader.get(b"absent")
    assert reader.get(b"absent") is None  # that socket was closed; the next one is new


def test_c24_a_silent_server_times_out_into_an_outage_and_the_socket_is_closed():
    """A Redis that accepts and never answers costs one timeout, then the back-off."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        client = redis_clients._client_from_url(
            f"redis://127.0.0.1:{port}/0", socket_timeout=0.2, connect_timeout=0.2
        )
        # Built on a client whose handshake never happens: no HELLO/CLIENT calls on connect.
        client.connection_pool.connection_kwargs["protocol"] = 2
        cache = RedisCache(client, prefix="reader", origin="o" * 16)
        assert cache._reader is not None
        started = time.monotonic()
        assert cache.get("d1") is None
        assert time.monotonic() - started < 2.0
        assert cache.outage.down
        assert all(conn._sock is None for conn in cache._reader._idle)  # closed, never reread
        assert cache.get("d1") is None  # in the back-off: Redis is not asked
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_never_reads_on_its_parents_sockets(redis_server):
    cache = fast_cache(redis_server.url)
    cache.promote("d1", RECORD, 60_000)
    assert cache.get("d1") == RECORD
    parent_sockets = {id(conn._sock) for conn in cache._reader._idle}
    parent_conns = list(cache._reader._idle)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            ok = cache.get("d1") == RECORD
            fresh = all(conn not in parent_conns for conn in cache._reader._idle)
            code = 0 if ok and fresh and not cache.outage.down else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 1)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert answer == b"\x00"
    # The parent's connections are untouched by the child and still work.
    assert {id(conn._sock) for conn in cache._reader._idle} == parent_sockets
    assert cache.get("d1") == RECORD


def test_only_plain_clients_take_the_fast_path(redis_server):
    import fakeredis
    import redis

    assert redis_wire._reader_for(fakeredis.FakeRedis()) is None
    pinned = redis.Redis.from_url(redis_server.url, single_connection_client=True)
    try:
        assert redis_wire._reader_for(pinned) is None
    finally:
        pinned.close()

    class Wrapped:
        def __getattr__(self, name: str) -> Any:
            raise redis.TimeoutError("never asked")

    assert redis_wire._reader_for(Wrapped()) is None
    one = redis.Redis.from_url(redis_server.url)
    try:
        assert redis_wire._reader_for(one) is redis_wire._reader_for(
            redis.Redis(connection_pool=one.connection_pool)
        )
    finally:
        one.close()


def test_c24_connections_kept_aside_are_bounded(redis_server):
    cache = fast_cache(redis_server.url)
    cache.promote("d1", RECORD, 60_000)
    barrier = threading.Barrier(24)
    results: list[Any] = []

    def read() -> None:
        barrier.wait(10)
        results.append(cache.get("d1"))

    threads = [threading.Thread(target=read) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert results == [RECORD] * 24
    assert len(cache._reader._idle) <= cache._reader._kept <= 16


@given(
    st.builds(
        Completed,
        st.text(alphabet="0123456789abcdef", min_size=1, max_size=64),
        st.integers(min_value=0, max_value=2**62),
        st.builds(
            StoredResponse,
            st.integers(min_value=100, max_value=599),
            st.lists(
                st.tuples(
                    st.sampled_from(["Content-Type", "location", "ETAG", "Content-Encoding"]),
                    st.text(alphabet=st.characters(exclude_categories=["Cc"]), max_size=40),
                ),
                max_size=4,
            ).map(tuple),
            st.binary(max_size=200),
            st.booleans(),
        ),
    )
)
def test_c9_the_cached_value_decodes_to_exactly_the_record(record):
    """Any record the app could have stored (allow-listed headers, no control characters
    in their values) comes back exactly as it went in, its MAC checked (C60)."""
    where = {"origin": b"o" * 16, "name": b"idem:o:{d}", "mac": MAC}
    value = codec.encode_value(record, **where)
    assert codec.decode_value(value, headers=ALLOWED, **where) == record


MAC = codec.ValueMac(b"a store's secret")


ALLOWED = codec.ReplayHeaders(["content-type", "location", "etag", "content-encoding"])


@given(st.binary(max_size=300), st.booleans())
@example(b"f\n1\n201\n0\n" + b"[" * 5000 + b"\n", True)
@example(b"f\n1\n201\n0\n[[1]]\n", True)
@example(b"f\n1\n201\n2\n[]\n", True)
@example(b"f\n1\n0\n0\n[]\n", True)
@example(b'f\n1\n201\n0\n[["Set-Cookie","a=b"]]\n', True)
@example(b"f\n1\n201\n0\n[]\n", False)
def test_c24_garbage_in_the_new_form_is_a_miss_never_an_error(content, sealed):
    """Anything after the origin, sealed with the store's own MAC (what only a bug of
    ours could write) or not (anyone else), is a miss or a record, never an error."""
    cache = RedisCache(object(), origin="o" * 16)
    name = cache.record_name("d" * 64).encode()
    tag = cache._value_mac().tag(name, content) if sealed else b"x" * 44
    decoded = cache._decode(b"o" * 16 + b"\n3\n" + tag + b"\n" + content, "d" * 64)
    assert decoded is None or isinstance(decoded, Completed)


def test_c47_a_reader_and_its_connections_go_with_their_client(redis_server):
    """Apps come and go (tests, app factories): their kept connections must not stay."""
    import gc
    import weakref

    cache = fast_cache(redis_server.url)
    cache.promote("d1", RECORD, 60_000)
    assert cache.get("d1") == RECORD
    pool = weakref.ref(cache._client.connection_pool)
    reader = weakref.ref(cache._reader)
    kept = [weakref.ref(conn) for conn in cache._reader._idle]
    assert kept
    del cache
    # Two passes: where the client sits in a reference cycle (redis-py 5), its finalizer
    # runs inside the first collection, which has already judged the pool and reader
    # reachable through it; the second frees them. A leak survives both.
    gc.collect()
    gc.collect()
    assert pool() is None and reader() is None
    assert all(conn() is None for conn in kept)


@given(
    name=st.text(min_size=1, max_size=80),
    value=st.one_of(st.binary(max_size=300), st.binary(min_size=5990, max_size=6100)),
    ttl_ms=st.one_of(st.integers(min_value=-5, max_value=3), st.integers(min_value=1)),
    waiting=st.text(min_size=1, max_size=80),
)
@example(name="idem:o:{d}", value=b"x" * 7000, ttl_ms=60_000, waiting="idem:o:waiting:{d}")
def test_c23_the_completions_pre_packed_commands_are_what_redis_py_packs(
    name, value, ttl_ms, waiting
):
    """The completion's ``SET … PX`` and ``EXISTS`` are packed by hand: the bytes sent are
    exactly those of redis-py's ``pack_commands`` (a long value a piece of its own, as
    there), in the client's name encoding, and nothing is set when no time is left."""
    import redis

    conn = redis.Connection()
    commands: list[tuple[Any, ...]] = [("EXISTS", waiting)]
    if ttl_ms > 0:
        commands.insert(0, ("SET", name, value, "PX", ttl_ms))
    packed = redis_wire._set_and_exists(name, value, ttl_ms, waiting, ("utf-8", "strict"))
    assert b"".join(packed) == b"".join(conn.pack_commands(commands))
    assert len(packed) == (3 if ttl_ms > 0 and len(value) > 6000 else 1)


def test_c10_a_completion_publishes_its_wake_up_only_when_a_waiter_marked_it(redis_server):
    """``set_and_wake`` builds and sends the wake-up only when the waiting mark is there;
    both commands' replies are read either way, so the connection stays in step."""
    cache = fast_cache(redis_server.url)
    reader = cache._reader
    built: list[str] = []

    def publish() -> tuple[Any, ...]:
        built.append("publish")
        return ("PUBLISH", "reader:done", "x")

    reader.set_and_wake("reader:{d1}", b"v1", 60_000, "reader:waiting:{d1}", publish)
    assert built == [] and cache._client.get("reader:{d1}") == b"v1"
    cache._client.set("reader:waiting:{d1}", b"1", px=60_000)
    reader.set_and_wake("reader:{d1}", b"v2", 60_000, "reader:waiting:{d1}", publish)
    assert built == ["publish"] and cache._client.get("reader:{d1}") == b"v2"
    reader.set_and_wake("reader:{d1}", b"v3", 0, "reader:waiting:{d1}", publish)
    assert built == ["publish", "publish"] and cache._client.get("reader:{d1}") == b"v2"
    assert reader.get(b"reader:{d1}") == b"v2"  # the kept connection is in step
