"""SIGKILL gunicorn workers at chosen points of the payments view, then settle every key (C40).

Shared by ``tests/test_atomic.py`` and ``bench/atomic_kills.py`` so the test and
the published figures come from the same machinery.

A campaign works through a *schedule*: for every key, a list of kill plans, each
saying how long the view sleeps in each stretch (``X-Sleep``) and how long after
the view's attempt row appears the worker running it is killed. The schedule
depends only on the seed, so two modes run the same one. Lanes (threads) send
the requests; one watcher thread polls the attempts table and tells a lane which
worker process is running its request. A key whose request was killed rests
until its lease has lapsed, so the next request takes the record over and runs
the view again, and may be killed again.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import requests
from sqlalchemy import Engine, MetaData, Table, select
from sqlalchemy.engine import URL

from flask_idempotency.fingerprint import key_digest
from flask_idempotency.records import Record
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine
from tests.apps.atomicapp import attempts_table, payments_table
from tests.support.gunicorn import GunicornServer

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the suite runs on 3.10 too
    from typing import Self

#: Where a plan aims its kill: the view's stretch it should land in.
KINDS = ("early", "written", "finishing", "edge")
_REQUEST_TIMEOUT = 60.0


@dataclasses.dataclass(frozen=True)
class KillPlan:
    """One request of a key and the moment its worker is killed."""

    kind: str
    sleeps: tuple[float, float, float]
    delay: float  # seconds after the attempt row appears

    @property
    def header(self) -> str:
        return ",".join(f"{s:.3f}" for s in self.sleeps)


def make_schedule(keys: list[str], seed: int) -> dict[str, list[KillPlan]]:
    """Per key: one kill aimed before the write, one while the write is pending, one after
    the view's work (before the record completes), in random order, then one at a random
    instant of a short request, which may land in the commit itself or miss it."""
    rng = random.Random(seed)
    schedule: dict[str, list[KillPlan]] = {}
    for key in keys:
        aimed = [
            KillPlan("early", (0.35, 0.0, 0.02), rng.uniform(0.0, 0.2)),
            KillPlan("written", (0.0, 0.35, 0.02), rng.uniform(0.04, 0.25)),
            KillPlan("finishing", (0.0, 0.02, 0.35), rng.uniform(0.1, 0.28)),
        ]
        rng.shuffle(aimed)
        mid, post = rng.uniform(0.0, 0.03), rng.uniform(0.0, 0.03)
        aimed.append(KillPlan("edge", (0.0, mid, post), rng.uniform(0.0, mid + post + 0.04)))
        schedule[key] = aimed
    return schedule


def body_for(key: str, index: int) -> dict[str, Any]:
    """The request body of a key: the same on every attempt, an amount of its own."""
    return {"amount": 1000 + index, "reference": key}


class AtomicHarness:
    """The records, payments and attempts tables, and gunicorn servers running the payments app."""

    def __init__(self, url: URL | str, table: str) -> None:
        self.url = url if isinstance(url, str) else url.render_as_string(hide_password=False)
        self.table = table
        self.engine = create_store_engine(self.url)
        self.store = DurableStore(lambda: self.engine, table_name=table)
        self.store.create_table()
        metadata = MetaData()
        self.payments = payments_table(metadata, table)
        self.attempts = attempts_table(metadata, table)
        metadata.create_all(self.engine)
        self.servers: list[GunicornServer] = []

    def server(
        self,
        *,
        atomic: bool,
        lease: float,
        workers: int = 3,
        wait: float = 0.0,
        threads: int = 1,
        extra_env: dict[str, str] | None = None,
        worker_class: str | None = None,
    ) -> GunicornServer:
        """Sync workers: one request per process, so a kill hits exactly the request it aims at.
        Preloaded, so a killed worker is replaced by a fork in milliseconds. ``threads`` > 1
        runs gthread workers instead."""
        env = {
            **(extra_env or {}),
            "DATABASE_URL": self.url,
            "IDEM_TABLE": self.table,
            "IDEM_LEASE": str(lease),
            "IDEM_WAIT": str(wait),
            "ATOMIC": "1" if atomic else "0",
        }
        server = GunicornServer(
            "tests.apps.atomicapp:create_app()",
            env=env,
            workers=workers,
            threads=threads,
            worker_class=worker_class or ("sync" if threads == 1 else "gthread"),
            preload=True,
        )
        self.servers.append(server)
        return server.start()

    def payments_by_key(self) -> dict[str, list[Any]]:
        t = self.payments
        rows: dict[str, list[Any]] = collections.defaultdict(list)
        with self.engine.connect() as conn:
            for row in conn.execute(select(t).order_by(t.c.id)):
                rows[row.idem_key].append(row)
        return rows

    def phases(self, attempt_ids: list[int]) -> dict[int, str]:
        t = self.attempts
        with self.engine.connect() as conn:
            rows = conn.execute(select(t.c.id, t.c.phase).where(t.c.id.in_(attempt_ids)))
            return {int(row.id): str(row.phase) for row in rows}

    def attempt_count(self) -> int:
        with self.engine.connect() as conn:
            return len(conn.execute(select(self.attempts.c.id)).all())

    def record(self, key: str) -> Record | None:
        return self.store.get(key_digest("anonymous", key))

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.payments.drop(self.engine, checkfirst=True)
        self.attempts.drop(self.engine, checkfirst=True)
        self.store.table.drop(self.engine, checkfirst=True)
        self.engine.dispose()


def post_payment(
    base_url: str, key: str, body: dict[str, Any], sleep: str | None = None
) -> requests.Response:
    headers = {"Idempotency-Key": key}
    if sleep is not None:
        headers["X-Sleep"] = sleep
    return requests.post(
        f"{base_url}/payments", json=body, headers=headers, timeout=_REQUEST_TIMEOUT
    )


@dataclasses.dataclass(frozen=True)
class Attempt:
    id: int
    key: str
    pid: int


class AttemptWatcher:
    """One thread polls the attempts table; lanes wait here for their request's row."""

    def __init__(self, engine: Engine, attempts: Table, interval: float = 0.005) -> None:
        self._engine = engine
        self._attempts = attempts
        self._interval = interval
        self._latest: dict[str, Attempt] = {}
        self._seen = 0
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="attempt-watcher", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        t = self._attempts
        try:
            with self._engine.connect() as conn:
                while not self._stop.is_set():
                    rows = conn.execute(
                        select(t.c.id, t.c.idem_key, t.c.pid)
                        .where(t.c.id > self._seen)
                        .order_by(t.c.id)
                    ).all()
                    conn.rollback()  # a fresh snapshot every round
                    if rows:
                        with self._changed:
                            for row in rows:
                                self._latest[row.idem_key] = Attempt(
                                    int(row.id), row.idem_key, int(row.pid)
                                )
                                self._seen = max(self._seen, int(row.id))
                            self._changed.notify_all()
                    self._stop.wait(self._interval)
        except Exception as exc:
            self.error = exc
            with self._changed:
                self._changed.notify_all()

    def latest_id(self, key: str) -> int:
        with self._changed:
            attempt = self._latest.get(key)
            return 0 if attempt is None else attempt.id

    def wait_for_new(self, key: str, after_id: int, give_up: Callable[[], bool]) -> Attempt | None:
        """The first attempt of ``key`` newer than ``after_id``, or ``None`` once ``give_up()``."""
        deadline = time.monotonic() + _REQUEST_TIMEOUT
        with self._changed:
            while time.monotonic() < deadline:
                if self.error is not None:
                    raise RuntimeError("the attempt watcher failed") from self.error
                attempt = self._latest.get(key)
                if attempt is not None and attempt.id > after_id:
                    return attempt
                if give_up():
                    return None
                self._changed.wait(0.01)
        raise AssertionError(f"no attempt of {key} appeared and its request never ended")


