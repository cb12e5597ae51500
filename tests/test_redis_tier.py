"""The Redis tier on fakeredis (fast): read path, promotion, degradation, wake-up races.

Each test names the rule it checks (C7, C9, C10, C22–C24, C30; races X1, X2 of
research/spec.md §6.5). The same behaviour against a real redis-server and
PostgreSQL is proven in ``test_redis_real.py``.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import fakeredis
import pytest
import redis
from flask import jsonify, request

from flask_idempotency import idempotent, signals
from flask_idempotency.cache.codec import ReplayHeaders
from flask_idempotency.cache.outage import Outage, report_failure
from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest
from flask_idempotency.notify import PollSchedule, WakeupHub, listener
from flask_idempotency.notify import hub as wakeup
from flask_idempotency.records import Completed, StoredResponse
from flask_idempotency.tier import RedisTier
from tests.support.waiting import wait_until as _wait_until

RAW_KEY = "raw-key-7Qx!secret"
EVENTUALLY = 30.0


@pytest.fixture(autouse=True)
def _stop_listeners() -> Iterator[None]:
    """No listener thread outlives its test."""
    yield
    listener.stop_all()
    assert not [t for t in threading.enumerate() if t.name == "flask-idempotency-wakeups"]


@pytest.fixture
def server() -> fakeredis.FakeServer:
    return fakeredis.FakeServer()


def build(make_app: Callable[..., Any], client: Any, **config: Any) -> SimpleNamespace:
    """An app with one protected view whose executions are counted and can be held."""
    settings = {"IDEMPOTENCY_WAIT": 10}
    settings.update({f"IDEMPOTENCY_{name.upper()}": value for name, value in config.items()})
    app, ext = make_app(settings, redis=client)
    calls: list[int] = []
    gate = threading.Event()
    gate.set()
    entered = threading.Event()

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        entered.set()
        assert gate.wait(EVENTUALLY)
        body = request.get_json(silent=True) or {}
        if body.get("fail"):
            return jsonify(error="failed"), 500
        return jsonify(n=len(calls), amount=body.get("amount")), 201

    return SimpleNamespace(
        app=app,
        ext=ext,
        calls=calls,
        gate=gate,
        entered=entered,
        state=app.extensions["idempotency"],
        tier=app.extensions["idempotency"].cache,
        notifier=app.extensions["idempotency"].wakeups.channel,
    )


def post(env: SimpleNamespace, amount: int = 10, key: str = RAW_KEY, **extra: Any) -> Any:
    return env.app.test_client().post(
        "/pay", json={"amount": amount, **extra}, headers={"Idempotency-Key": key}
    )


def digest_of(key: str = RAW_KEY) -> str:
    return key_digest(ANONYMOUS_SCOPE, key)


@contextmanager
def replay_sources(env: SimpleNamespace) -> Iterator[list[str]]:
    sources: list[str] = []

    def record(sender: Any, **extra: Any) -> None:
        sources.append(extra["source"])

    with signals.request_replayed.connected_to(record, sender=env.app):
        yield sources


def delete_durable_row(env: SimpleNamespace) -> None:
    table = env.state.store.table
    with env.state.store.engine.begin() as conn:
        conn.execute(table.delete())


wait_for = functools.partial(_wait_until, within=EVENTUALLY)


def published(subscriber: Any, timeout: float) -> list[bytes]:
    """The payloads a test subscriber received within ``timeout`` (skipping acknowledgements)."""
    payloads: list[bytes] = []
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        message = subscriber.get_message(timeout=min(remaining, 0.1))
        if message is not None and message["type"] == "message":
            payloads.append(message["data"])
    return payloads


def assert_expires_with(expire_at_ms: int, row: Any) -> None:
    """A cached copy lives as long as its record has left by the database clock, never
    longer, and at most a moment less (the promote's round trip, C42)."""
    assert row.expires_at_ms - 2000 <= expire_at_ms <= row.expires_at_ms + 5


def cached_json(raw: bytes) -> Any:
    """The fields of a cached value as a dict: its format version (``3``: sealed with a
    MAC, C60), fingerprint and expiry (after the origin line, C41)."""
    origin, version, mac, fingerprint, expires, *_ = raw.split(b"\n")
    assert len(origin) == 16 and len(mac) == 44
    return {"v": int(version), "fp": fingerprint.decode(), "exp": int(expires)}


#: Every header these tests' apps store, for a look at what the cache holds.
ANY_STORED = ReplayHeaders(["content-type", "content-encoding", "x-request-cost"])


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(target()))
    thread.start()
    return thread, result


