"""The chaos rig: gunicorn, a private redis-server, and proxies that break the network.

Every scenario gets a fresh rig: its own tables, its own redis-server, a proxy in
front of the store's database and one in front of Redis (both on loopback), and
gunicorn workers that reach the store and Redis only through those proxies. The
store is PostgreSQL unless a scenario asks for another database (``rig`` is
parametrized indirectly: ``"postgresql"`` or ``"mariadb"``). The ledger (claims
and runs, see chaosapp.py) is always written to PostgreSQL directly, so faults
never hide an execution, whichever database the store is on. Everything is
stopped by pid at the end, also when the test fails.

Each scenario reports one row (requests, executions, replays, 409s, 422s, 503s,
5xx...) with its test report, printed as a table at the end of the run.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import requests
from sqlalchemy import MetaData, func, select
from sqlalchemy.engine import URL

from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine
from tests.chaos.chaosapp import ledger_tables
from tests.conftest import driver_url, redis_server_binary
from tests.support.gunicorn import GunicornServer
from tests.support.redis_server import RedisServer
from tests.support.summary import add_row
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until as _wait_until

#: Seconds any "eventually" may take on a loaded 2-core machine.
EVENTUALLY = 60.0


# -- answers -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Answer:
    """What one HTTP attempt got: a status, or ``None`` when no answer came (timeout, reset)."""

    key: str
    status: int | None
    replayed: bool = False
    run: int | None = None
    code: str | None = None
    error: str | None = None

    @property
    def original(self) -> bool:
        return self.status == 201 and not self.replayed


def send(
    url: str, key: str, body: Any, *, timeout: float = 30.0, sleep: float | None = None
) -> Answer:
    """One POST; a timeout or a dropped connection becomes an :class:`Answer` without a status."""
    headers = {"Idempotency-Key": key}
    if sleep is not None:
        headers["X-Sleep"] = str(sleep)
    try:
        response = requests.post(f"{url}/work/item", json=body, headers=headers, timeout=timeout)
    except requests.RequestException as exc:
        return Answer(key, None, error=type(exc).__name__)
    run = code = None
    if response.headers.get("Content-Type", "").startswith("application/problem+json"):
        code = response.json().get("code")
    elif response.status_code == 201:
        run = response.json()["run"]
    return Answer(
        key,
        response.status_code,
        replayed=response.headers.get("Idempotent-Replayed") == "true",
        run=run,
        code=code,
    )


class AnswerLog:
    """Every answer of a scenario, from many client threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answers: list[Answer] = []

    def add(self, answer: Answer) -> Answer:
        with self._lock:
            self.answers.append(answer)
        return answer

    def of(self, key: str) -> list[Answer]:
        return [a for a in self.answers if a.key == key]

    def statuses(self) -> collections.Counter[int | None]:
        return collections.Counter(a.status for a in self.answers)


# -- the rig --------------------------------------------------------------------------


#: The databases a scenario's store can be on: (session fixture, name in the summary).
STORE_DATABASES = {"postgresql": ("pg_url", "PostgreSQL"), "mariadb": ("mysql_url", "MariaDB")}