@dataclasses.dataclass(frozen=True)
class Kill:
    key: str
    kind: str
    attempt_id: int
    pid: int


@dataclasses.dataclass
class CampaignResult:
    kills: list[Kill]
    phases: collections.Counter[str]  # how far the killed view had got: its attempt's phase
    requests: int
    answered_although_killed: int  # the response got out just before the kill
    finished_before_kill: int  # plans whose request ended before the kill was due
    seconds: float


class _KeyState:
    def __init__(self, plans: list[KillPlan]) -> None:
        self.plans = collections.deque(plans)
        self.ready_at = 0.0
        self.busy = False
        self.done = False


class KillCampaign:
    """Works through a schedule with ``lanes`` concurrent requests, killing as planned."""

    def __init__(
        self,
        harness: AtomicHarness,
        server: GunicornServer,
        schedule: dict[str, list[KillPlan]],
        bodies: dict[str, dict[str, Any]],
        *,
        lease: float,
        lanes: int = 3,
    ) -> None:
        self.harness = harness
        self.server = server
        self.bodies = bodies
        self.rest = lease + 0.3  # after a kill, the key waits for its lease to lapse
        self.lanes = lanes
        self._keys = {key: _KeyState(plans) for key, plans in schedule.items()}
        self._lock = threading.Lock()
        self._kills: list[Kill] = []
        self._requests = 0
        self._answered = 0
        self._finished_first = 0

    def run(self) -> CampaignResult:
        started = time.monotonic()
        with (
            AttemptWatcher(self.harness.engine, self.harness.attempts) as watcher,
            ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix="http") as http,
            ThreadPoolExecutor(max_workers=self.lanes, thread_name_prefix="lane") as lanes,
        ):
            for lane in [lanes.submit(self._lane, watcher, http) for _ in range(self.lanes)]:
                lane.result()
        phases = self.harness.phases([kill.attempt_id for kill in self._kills])
        return CampaignResult(
            kills=list(self._kills),
            phases=collections.Counter(
                phases.get(kill.attempt_id, "unknown") for kill in self._kills
            ),
            requests=self._requests,
            answered_although_killed=self._answered,
            finished_before_kill=self._finished_first,
            seconds=time.monotonic() - started,
        )

    def _take(self) -> tuple[str, KillPlan] | None:
        """The next key that is free and rested, with its next plan; ``None`` when all are spent."""
        while True:
            with self._lock:
                pending = [
                    (state.ready_at, key)
                    for key, state in self._keys.items()
                    if not state.done and state.plans and not state.busy
                ]
                busy = any(state.busy for state in self._keys.values())
                if not pending and not busy:
                    return None
                if pending:
                    ready_at, key = min(pending)
                    if ready_at <= time.monotonic():
                        state = self._keys[key]
                        state.busy = True
                        return key, state.plans[0]
            time.sleep(0.02)

    def _settle(self, key: str, *, plan_spent: bool, done: bool, rest: float) -> None:
        with self._lock:
            state = self._keys[key]
            state.busy = False
            state.done = state.done or done
            if plan_spent:
                state.plans.popleft()
            state.ready_at = time.monotonic() + rest

    def _lane(self, watcher: AttemptWatcher, http: ThreadPoolExecutor) -> None:
        while (job := self._take()) is not None:
            key, plan = job
            after_id = watcher.latest_id(key)
            with self._lock:
                self._requests += 1
            future: Future[requests.Response] = http.submit(
                post_payment, self.server.url, key, self.bodies[key], plan.header
            )
            attempt = watcher.wait_for_new(key, after_id, future.done)
            if attempt is None:
                # The view did not run: the lease of an earlier kill still holds (409),
                # or the key is complete (a replay). Try this plan again later.
                response = _outcome(future)
                completed = response is not None and response.status_code == 201
                self._settle(key, plan_spent=False, done=completed, rest=0.5)
                continue
            time.sleep(plan.delay)
            if future.done():
                with self._lock:
                    self._finished_first += 1
                response = _outcome(future)
                completed = response is not None and response.status_code == 201
                self._settle(key, plan_spent=True, done=completed, rest=0.0)
                continue
            try:
                os.kill(attempt.pid, signal.SIGKILL)
            except ProcessLookupError:
                # Already dead: another lane killed this worker late, after its own request
                # had answered and the worker had moved on to ours. Not counted as ours.
                pass
            else:
                with self._lock:
                    self._kills.append(Kill(key, plan.kind, attempt.id, attempt.pid))
            response = _outcome(future)
            if response is not None:
                with self._lock:
                    self._answered += 1
            self._settle(key, plan_spent=True, done=False, rest=self.rest)