# -- read path ------------------------------------------------------------------------


def test_c22_cache_hit_replays_without_view_or_database(make_app, server):
    env = build(make_app, fakeredis.FakeRedis(server=server))
    first = post(env)
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    delete_durable_row(env)  # only Redis can answer now
    with replay_sources(env) as sources:
        again = post(env)
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert sources == ["cache"]
    assert env.calls == [1]


def test_c7_cache_hit_with_another_body_is_422(make_app, server):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    post(env, amount=10)
    cached = client.get(env.tier.record_name(digest_of()))
    delete_durable_row(env)
    reused = post(env, amount=99)
    assert reused.status_code == 422
    assert reused.json["code"] == "key-reused"
    assert env.calls == [1]
    assert client.get(env.tier.record_name(digest_of())) == cached


def test_c22_miss_reads_database_and_promotes_with_the_record_expiry(make_app, server):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    first = post(env)
    client.flushall()
    with replay_sources(env) as sources:
        again = post(env)
    assert again.status_code == 201 and again.data == first.data
    assert sources == ["database"]
    row = env.state.store.get(digest_of())
    assert_expires_with(client.pexpiretime(env.tier.record_name(digest_of())), row)
    with replay_sources(env) as sources:
        post(env)
    assert sources == ["cache"]
    assert env.calls == [1]


def test_c23_completion_promotes_with_pxat_and_publishes_done(make_app, server):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client, ttl=600)
    subscriber = client.pubsub()
    subscriber.subscribe(env.notifier.channel)
    assert env.notifier.expect(digest_of(), 5.0)  # a waiter elsewhere asks for the wake-up
    try:
        post(env)
        row = env.state.store.get(digest_of())
        name = env.tier.record_name(digest_of())
        assert_expires_with(client.pexpiretime(name), row)
        assert 0 < client.pttl(name) <= 600_000
        messages = published(subscriber, 1.0)
    finally:
        subscriber.close()
    assert [json.loads(m) for m in messages] == [{"k": digest_of(), "e": "done"}]
    cached = cached_json(client.get(name))
    assert cached["exp"] == row.expires_at_ms and cached["fp"] == row.fingerprint


def test_c22_in_progress_and_absence_are_never_cached(make_app, server):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    assert post(env, key="missing-then-failed", fail=True).status_code == 500  # released
    assert client.keys("*") == []
    env.entered.clear()
    env.gate.clear()
    owner, result = in_thread(lambda: post(env))
    assert env.entered.wait(EVENTUALLY)
    assert env.state.store.get(digest_of()).state == "in_progress"
    assert client.keys("*") == []  # the claim lives only in the database
    env.gate.set()
    owner.join(EVENTUALLY)
    assert result[0].status_code == 201
    assert client.keys("*") == [env.tier.record_name(digest_of()).encode()]


def test_c30_no_raw_key_in_redis_names_values_or_messages(make_app, server):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    subscriber = client.pubsub()
    subscriber.subscribe(env.notifier.channel)
    for key in (RAW_KEY, RAW_KEY + "-2"):  # waiters elsewhere ask for both wake-ups
        assert env.notifier.expect(digest_of(key), 5.0)
    try:
        post(env)
        post(env)
        post(env, key=RAW_KEY + "-2", fail=True)  # a release publishes too
        messages = published(subscriber, 1.0)
    finally:
        subscriber.close()
    assert len(messages) == 2
    assert {json.loads(m)["e"] for m in messages} == {"done", "released"}
    names = client.keys("*")
    assert names
    blobs = names + [client.get(name) for name in names] + messages
    for blob in blobs:
        assert RAW_KEY.encode() not in blob
        assert ANONYMOUS_SCOPE.encode() not in blob