class ChaosRig:
    """Tables, a private Redis, two proxies and gunicorn servers for one scenario.

    ``store_url`` is the database the layer's records live on (reached through
    ``store_proxy``); ``ledger_url`` the PostgreSQL database the ledger is written
    to directly (the same database when the store is on PostgreSQL).
    """

    def __init__(
        self,
        store_url: URL,
        ledger_url: URL,
        redis_binary: str,
        directory: Any,
        *,
        database: str = "PostgreSQL",
    ) -> None:
        self.database = database
        self.table = f"chaos_{uuid.uuid4().hex[:10]}"
        self.direct_url = store_url.render_as_string(hide_password=False)
        self.engine = create_store_engine(self.direct_url)
        self.store = DurableStore(lambda: self.engine, table_name=self.table)
        self.store.create_table()
        self.ledger_url = ledger_url.render_as_string(hide_password=False)
        self.ledger = (
            self.engine
            if self.ledger_url == self.direct_url
            else create_store_engine(self.ledger_url)
        )
        self.claims, self.runs = ledger_tables(MetaData(), self.table)
        self.claims.create(self.ledger)
        self.runs.create(self.ledger)
        self.redis = RedisServer(redis_binary, directory / "redis").start()
        self.store_proxy = TcpProxy(store_url.host or "127.0.0.1", store_url.port or 5432).start()
        self.redis_proxy = TcpProxy("127.0.0.1", self.redis.port).start()
        self.proxied_store_url = store_url.set(
            host="127.0.0.1", port=self.store_proxy.port
        ).render_as_string(hide_password=False)
        self.servers: list[GunicornServer] = []
        self.inspector = redis.Redis(port=self.redis.port, socket_timeout=10)

    def serve(
        self, *, workers: int = 3, threads: int = 6, preload: bool = False, **settings: Any
    ) -> GunicornServer:
        env = {
            "DATABASE_URL": self.proxied_store_url,
            "LEDGER_URL": self.ledger_url,
            "IDEM_TABLE": self.table,
            "REDIS_URL": f"redis://127.0.0.1:{self.redis_proxy.port}/0",
        }
        env.update({key: str(value) for key, value in settings.items()})
        server = GunicornServer(
            "tests.chaos.chaosapp:create_app()",
            env=env,
            workers=workers,
            threads=threads,
            timeout=120,
            preload=preload,
        )
        self.servers.append(server)
        return server.start(ready_within=EVENTUALLY)

    def runs_by_key(self) -> dict[str, list[Any]]:
        """Every execution, oldest first, grouped by key."""
        with self.ledger.connect() as conn:
            rows = conn.execute(select(self.runs).order_by(self.runs.c.id)).all()
        grouped: dict[str, list[Any]] = collections.defaultdict(list)
        for row in rows:
            grouped[row.idem_key].append(row)
        return grouped

    def claims_by_key(self) -> collections.Counter[str]:
        t = self.claims
        with self.ledger.connect() as conn:
            rows = conn.execute(select(t.c.idem_key, func.count()).group_by(t.c.idem_key)).all()
        return collections.Counter({key: int(count) for key, count in rows})

    def claiming_pids(self) -> set[int]:
        """The worker processes that have claimed a key (each has read the store's identity)."""
        with self.ledger.connect() as conn:
            pids = conn.execute(select(self.claims.c.pid).distinct()).scalars()
            return {int(pid) for pid in pids}

    def total_runs(self) -> int:
        with self.ledger.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self.runs)).scalar_one())

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.store_proxy.stop()
        self.redis_proxy.stop()
        self.inspector.close()
        self.redis.stop()
        for table in (self.runs, self.claims):
            table.drop(self.ledger, checkfirst=True)
        self.store.table.drop(self.engine, checkfirst=True)
        self.store.identity_table.drop(self.engine, checkfirst=True)
        self.ledger.dispose()
        self.engine.dispose()


@pytest.fixture(
    params=["postgresql", "postgresql+psycopg"], ids=["postgresql", "postgresql-psycopg3"]
)
def rig(request: pytest.FixtureRequest, pg_database: URL, tmp_path: Any) -> Iterator[ChaosRig]:
    """A fresh rig; its store is on ``request.param``: PostgreSQL through psycopg2 and
    through psycopg 3 by default (issue 21), or what a scenario names (indirect)."""
    which = str(request.param)
    base, _, driver = which.partition("+")
    fixture, database = STORE_DATABASES[base]
    if fixture == "pg_url":
        store_url = driver_url(pg_database, driver or "psycopg2")
    else:
        store_url = request.getfixturevalue(fixture)
    built = ChaosRig(store_url, pg_database, redis_server_binary(), tmp_path, database=database)
    try:
        yield built
    finally:
        built.close()


# -- the summary ----------------------------------------------------------------------


@pytest.fixture
def chaos_summary(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``chaos_summary(name, answers, keys=..., executions=..., kills=...)`` adds a row
    to the "chaos summary" table printed at the end of the run (tests/support/summary.py).

    ``executions`` above ``keys`` are re-runs: each must be explained (a kill, a store cut off).
    """

    def report(name: str, log: AnswerLog, *, keys: int, executions: int, kills: int = 0) -> None:
        answers = log.answers
        row = {
            "keys": keys,
            "requests": len(answers),
            "executions": executions,
            "originals": sum(a.original for a in answers),
            "replays": sum(a.status == 201 and a.replayed for a in answers),
            "409": sum(a.status == 409 for a in answers),
            "422": sum(a.status == 422 for a in answers),
            "503": sum(a.status == 503 for a in answers),
            "other 5xx": sum(
                a.status is not None and a.status >= 500 and a.status != 503 for a in answers
            ),
            "no answer": sum(a.status is None for a in answers),
            "kills": kills,
        }
        add_row(request.node, "chaos summary", name, row)

    return report


@pytest.fixture(scope="session")
def pg_database(load_pg_database: URL) -> URL:
    """Every chaos scenario is heavy: its store and ledger live on the load server
    (tests/conftest.py), not on the machine's PostgreSQL that the other tests share."""
    return load_pg_database


wait_until = functools.partial(_wait_until, within=EVENTUALLY)