def _outcome(future: Future[requests.Response]) -> requests.Response | None:
    """The response, or ``None`` when the connection died with the worker."""
    try:
        return future.result(timeout=_REQUEST_TIMEOUT + 5)
    except requests.RequestException:
        return None


def settle_all(
    base_url: str, bodies: dict[str, dict[str, Any]], *, within: float = 120.0, parallel: int = 4
) -> dict[str, requests.Response]:
    """Retry every key with its body until it answers 201; a 409 means its lease still holds."""

    def settle(key: str) -> requests.Response:
        deadline = time.monotonic() + within
        while True:
            response = post_payment(base_url, key, bodies[key])
            if response.status_code != 409 or time.monotonic() > deadline:
                return response
            time.sleep(0.2)

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return dict(zip(bodies, pool.map(settle, bodies), strict=True))


@dataclasses.dataclass
class Audit:
    """What the database holds once every key has settled."""

    rows_by_key: dict[str, list[Any]]
    stored: dict[str, dict[str, Any] | None]  # the completed record's response body, as JSON

    @property
    def keys_with_duplicates(self) -> list[str]:
        return sorted(key for key, rows in self.rows_by_key.items() if len(rows) > 1)

    @property
    def total_rows(self) -> int:
        return sum(len(rows) for rows in self.rows_by_key.values())


def audit(harness: AtomicHarness, keys: list[str]) -> Audit:
    stored: dict[str, dict[str, Any] | None] = {}
    for key in keys:
        record = harness.record(key)
        if record is None or record.response is None:
            stored[key] = None
        else:
            stored[key] = json.loads(record.response.body)
    return Audit(harness.payments_by_key(), stored)