def test_corrupt_or_foreign_cache_values_are_ignored(make_app, server):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    first = post(env)
    name = env.tier.record_name(digest_of())
    for junk in (b"\x80not json", b'{"v": 99}', b'{"v":1,"fp":"x"}', b"[]"):
        client.set(name, junk)
        with replay_sources(env) as sources:
            again = post(env)
        assert again.status_code == 201 and again.data == first.data
        assert sources == ["database"]
        assert cached_json(client.get(name))["v"] == 3  # read-through repaired it
    assert env.calls == [1]


# -- degradation (C24) --------------------------------------------------------------


def test_c24_redis_down_changes_no_outcome_and_logs_once(make_app, server, caplog):
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    errors: list[dict[str, Any]] = []
    server.connected = False
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    with signals.store_error.connected_to(lambda s, **extra: errors.append(extra), sender=env.app):
        statuses = [post(env).status_code for _ in range(5)]
        statuses.append(post(env, amount=99).status_code)
        # the back-off has passed, Redis is still down: probed again, not logged again
        env.tier.outage.clock = lambda: time.monotonic() + 3600
        statuses.append(post(env).status_code)
    assert statuses == [201, 201, 201, 201, 201, 422, 201]
    assert env.calls == [1]
    warnings = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "no scope_loader" not in r.getMessage()
    ]  # the app's one start-up hint about its missing scope_loader is not about Redis (C46)
    assert len(warnings) == 1 and "Redis unavailable" in warnings[0].getMessage()
    assert len(errors) == 1 and errors[0]["tier"] == "cache"
    assert RAW_KEY not in caplog.text

    server.connected = True
    env.tier.outage.clock = lambda: time.monotonic() + 7200
    with replay_sources(env) as sources:
        post(env)
        post(env)
    assert sources == ["database", "cache"]  # probed, recovered, promoted
    recovered = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(recovered) == 1


def test_c24_outage_backoff_grows_and_lets_one_probe_through():
    now = [100.0]
    outage = Outage(first=1.0, cap=10.0, clock=lambda: now[0])
    assert outage.allows()
    assert outage.failed() is True
    assert not outage.allows()
    delays = []
    for _ in range(6):
        start = now[0]
        while not outage.allows():
            now[0] += 0.25
        delays.append(now[0] - start)
        assert not outage.allows()  # the probe is out: everyone else skips Redis
        assert outage.failed() is False  # same outage, not logged again
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    now[0] += 10
    assert outage.allows()
    assert outage.succeeded() is True
    assert outage.allows() and outage.succeeded() is False


def test_c24_tier_methods_never_raise():
    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise redis.TimeoutError("simulated")

    tier = RedisTier(Broken(), prefix="t")
    hub = WakeupHub()
    record_sample = Completed.from_json(
        b'{"v":1,"fp":"f","exp":99999999999999,"st":201,"h":[],"b":"","om":false}'
    )
    assert record_sample is not None
    for _ in range(2):
        assert tier.get("d") is None
        tier.promote("d", record_sample, 60_000)
        tier.discard("d")
        tier.publish("d", "released")
        assert tier.ping() is False
        tier.outage.clock = lambda: time.monotonic() + 3600
    assert tier.ensure_listening(hub) is False


# -- wake-ups -----------------------------------------------------------------------


def two_processes(
    make_app, server, tmp_path, **config: Any
) -> tuple[SimpleNamespace, SimpleNamespace]:
    """Two apps on one database and one Redis, with their own hubs: two "processes".

    Each has its own client object, so each gets its own listener: a wake-up from
    one reaches the other only through Redis pub/sub.
    """
    database = f"sqlite:///{tmp_path}/shared.sqlite3"
    owner = build(make_app, fakeredis.FakeRedis(server=server), database_uri=database, **config)
    waiter = build(make_app, fakeredis.FakeRedis(server=server), database_uri=database, **config)
    return owner, waiter


@pytest.fixture
def no_poll_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters re-check only when woken: a lost wake-up becomes a 409, not a delay."""
    monkeypatch.setattr(wakeup, "PollSchedule", lambda **_: PollSchedule(first=600, cap=600))


def park_hook(hub: WakeupHub, before_sleep: Callable[[], None]) -> None:
    """Run ``before_sleep`` once, after the waiter's last re-check and before it sleeps."""
    original = hub.parked
    fired = threading.Event()

    @contextmanager
    def parked(digest: str, wait: float) -> Iterator[Any]:
        with original(digest, wait) as slot:

            class Hooked:
                cross_process_live = slot.cross_process_live

                def wait(self, timeout: float) -> bool:
                    if not fired.is_set():
                        fired.set()
                        before_sleep()
                    return slot.wait(timeout)

            yield Hooked()

    hub.parked = parked  # type: ignore[method-assign]


