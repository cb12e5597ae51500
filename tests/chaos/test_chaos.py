"""Chaos: real gunicorn workers, SIGKILL, Redis killed and flushed, the database cut off.

Each scenario drives bounded concurrent load through the rig (conftest.py),
breaks something while it runs, then checks two things against the ledger the
workers write straight to PostgreSQL: how many times each key's view ran, and
what every client was told. Verdicts are counts and outcomes, never durations.
The random seed of each scenario is in its failure messages.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from flask_idempotency.fingerprint import ANONYMOUS_SCOPE, key_digest
from flask_idempotency.records import COMPLETED
from flask_idempotency.tier import RedisTier, store_origin
from tests.support.gunicorn import GunicornServer

from .conftest import EVENTUALLY, Answer, AnswerLog, ChaosRig, send, wait_until

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.heavy,
    pytest.mark.postgres,
    pytest.mark.redis,
]

#: Attempts one client makes for one key before it gives up (every loop is bounded).
CLIENT_ATTEMPTS = 40
#: Seconds one client keeps retrying one key.
CLIENT_PATIENCE = 45.0


def new_seed() -> int:
    return random.SystemRandom().randrange(2**32)


class KeyFeed:
    """Hands out keys to client threads, ``duplicates`` consecutive times each.

    Consecutive hand-outs go to different threads at about the same moment, so
    a key's duplicates really are concurrent. Stops at ``max_keys`` or, for
    open-ended load, once ``stop`` is set (a started key still gets all its duplicates).
    """

    def __init__(self, prefix: str, duplicates: int, max_keys: int) -> None:
        self.prefix = prefix
        self.duplicates = duplicates
        self.max_keys = max_keys
        self.stop = threading.Event()
        self._issued = 0
        self._lock = threading.Lock()

    def next(self) -> str | None:
        with self._lock:
            index, nth = divmod(self._issued, self.duplicates)
            if nth == 0 and (index >= self.max_keys or self.stop.is_set()):
                return None
            self._issued += 1
            return f"{self.prefix}-{index}"

    def keys(self) -> list[str]:
        count = -(-self._issued // self.duplicates)
        return [f"{self.prefix}-{i}" for i in range(count)]


def drive(
    feed: KeyFeed, client: Callable[[str, random.Random], None], threads: int, seed: int
) -> None:
    """Run ``client(key, rng)`` for every key the feed hands out, on ``threads`` threads."""

    def worker(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        while (key := feed.next()) is not None:
            client(key, rng)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(worker, n) for n in range(threads)]:
            future.result()


def body_for(key: str) -> dict[str, Any]:
    """The body every duplicate of ``key`` sends; its short sleep is part of the request."""
    index = int(key.rsplit("-", 1)[1])
    return {"key": key, "sleep": (index % 6) * 0.05}


def retry_until_settled(
    url: str, key: str, log: AnswerLog, rng: random.Random, *, again_after_success: float = 0.0
) -> Answer | None:
    """A persistent client: retry on no answer, 409 or 503; maybe once more after a 201."""
    deadline = time.monotonic() + CLIENT_PATIENCE
    last: Answer | None = None
    for _ in range(CLIENT_ATTEMPTS):
        if time.monotonic() > deadline:
            break
        last = log.add(send(url, key, body_for(key), timeout=20.0))
        if last.status == 201:
            if rng.random() < again_after_success:
                again_after_success = 0.0
                continue
            return last
        if last.status is not None and last.status not in (409, 503):
            return last
        time.sleep(rng.uniform(0.05, 0.4))
    return last


def digest(key: str) -> str:
    return key_digest(ANONYMOUS_SCOPE, key)


def complete_every_key(server: GunicornServer, keys: list[str], log: AnswerLog) -> list[Answer]:
    """A retry per key, a few keys at a time; the last answer of each.

    A 409 is tried again a few times: a request whose client gave up may still be
    running on the server. A key stuck for good stays 409 and the caller sees it.
    """

    def settle(key: str) -> Answer:
        answer = log.add(send(server.url, key, body_for(key), timeout=30.0))
        for _ in range(5):
            if answer.status not in (None, 409):
                break
            time.sleep(1.0)
            answer = log.add(send(server.url, key, body_for(key), timeout=30.0))
        return answer

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(settle, keys))


def assert_every_run_was_claimed(rig: ChaosRig, seed: int) -> dict[str, list[Any]]:
    """No execution without a claim: each run saw its claim signal, and no key ran more
    than it was claimed."""
    runs, claims = rig.runs_by_key(), rig.claims_by_key()
    unclaimed = [r for rows in runs.values() for r in rows if r.claim_how is None]
    assert not unclaimed, f"seed {seed}: views ran without a claim: {unclaimed[:5]}"
    over = {k: (len(rows), claims[k]) for k, rows in runs.items() if len(rows) > claims[k]}
    assert not over, f"seed {seed}: more executions than claims (runs, claims): {over}"
    return runs


# -- 1. duplicates, client timeouts, retries -------------------------------------------


def test_duplicates_with_client_timeouts_and_retries_run_each_view_once(
    rig: ChaosRig, chaos_summary: Callable[..., None]
) -> None:
    """C8–C11: 200 keys × 8 concurrent duplicates; impatient clients time out and retry.

    A client whose request times out sends it again with the same key and body;
    some send it once more after a success. Each key's view runs exactly once,
    and every answer is that run's 201 (original or replay) or a 409.
    """
    seed = new_seed()
    server = rig.serve(IDEM_WAIT=3, IDEM_LEASE=60)
    feed = KeyFeed("dup", duplicates=8, max_keys=200)
    log = AnswerLog()

    def impatient_client(key: str, rng: random.Random) -> None:
        for _ in range(8):
            timeout = rng.uniform(0.05, 0.5) if rng.random() < 0.3 else 30.0
            answer = log.add(send(server.url, key, body_for(key), timeout=timeout))
            if answer.status == 201 and rng.random() >= 0.2:
                return
            if answer.status not in (None, 201, 409):
                return
            time.sleep(rng.uniform(0.0, 0.2))

    drive(feed, impatient_client, threads=40, seed=seed)
    keys = feed.keys()
    final = complete_every_key(server, keys, log)
    chaos_summary("duplicates + client timeouts", log, keys=len(keys), executions=rig.total_runs())
    runs = assert_every_run_was_claimed(rig, seed)

    assert len(keys) == 200
    statuses = log.statuses()
    assert set(statuses) <= {201, 409, None}, f"seed {seed}: {statuses}"
    no_answer = collections.Counter(a.error for a in log.answers if a.status is None)
    assert set(no_answer) <= {"ReadTimeout", "ConnectTimeout"}, f"seed {seed}: {no_answer}"
    assert no_answer, (
        f"seed {seed}: no client timed out, so the scenario proved nothing about retries"
    )
    for key in keys:
        rows = runs.get(key, [])
        assert len(rows) == 1, f"seed {seed}: {key} ran {len(rows)} times: {rows}"
        assert rows[0].outcome == "stored", f"seed {seed}: {key}: {rows[0]}"
        got = log.of(key)
        assert {a.run for a in got if a.status == 201} == {rows[0].id}, f"seed {seed}: {key}: {got}"
        assert sum(a.original for a in got) <= 1, (
            f"seed {seed}: {key} answered as an original twice"
        )
    assert all(a.status == 201 for a in final), (
        f"seed {seed}: {collections.Counter(a.status for a in final)}"
    )
    assert rig.inspector.dbsize() > 0, (
        "nothing was ever promoted to Redis: the tier was not in play"
    )


# -- 2. SIGKILL at random points ---------------------------------------------------------


KILLS = 50
KILL_LEASE = 6.0


def kill_workers(
    rig: ChaosRig, server: GunicornServer, rng: random.Random, kills: list[int], count: int
) -> None:
    """SIGKILL ``count`` workers at random moments, half of them while they run a view.

    Always leaves a worker alive, so the load keeps flowing; gunicorn forks replacements.
    """
    while len(kills) < count:  # a victim gone by the time of its kill is not counted
        time.sleep(rng.uniform(0.1, 0.5))
        live = [
            pid for pid in server.wait_for_workers(count=2, within=EVENTUALLY) if pid not in kills
        ]
        if not live:
            continue
        busy = [pid for pid in unsettled_run_pids(rig) if pid in live]
        victim = rng.choice(busy) if busy and rng.random() < 0.5 else rng.choice(live)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(victim)


def unsettled_run_pids(rig: ChaosRig) -> list[int]:
    """Workers with a view in flight right now (a run without an outcome)."""
    return sorted({r.pid for rows in rig.runs_by_key().values() for r in rows if r.outcome is None})


def test_sigkilled_workers_leave_no_stuck_key_and_no_unexplained_rerun(
    rig: ChaosRig, chaos_summary: Callable[..., None]
) -> None:
    """C13–C15: 50 SIGKILLs at random points under load.

    A view may run again only because the worker running it was killed: for each
    key, every execution but the last was by a killed pid. After the load and one
    lease, a plain retry completes every key (nothing is stuck), and replays.
    """
    seed = new_seed()
    rng = random.Random(seed)
    # Preloaded: a killed worker is replaced by a fork of the loaded master in milliseconds
    # instead of a second of imports, so the 50 kills come twice as fast (and each
    # replacement runs the extension's fork hook: 50 more proofs of it).
    server = rig.serve(workers=3, threads=6, preload=True, IDEM_WAIT=1, IDEM_LEASE=KILL_LEASE)
    feed = KeyFeed("kill", duplicates=3, max_keys=600)
    log = AnswerLog()
    kills: list[int] = []

    def persistent_client(key: str, client_rng: random.Random) -> None:
        retry_until_settled(server.url, key, log, client_rng)

    load = threading.Thread(target=drive, args=(feed, persistent_client, 18, seed))
    load.start()
    try:
        kill_workers(rig, server, rng, kills, KILLS)
    finally:
        feed.stop.set()
        load.join(timeout=CLIENT_PATIENCE * 3)
    assert not load.is_alive(), "the load did not finish"
    time.sleep(KILL_LEASE + 1.0)  # one lease: whatever a killed worker held has lapsed
    server.wait_for_workers(within=EVENTUALLY)
    keys = feed.keys()
    final = complete_every_key(server, keys, log)
    chaos_summary(
        "SIGKILL workers", log, keys=len(keys), executions=rig.total_runs(), kills=len(kills)
    )
    runs = assert_every_run_was_claimed(rig, seed)

    assert len(kills) == KILLS
    killed = set(kills)
    stuck = {a.key: a.status for a in final if a.status != 201}
    assert not stuck, f"seed {seed}: keys not completed one lease after the load: {stuck}"
    statuses = log.statuses()
    assert set(statuses) <= {201, 409, None}, f"seed {seed}: {statuses}"
    hit_by_a_kill = 0
    for key in keys:
        rows = runs.get(key, [])
        assert rows, f"seed {seed}: {key} answered 201 but its view never ran"
        # A run that a kill interrupted is by a killed pid and never settled (no outcome).
        unexplained = [r for r in rows[:-1] if r.pid not in killed or r.outcome is not None]
        assert not unexplained, (
            f"seed {seed}: {key} ran again after a run no kill interrupted: {unexplained}"
            f" (all: {rows})"
        )
        assert len(rows) - 1 <= len({r.pid for r in rows[:-1]}), f"seed {seed}: {key}: {rows}"
        settled_last = rows[-1].outcome == "stored" or rows[-1].pid in killed
        assert settled_last, f"seed {seed}: {key}: last run not stored: {rows}"
        hit_by_a_kill += len(rows) > 1
        got = {a.run for a in log.of(key) if a.status == 201 and a.replayed}
        assert got <= {rows[-1].id}, f"seed {seed}: {key} replayed {got}, stored run {rows[-1].id}"
        record = rig.store.get(digest(key))
        assert record is not None and record.state == COMPLETED, f"seed {seed}: {key}: {record}"
    assert hit_by_a_kill > 0, (
        f"seed {seed}: no kill interrupted a view: the scenario proved nothing"
    )


# -- 3. Redis killed, flushed, restarted, cut and stalled -------------------------------


def redis_faults(rig: ChaosRig, rng: random.Random, done: list[str]) -> None:
    """The Redis misfortunes, in order, with load running throughout."""
    steps: list[tuple[str, Callable[[], object]]] = [
        ("flushall", rig.redis.flushall),
        ("kill", rig.redis.kill),
        ("restart", rig.redis.start),
        ("flushall", rig.redis.flushall),
        ("network cut", rig.redis_proxy.cut),
        ("network back", rig.redis_proxy.restore),
        ("half-open", rig.redis_proxy.stall),
        ("network back", rig.redis_proxy.restore),
        ("kill", rig.redis.kill),
        ("restart", rig.redis.start),
        ("flushall", rig.redis.flushall),
    ]
    for name, step in steps:
        time.sleep(rng.uniform(0.8, 1.6))
        step()
        done.append(name)


def test_redis_killed_flushed_restarted_under_load_changes_no_outcome(
    rig: ChaosRig, chaos_summary: Callable[..., None]
) -> None:
    """C22–C24, X7, X15: Redis dies, loses everything, comes back, stalls; nothing else changes.

    No 5xx, no extra execution: each key's view runs exactly once and every 201
    carries that run, whether it came from Redis, from PostgreSQL or from a wait.
    """
    seed = new_seed()
    rng = random.Random(seed)
    server = rig.serve(IDEM_WAIT=3, IDEM_LEASE=60)
    log = AnswerLog()
    warm = [f"warm-{i}" for i in range(20)]
    for key in warm:
        assert log.add(send(server.url, key, body_for(key))).status == 201
    tier = RedisTier(rig.inspector, origin=store_origin(rig.store.identity().id, rig.table))
    wait_until(
        lambda: rig.inspector.exists(tier.record_name(digest(warm[-1]))) == 1, "promotion to Redis"
    )

    feed = KeyFeed("redis", duplicates=4, max_keys=1000)

    def client_with_old_keys(key: str, client_rng: random.Random) -> None:
        retry_until_settled(server.url, key, log, client_rng, again_after_success=0.5)
        old = client_rng.choice(warm)  # a replay that Redis may or may not still hold
        log.add(send(server.url, old, body_for(old), timeout=20.0))

    done: list[str] = []
    load = threading.Thread(target=drive, args=(feed, client_with_old_keys, 24, seed))
    load.start()
    try:
        redis_faults(rig, rng, done)
        time.sleep(1.0)
    finally:
        feed.stop.set()
        load.join(timeout=CLIENT_PATIENCE * 3)
    assert not load.is_alive(), "the load did not finish"
    keys = warm + feed.keys()
    final = complete_every_key(server, keys, log)
    chaos_summary("Redis kill/flush/restart/cut", log, keys=len(keys), executions=rig.total_runs())
    runs = assert_every_run_was_claimed(rig, seed)

    assert len(done) == 11
    statuses = log.statuses()
    assert set(statuses) <= {201, 409}, f"seed {seed}: {statuses}"
    for key in keys:
        rows = runs.get(key, [])
        assert len(rows) == 1, f"seed {seed}: {key} ran {len(rows)} times: {rows}"
        got = {a.run for a in log.of(key) if a.status == 201}
        assert got == {rows[0].id}, (
            f"seed {seed}: {key}: answers carry runs {got}, ran {rows[0].id}"
        )
    assert all(a.status == 201 and a.replayed for a in final), f"seed {seed}: {final}"
    assert_redis_back_in_use(server, rig, keys[-1], log)


def assert_redis_back_in_use(
    server: GunicornServer, rig: ChaosRig, key: str, log: AnswerLog
) -> None:
    """C23/C24: once Redis is back (after its outage back-off), a replay promotes the
    record again."""
    name = RedisTier(
        rig.inspector, origin=store_origin(rig.store.identity().id, rig.table)
    ).record_name(digest(key))
    deadline = time.monotonic() + EVENTUALLY
    while rig.inspector.exists(name) == 0:
        assert time.monotonic() < deadline, "Redis never held a record again after the faults"
        assert log.add(send(server.url, key, body_for(key))).replayed
        time.sleep(0.5)


# -- 4. the store's database cut off ------------------------------------------------------


@pytest.mark.parametrize(
    "rig",
    [
        pytest.param("postgresql", id="postgresql"),
        pytest.param("postgresql+psycopg", id="postgresql-psycopg3"),
        pytest.param("mariadb", id="mariadb", marks=pytest.mark.mysql),
    ],
    indirect=True,
)
def test_database_cut_gives_503_for_new_keys_while_redis_keeps_replaying(
    rig: ChaosRig, chaos_summary: Callable[..., None]
) -> None:
    """C25, C14, C23: the store's network is cut while requests are in flight.

    On PostgreSQL and on MariaDB (issue 16), with the same verdicts on both.

    While cut: new keys get 503 ``store-unavailable`` and their view never runs;
    keys completed (and promoted) before the cut keep replaying from Redis. No
    view runs without a claim. A key runs a second time only when its first run
    could not store its response because the store was cut (the claim then
    lapses with its lease, C14/C15). After the network returns, every key completes.
    """
    seed = new_seed()
    rng = random.Random(seed)
    lease = 5.0
    # A generous Redis timeout: this scenario breaks the database, not Redis.
    server = rig.serve(IDEM_WAIT=2, IDEM_LEASE=lease, IDEM_REDIS_TIMEOUT=2.0)
    log = AnswerLog()
    tier = RedisTier(rig.inspector, origin=store_origin(rig.store.identity().id, rig.table))
    before = [f"before-{i}" for i in range(30)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        first = list(pool.map(lambda k: log.add(send(server.url, k, body_for(k))), before))
        # Every worker must have read the store's identity before the cut, or it cannot
        # name a key in Redis while the database is away (C41, C60) and answers a replay
        # with 503: more early keys until each worker has claimed one (on a loaded CI
        # machine one worker's accept loop can miss all thirty).
        workers = set(server.worker_pids())
        while not workers <= rig.claiming_pids() and len(before) < 300:
            more = [f"before-{i}" for i in range(len(before), len(before) + 12)]
            first += pool.map(lambda k: log.add(send(server.url, k, body_for(k))), more)
            before += more
    assert workers <= rig.claiming_pids(), f"workers {workers} never claimed a key"
    assert all(a.original for a in first), first
    wait_until(
        lambda: all(rig.inspector.exists(tier.record_name(digest(k))) for k in before),
        "every early key to be promoted to Redis",
    )

    feed = KeyFeed("flow", duplicates=2, max_keys=1000)
    flow_log = AnswerLog()

    def flowing_client(key: str, client_rng: random.Random) -> None:
        flow_log.add(send(server.url, key, body_for(key), timeout=20.0))

    load = threading.Thread(target=drive, args=(feed, flowing_client, 12, seed))
    load.start()
    during_new: list[Answer] = []
    during_replays: list[Answer] = []
    try:
        time.sleep(rng.uniform(0.5, 1.5))
        rig.store_proxy.cut()
        time.sleep(0.3)
        for i in range(20):
            during_new.append(
                log.add(send(server.url, f"new-{i}", body_for(f"new-{i}"), timeout=20.0))
            )
            old = before[i % len(before)]
            during_replays.append(log.add(send(server.url, old, body_for(old), timeout=20.0)))
        runs_while_cut = runs_of_keys_sent_only_while_cut(rig)
        rig.store_proxy.restore()
        time.sleep(rng.uniform(0.5, 1.5))
    finally:
        rig.store_proxy.restore()
        feed.stop.set()
        load.join(timeout=CLIENT_PATIENCE * 3)
    assert not load.is_alive(), "the load did not finish"
    for answer in flow_log.answers:
        log.add(answer)

    time.sleep(lease + 1.0)  # a claim whose completion was cut off lapses with its lease
    keys = before + [f"new-{i}" for i in range(20)] + feed.keys()

    def settle(key: str) -> Answer:  # each key by one persistent client of its own
        settled = retry_until_settled(server.url, key, log, random.Random(f"{seed}-{key}"))
        assert settled is not None, f"seed {seed}: {key} got no answer"
        return settled

    with ThreadPoolExecutor(max_workers=8) as pool:  # keys side by side, as complete_every_key
        final = list(pool.map(settle, keys))
    chaos_summary(f"{rig.database} cut", log, keys=len(keys), executions=rig.total_runs())
    runs = assert_every_run_was_claimed(rig, seed)

    assert all(a.status == 503 and a.code == "store-unavailable" for a in during_new), (
        f"seed {seed}: new keys while cut:"
        f" {collections.Counter((a.status, a.code) for a in during_new)}"
    )
    originals = {a.key: a.run for a in first}
    assert all(
        a.status == 201 and a.replayed and a.run == originals[a.key] for a in during_replays
    ), f"seed {seed}: replays while cut: {during_replays}"
    assert not runs_while_cut, (
        f"seed {seed}: views started while the store was cut: {runs_while_cut}"
    )
    statuses = log.statuses()
    assert set(statuses) <= {201, 409, 503}, f"seed {seed}: {statuses}"
    assert all(a.status == 201 for a in final), f"seed {seed}: not completed after restore: {final}"
    for key in keys:
        rows = runs.get(key, [])
        assert rows, f"seed {seed}: {key} completed but never ran"
        unexplained = [r for r in rows[:-1] if not (r.outcome or "").startswith("store-error")]
        assert not unexplained, (
            f"seed {seed}: {key} ran twice with no store failure between: {rows}"
        )
        if not key.startswith("flow-"):
            assert len(rows) == 1, f"seed {seed}: {key} ran {len(rows)} times: {rows}"
        # "store-error:complete" last: the completion committed but its reply was cut off.
        assert rows[-1].outcome in ("stored", "store-error:complete"), f"seed {seed}: {key}: {rows}"
        record = rig.store.get(digest(key))
        assert record is not None and record.state == COMPLETED, f"seed {seed}: {key}: {record}"


def runs_of_keys_sent_only_while_cut(rig: ChaosRig) -> list[Any]:
    """Runs of the keys only ever sent while the store was cut (there must be none)."""
    return [r for key, rows in rig.runs_by_key().items() if key.startswith("new-") for r in rows]


# -- 5. same key, different bodies ------------------------------------------------------------


def test_same_key_different_bodies_racing_run_once_and_answer_422(
    rig: ChaosRig, chaos_summary: Callable[..., None]
) -> None:
    """C7, C8, X14: 60 keys, each sent with 8 different bodies at once.

    Exactly one body per key wins and runs; every other request, in flight or
    after completion, gets 422 ``key-reused``, never 409 and never a second run.
    """
    seed = new_seed()
    server = rig.serve(IDEM_WAIT=3, IDEM_LEASE=60)
    log = AnswerLog()
    keys = [f"bodies-{i}" for i in range(60)]
    jobs = [(key, variant) for key in keys for variant in range(8)]

    def racer(job: tuple[str, int]) -> Answer:
        key, variant = job
        return log.add(send(server.url, key, {"variant": variant, "sleep": 0.1}, timeout=30.0))

    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(racer, jobs))
    chaos_summary("same key, different bodies", log, keys=len(keys), executions=rig.total_runs())
    runs = assert_every_run_was_claimed(rig, seed)

    assert set(log.statuses()) <= {201, 422}, f"seed {seed}: {log.statuses()}"
    for key in keys:
        got = log.of(key)
        winners = [a for a in got if a.status == 201]
        rows = runs.get(key, [])
        assert len(rows) == 1, f"seed {seed}: {key} ran {len(rows)} times"
        assert [a.run for a in winners] == [rows[0].id] and winners[0].original, (
            f"seed {seed}: {got}"
        )
        losers = [a for a in got if a.status != 201]
        assert len(losers) == 7 and all(a.code == "key-reused" for a in losers), (
            f"seed {seed}: {got}"
        )


@pytest.fixture(autouse=True)
def _fail_with_server_log(rig: ChaosRig) -> Iterator[None]:
    """On failure, show the tail of each gunicorn log (kept after stop)."""
    yield
    for server in rig.servers:
        if server.proc is not None and "Traceback" in server.log():
            print(f"\n--- gunicorn log ({server.url}) ---\n{server.log()}")