def test_x1_c10_completion_between_recheck_and_sleep_wakes_by_message(
    make_app, server, tmp_path, no_poll_ticks
):
    owner, waiter = two_processes(make_app, server, tmp_path, wait=20)
    # The waiter's subscription is confirmed first: this test is about the message, and
    # on a loaded machine a late subscribe acknowledgement would wake it instead (X2).
    assert waiter.notifier.ensure_listening(
        waiter.state.wakeups
    ) or waiter.notifier.listener.wait_until_live(EVENTUALLY)
    owner.gate.clear()
    first, first_result = in_thread(lambda: post(owner))
    assert owner.entered.wait(EVENTUALLY)

    def complete_the_original() -> None:
        owner.gate.set()
        first.join(EVENTUALLY)

    park_hook(waiter.state.wakeups, complete_the_original)
    duplicate = post(waiter)
    assert first_result[0].status_code == 201
    assert duplicate.status_code == 201, duplicate.data
    assert duplicate.headers["Idempotent-Replayed"] == "true"
    assert duplicate.data == first_result[0].data
    assert waiter.notifier.listener.messages >= 1
    assert owner.calls == [1] and waiter.calls == []


def test_x1_completion_between_registration_and_first_recheck(
    make_app, server, tmp_path, no_poll_ticks
):
    owner, waiter = two_processes(make_app, server, tmp_path, wait=20)
    owner.gate.clear()
    first, _ = in_thread(lambda: post(owner))
    assert owner.entered.wait(EVENTUALLY)
    real_ensure = waiter.notifier.ensure_listening

    def ensure_then_complete(hub: WakeupHub) -> bool:
        live = real_ensure(hub)
        if not owner.gate.is_set():
            owner.gate.set()
            first.join(EVENTUALLY)
        return live

    waiter.notifier.ensure_listening = ensure_then_complete  # type: ignore[method-assign]
    with replay_sources(waiter) as sources:
        duplicate = post(waiter)
    assert duplicate.status_code == 201 and duplicate.headers["Idempotent-Replayed"] == "true"
    assert sources == ["cache"]
    assert owner.calls == [1] and waiter.calls == []


class NoPubSub:
    """A client whose subscriber never gets going: the subscription is never confirmed."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def pubsub(self, **kwargs: Any) -> Any:
        raise redis.ConnectionError("subscriber connection refused")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_x2_c10_unconfirmed_subscription_still_finishes_by_polling(make_app, server, tmp_path):
    database = f"sqlite:///{tmp_path}/shared.sqlite3"
    owner = build(make_app, fakeredis.FakeRedis(server=server), database_uri=database, wait=20)
    waiter = build(
        make_app, NoPubSub(fakeredis.FakeRedis(server=server)), database_uri=database, wait=20
    )
    owner.gate.clear()
    first, _ = in_thread(lambda: post(owner))
    assert owner.entered.wait(EVENTUALLY)
    second, second_result = in_thread(lambda: post(waiter))
    wait_for(lambda: waiter.state.wakeups.parked_count == 1, "the duplicate to park")
    owner.gate.set()
    first.join(EVENTUALLY)
    second.join(EVENTUALLY)
    duplicate = second_result[0]
    assert duplicate.status_code == 201 and duplicate.headers["Idempotent-Replayed"] == "true"
    assert not waiter.notifier.listener.live and waiter.notifier.listener.messages == 0
    assert owner.calls == [1] and waiter.calls == []


class HeldAck:
    """Wraps a fakeredis client so the subscribe acknowledgement is held back."""

    def __init__(self, client: Any, release: threading.Event) -> None:
        self._client = client
        self._release = release

    def pubsub(self, **kwargs: Any) -> Any:
        inner = self._client.pubsub(**kwargs)
        release = self._release

        class Held:
            def subscribe(self, *channels: str) -> None:
                inner.subscribe(*channels)

            def get_message(self, timeout: float = 0.0) -> Any:
                if not release.wait(timeout):
                    return None
                return inner.get_message(timeout=timeout)

            def ping(self, message: str) -> None:
                inner.ping(message)

            def close(self) -> None:
                inner.close()

        return Held()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_x2_ensure_listening_is_true_only_after_the_acknowledgement(server):
    release = threading.Event()
    tier = RedisTier(HeldAck(fakeredis.FakeRedis(server=server), release), first_wait=0.05)
    hub = WakeupHub()
    hub.channel = tier
    assert tier.ensure_listening(hub) is False
    with hub.parked("d" * 64) as parked:
        assert parked.cross_process_live is False  # so the waiter polls at the fast pace
    release.set()
    assert tier.listener.wait_until_live(EVENTUALLY)
    assert tier.ensure_listening(hub) is True
    assert tier.listener.subscriptions == 1


def test_c10_listener_dispatches_by_digest_and_ignores_junk(server):
    client = fakeredis.FakeRedis(server=server)
    tier = RedisTier(client)
    hub = WakeupHub()
    hub.channel = tier
    assert tier.ensure_listening(hub) or tier.listener.wait_until_live(EVENTUALLY)
    with hub.parked("a" * 64) as mine, hub.parked("b" * 64) as other:
        client.publish(tier.channel, b"\xffjunk")
        client.publish(tier.channel, b'{"k": 5}')
        tier.publish("a" * 64, "done")
        assert mine.wait(EVENTUALLY) is True
        assert other.wait(0) is False
    assert tier.listener.messages == 1


def test_x15_listener_reconnects_and_wakes_everyone(server):
    client = fakeredis.FakeRedis(server=server)
    tier = RedisTier(client)
    hub = WakeupHub()
    hub.channel = tier
    assert tier.ensure_listening(hub) or tier.listener.wait_until_live(EVENTUALLY)
    with hub.parked("c" * 64) as parked:
        server.connected = False  # the subscriber's reads fail: waiters must re-check
        assert parked.wait(EVENTUALLY) is True
        wait_for(lambda: not tier.listener.live, "the listener to notice")
        assert tier.ensure_listening(hub) is False
        server.connected = True
        assert tier.listener.wait_until_live(EVENTUALLY)
        assert tier.listener.subscriptions == 2
        tier.publish("c" * 64, "done")
        wait_for(lambda: tier.listener.messages == 1, "the message after reconnecting")


def test_x16_forked_child_starts_its_own_listener(server):
    tier = RedisTier(fakeredis.FakeRedis(server=server))
    hub = WakeupHub()
    assert tier.ensure_listening(hub) or tier.listener.wait_until_live(EVENTUALLY)
    parent_listener = tier.listener
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        ok = listener.running_listeners() == [] and tier.listener is not parent_listener
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tier.listener is parent_listener and parent_listener.live


class SwallowedPongs:
    """Wraps a fakeredis client so heartbeat answers never arrive: a half-open socket."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def pubsub(self, **kwargs: Any) -> Any:
        inner = self._client.pubsub(**kwargs)

        class Deaf:
            def subscribe(self, *channels: str) -> None:
                inner.subscribe(*channels)

            def get_message(self, timeout: float = 0.0) -> Any:
                message = inner.get_message(timeout=timeout)
                return None if message and message["type"] == "pong" else message

            def ping(self, message: str) -> None:
                inner.ping(message)

            def close(self) -> None:
                inner.close()

        return Deaf()


def test_x15_unanswered_heartbeat_makes_the_listener_reconnect(server):
    subscriber = listener.WakeupListener(
        lambda: SwallowedPongs(fakeredis.FakeRedis(server=server)),
        "idem:done",
        heartbeat_interval=0.1,
        answer_timeout=0.3,
    )
    hub = WakeupHub()
    try:
        subscriber.ensure(hub)
        assert subscriber.wait_until_live(EVENTUALLY)
        with hub.parked("d" * 64) as parked:
            assert parked.wait(EVENTUALLY) is True  # the dead connection woke everyone
        wait_for(lambda: subscriber.subscriptions >= 2, "a fresh subscription")
    finally:
        subscriber.stop()


def test_listener_starts_on_first_park_not_at_init_or_on_plain_requests(make_app, server):
    env = build(make_app, fakeredis.FakeRedis(server=server))
    assert post(env).status_code == 201
    assert post(env).status_code == 201
    assert listener.running_listeners() == []
    env.gate.clear()
    env.entered.clear()
    first, result = in_thread(lambda: post(env, key="parked"))
    assert env.entered.wait(EVENTUALLY)
    second, second_result = in_thread(lambda: post(env, key="parked"))
    wait_for(lambda: env.state.wakeups.parked_count == 1, "the duplicate to park")
    started = listener.running_listeners()
    assert len(started) == 1 and started[0].wait_until_live(EVENTUALLY)
    env.gate.set()
    first.join(EVENTUALLY)
    second.join(EVENTUALLY)
    assert result[0].status_code == second_result[0].status_code == 201
    assert second_result[0].headers["Idempotent-Replayed"] == "true"


# -- issue 22 item 4: recovery takes one back-off step (C54) -------------------------


def test_i22_4_c54_requests_in_flight_when_redis_went_away_count_as_one_failure():
    """16 commands were on their way when Redis went away; each fails. That is one
    failure: the probe comes one step (1 s) later, not at the back-off's cap."""
    now = [100.0]
    outage = Outage(first=1.0, cap=10.0, clock=lambda: now[0])
    started = [outage.failed()]

    def in_flight() -> None:  # the other request threads, each with its own failure
        started.append(outage.failed())

    threads = [threading.Thread(target=in_flight) for _ in range(15)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert started.count(True) == 1  # one outage, logged once
    now[0] += 0.99
    assert not outage.allows()
    now[0] += 0.01
    assert outage.allows()  # one step after the first failure: the probe
    assert outage.succeeded() is True


def test_i22_4_c54_only_a_probes_failure_grows_the_back_off():
    """While the probe runs, a request from before the outage fails too: it neither grows
    the back-off nor delays the next probe. The probe's own timeout doubles it."""
    now = [100.0]
    outage = Outage(first=1.0, cap=10.0, clock=lambda: now[0])
    outage.failed()
    now[0] += 1.0
    assert outage.allows()  # this thread probes
    late = threading.Thread(target=outage.failed)  # an older request, failing just now
    late.start()
    late.join()
    outage.failed()  # the probe timed out: the next one in 2 s
    now[0] += 1.99
    assert not outage.allows()
    now[0] += 0.01
    assert outage.allows()


def test_i22_4_c54_a_refused_probe_keeps_the_first_step():
    """A probe refused at once (nothing listens: Redis is restarting) cost its request
    nothing, so the back-off stays at its first step and a restarted Redis is found
    within a second; only a probe that made its request wait (a timeout) doubles it."""
    now = [100.0]
    outage = Outage(first=1.0, cap=10.0, clock=lambda: now[0])
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    report_failure(outage, refused, "get", None)
    for _ in range(5):
        now[0] += 1.0
        assert outage.allows()
        report_failure(outage, refused, "get", None)
    now[0] += 1.0
    assert outage.allows()
    report_failure(outage, redis.TimeoutError("Timeout reading from socket"), "get", None)
    now[0] += 1.0
    assert not outage.allows()
    now[0] += 1.0
    assert outage.allows()


def test_i22_4_c54_c10_a_refused_listener_tries_again_every_second_at_most():
    """Redis refuses the subscriber's connections for 4 s (restarting, a failover): it
    tries again at least once a second, so wake-ups by message are back within about a
    second of Redis answering, however long it was away; its attempts used to double
    to 2 s, 4 s, 8 s apart (C54, C10)."""
    attempts: list[float] = []

    def refused() -> Any:
        attempts.append(time.monotonic())
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    subscriber = listener.WakeupListener(refused, "idem:done", first_wait=0.01)
    hub = WakeupHub()
    try:
        assert subscriber.ensure(hub) is False
        wait_for(lambda: time.monotonic() - attempts[0] > 4.2, "4 s of refused attempts")
    finally:
        subscriber.stop()
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    assert len(attempts) >= 5 and max(gaps) < 1.3, gaps


# -- issue 22 item 2: a shorter waiter never cancels another's wake-up (C53) -------------


def test_i22_2_c53_without_scripts_a_shorter_wait_never_shortens_the_waiting_mark(server):
    """A Redis that refuses scripts (fakeredis here, an ACL without EVAL) gets the mark
    by ``SET NX`` and ``PEXPIRE GT``: still never shortened by a later, shorter waiter."""
    client = fakeredis.FakeRedis(server=server)
    tier = RedisTier(client)
    name = tier.notifier.waiting_name("e" * 64)
    assert tier.expect("e" * 64, 10.0)
    assert tier.expect("e" * 64, 0.2)
    assert 9_000 < client.pttl(name) <= 11_000
    assert tier.expect("e" * 64, 30.0)
    assert 29_000 < client.pttl(name) <= 31_000
    assert not tier.outage.down


# -- issue 22 item 3: a cached copy never outlives its record (C53, C21, C42) ----------


def _sample_record(expires_at_ms: int = 99999999999999, body: bytes = b"{}") -> Completed:
    return Completed("f" * 64, expires_at_ms, StoredResponse(201, (), body))


def test_i22_3_c53_the_time_a_copy_may_live_is_read_after_encoding(server, monkeypatch):
    """Encoding a large body takes time; ``PX`` counts from when Redis runs the ``SET``. The
    copy's expiry is what the record had left when ``promote`` was called, less the time
    encoding took and a margin (C53, C21)."""
    from flask_idempotency.cache import redis as cache_redis

    client = fakeredis.FakeRedis(server=server)
    tier = RedisTier(client)
    encode = cache_redis.encode_value

    def slow_encode(record: Completed, **where: Any) -> bytes:
        time.sleep(0.3)
        return encode(record, **where)

    monkeypatch.setattr(cache_redis, "encode_value", slow_encode)
    called = time.monotonic()
    tier.promote("d" * 64, _sample_record(), 60_000)
    copy_expires = time.monotonic() + client.pttl(tier.record_name("d" * 64)) / 1000
    assert copy_expires <= called + 60.0 + 0.005


class SlowSet:
    """A client whose ``SET`` reaches Redis ``delay`` seconds after it was sent: a slow
    trip, a large value on a slow link, a worker thread that lost the CPU."""

    def __init__(self, client: Any, delay: float) -> None:
        self._client = client
        self._delay = delay

    def set(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self._delay)
        return self._client.set(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_i22_3_c53_a_set_slower_than_the_margin_gets_its_expiry_set_again(server):
    """However the ``SET`` was delayed on its way, the copy expires no later than its
    record: a ``SET`` that took longer than the margin to answer may have started its
    ``PX`` late, so its expiry is set again from a fresh reading (C53, C42)."""
    client = fakeredis.FakeRedis(server=server)
    tier = RedisTier(SlowSet(client, 0.3))
    called = time.monotonic()
    tier.promote("d" * 64, _sample_record(), 60_000)
    copy_expires = time.monotonic() + client.pttl(tier.record_name("d" * 64)) / 1000
    assert copy_expires <= called + 60.0 + 0.005
    tier.promote("e" * 64, _sample_record(), 200)  # a record with less left than the trip
    assert client.exists(tier.record_name("e" * 64)) == 0


# -- issue 26 item 7: cached values are checked before they are replayed (C22) ----------


def _planted(env: SimpleNamespace, client: Any, **changes: Any) -> bytes:
    """The cached value of ``digest_of()`` with its response changed (status, headers),
    sealed with the app's own MAC: a value only the app's store could have written
    (C60), which must still pass C22's checks to be replayed."""
    cache = env.tier
    name = cache.record_name(digest_of())
    record = cache._decode(client.get(name), digest_of())
    assert record is not None
    response = record.response
    planted = StoredResponse(
        changes.get("status", response.status),
        changes.get("headers", response.headers),
        response.body,
        response.body_omitted,
    )
    return bytes(cache._encode(name, Completed(record.fingerprint, record.expires_at_ms, planted)))


@pytest.mark.parametrize(
    "change",
    [
        {"headers": (("Content-Type", "application/json\r\nX-Injected: 1"),)},
        {"headers": (("Content-Type", "application/json"), ("Set-Cookie", "session=attacker"))},
        {"headers": (("Content-Type", "application/json"), ("X-Not-Allowed", "1"))},
        {"headers": (("Content-Type", "application/json\x00"),)},
        {"status": 0},
        {"status": 99},
        {"status": 600},
    ],
    ids=["crlf", "set-cookie", "not-allow-listed", "nul", "status-0", "status-99", "status-600"],
)
def test_i26_7_c22_a_cached_value_that_is_not_safe_to_replay_is_a_miss(
    make_app, server, caplog, change
):
    """A value in Redis that decodes is not trusted: a header with CR/LF (every retry a
    500), a planted ``Set-Cookie`` (session fixation; never replayed), a header the
    allow-list does not name, a status outside 100-599. Each is a miss: the replay
    comes from the database, and the read-through repairs the copy (C22)."""
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    first = post(env)
    name = env.tier.record_name(digest_of())
    client.set(name, _planted(env, client, **change))
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    with replay_sources(env) as sources:
        again = post(env)
    assert again.status_code == 201, again.data
    assert again.data == first.data and again.headers["Idempotent-Replayed"] == "true"
    assert "Set-Cookie" not in again.headers and "X-Not-Allowed" not in again.headers
    assert "X-Injected" not in again.headers
    assert sources == ["database"]
    with replay_sources(env) as sources:
        post(env)
    assert sources == ["cache"]  # repaired by the read-through
    assert env.calls == [1]
    unsafe = [r for r in caplog.records if "not safe to replay" in r.getMessage()]
    assert len(unsafe) == 1 and RAW_KEY not in caplog.text


def test_i26_7_c22_unsafe_cached_values_are_logged_once_not_per_read(make_app, server, caplog):
    """A copy planted again and again (or many of them) is a miss each time; the log says
    so once, then at most every few seconds with a count, not once per replay."""
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client)
    post(env)
    name = env.tier.record_name(digest_of())
    planted = _planted(env, client, status=0)
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    for _ in range(20):
        client.set(name, planted)
        with replay_sources(env) as sources:
            assert post(env).status_code == 201
        assert sources == ["database"]
    unsafe = [r for r in caplog.records if "not safe to replay" in r.getMessage()]
    assert len(unsafe) == 1


def test_i26_7_c22_a_cached_value_with_an_allow_listed_header_of_the_app_replays(make_app, server):
    """The check follows the app's own ``IDEMPOTENCY_REPLAY_HEADERS`` (and the body's
    ``Content-Encoding``, always kept): what the app stores, it replays from the cache."""
    client = fakeredis.FakeRedis(server=server)
    env = build(make_app, client, replay_headers=["Content-Type", "X-Request-Cost"])

    @env.app.post("/costly")
    @idempotent
    def costly() -> Any:
        return "ok", 201, {"X-Request-Cost": "3", "Content-Encoding": "identity"}

    first = env.app.test_client().post("/costly", headers={"Idempotency-Key": RAW_KEY})
    stored = env.tier._decode(client.get(env.tier.record_name(digest_of())), digest_of())
    assert stored is not None
    assert {name for name, _ in stored.response.headers} == {
        "Content-Type",
        "X-Request-Cost",
        "Content-Encoding",
    }
    with replay_sources(env) as sources:
        again = env.app.test_client().post("/costly", headers={"Idempotency-Key": RAW_KEY})
    assert sources == ["cache"]
    assert again.headers["X-Request-Cost"] == "3" and again.data == first.data


# -- issue 26 item 11: log floods ----------------------------------------------------


def test_i26_11_c11_requests_refused_a_place_to_wait_are_logged_once_not_each(
    make_app, server, caplog
):
    """Over ``IDEMPOTENCY_MAX_WAITERS`` each duplicate gets its 409 at once; the log says
    so once, then at most every few seconds with a count, like the outage lines, instead
    of one line per refused request (C11)."""
    env = build(make_app, fakeredis.FakeRedis(server=server), max_waiters=0)
    env.gate.clear()
    first, result = in_thread(lambda: post(env))
    try:
        assert env.entered.wait(EVENTUALLY)
        caplog.set_level(logging.WARNING, logger="flask_idempotency")
        statuses = [post(env).status_code for _ in range(20)]
    finally:
        env.gate.set()
        first.join(EVENTUALLY)
    assert statuses == [409] * 20 and result[0].status_code == 201
    refused = [r for r in caplog.records if "too many parked requests" in r.getMessage()]
    assert len(refused) == 1
