"""The soak (issue 22 item 7): mixed traffic under gunicorn while Redis and PostgreSQL fail.

    .venv/bin/python bench/soak.py [--minutes 20] [--fault-every 60] [--clients 8]

``make soak`` runs it (not in CI). For ``--minutes`` it drives ``bench/soakapp.py``
under gunicorn (gthread, 2 workers x 4 threads) with 8 client threads: new keys, replays
of completed keys, duplicates parked behind a slow original, slow views, and pairs of
``idempotency.once()`` callers racing for one job key, plus replays of those. Every
``--fault-every`` seconds, alternately, the private redis-server is SIGKILLed and started
again on its port after ``--redis-down`` seconds, or PostgreSQL is cut for
``--cut-seconds`` through a loopback TCP proxy (the workers reach it only through that).
Then every key that never got its answer is retried until it does, and it counts:

- executions per key, from the view log the workers append to (one ``write()`` per
  line, so it survives a SIGKILLed worker): each key must have run exactly once;
- every 5xx, classified by time against the cut windows (a 503 during a PostgreSQL cut
  plus a small margin is the contract, C25; a 500, or a 5xx while only Redis was down,
  is a failure, C24);
- each worker's RSS and open file descriptors, the app's PostgreSQL connections
  (``pg_stat_activity``) and Redis clients (``CLIENT LIST``) every 10 s;
- p50/p99 latency per minute, and the machine's load average.

Results: ``--out`` (default bench/results/soak/: summary.json, summary.md, samples.csv,
requests.csv.gz, views.log.gz, gunicorn.log) and a plot (``--plot``, default
docs/soak.png). Everything is private: a database ``soak_<random>`` on the server of
``IDEMPOTENCY_TEST_DATABASE_URL`` (dropped at the end), its own redis-server and proxy,
all stopped by pid. The machine's own PostgreSQL and Redis are never restarted.
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import gzip
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg2
import redis
import requests
from sqlalchemy.engine import make_url

from bench.harness import dsn, loadavg, system_binary
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine
from tests.support.gunicorn import GunicornServer
from tests.support.redis_server import RedisServer
from tests.support.tcp_proxy import TcpProxy

REPO = Path(__file__).resolve().parents[1]
BASE_URL = os.environ.get(
    "IDEMPOTENCY_TEST_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)
TABLE = "soak_records"
APP_NAME = "soak-app"  # application_name of the workers' PostgreSQL connections
LEASE = 10.0
WAIT = 5.0
SAMPLE_EVERY = 10.0
#: A request that overlaps [cut start - BEFORE, cut end + AFTER] may get 503 (C25).
CUT_MARGIN_BEFORE = 0.5
CUT_MARGIN_AFTER = 3.0
REQUEST_TIMEOUT = 30.0
#: (action, weight) of the client mix.
MIX = (
    ("new", 30),
    ("replay", 25),
    ("parked", 10),
    ("slow", 10),
    ("job", 15),
    ("job-replay", 10),
)


# -- what happened ----------------------------------------------------------------------


@dataclasses.dataclass
class Answer:
    start: float
    end: float
    action: str
    key: str
    status: int | None  # None: no answer (timeout, reset)
    replayed: bool = False  # Idempotent-Replayed on a view; not owned on a job
    code: str = ""
    error: str = ""


@dataclasses.dataclass
class Key:
    name: str
    kind: str  # "work" or "job"
    body: dict[str, Any]
    settled: bool = False
    first_body: bytes | None = None  # the original's answer, to compare replays with (C9)
    retry_at: float = 0.0


class Ledger:
    """Every key and every answer, from many client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[str, Key] = {}
        self.answers: list[Answer] = []
        self.settled: dict[str, list[str]] = {"work": [], "job": []}
        self.replay_mismatches: list[str] = []

    def new_key(self, name: str, kind: str, body: dict[str, Any]) -> Key:
        key = Key(name, kind, body)
        with self.lock:
            self.keys[name] = key
        return key

    def record(self, key: Key, answer: Answer, content: bytes | None, payload: Any) -> None:
        with self.lock:
            self.answers.append(answer)
            ok = answer.status == (201 if key.kind == "work" else 200)
            if not ok:
                if not key.settled:
                    key.retry_at = time.time() + 1.0
                return
            # What a replay must repeat: the view's body byte for byte; the job's result.
            same = content if key.kind == "work" else json.dumps(payload["result"]).encode()
            if key.first_body is None:
                key.first_body = same
            elif same != key.first_body:
                self.replay_mismatches.append(key.name)
            if not key.settled:
                key.settled = True
                self.settled[key.kind].append(key.name)

    def completed(self, kind: str, rng: random.Random) -> Key | None:
        with self.lock:
            names = self.settled[kind]
            return self.keys[rng.choice(names)] if names else None

    def due_retry(self) -> Key | None:
        now = time.time()
        with self.lock:
            for key in self.keys.values():
                if not key.settled and key.first_body is None and 0 < key.retry_at <= now:
                    key.retry_at = now + 5.0  # taken; record() reschedules on failure
                    return key
        return None

    def unsettled(self) -> list[Key]:
        with self.lock:
            return [k for k in self.keys.values() if not k.settled]


def call(session: Any, url: str, key: Key, action: str, ledger: Ledger) -> Answer:
    """One request for ``key``; its answer is recorded."""
    start = time.time()
    content: bytes | None = None
    payload: Any = None
    try:
        if key.kind == "work":
            response = session.post(
                f"{url}/work",
                json=key.body,
                headers={"Idempotency-Key": key.name},
                timeout=REQUEST_TIMEOUT,
            )
            replayed = response.headers.get("Idempotent-Replayed") == "true"
        else:
            response = session.post(f"{url}/job", json=key.body, timeout=REQUEST_TIMEOUT)
            replayed = False
            if response.status_code == 200:
                payload = response.json()
                replayed = not payload["owned"]
        code = ""
        if response.headers.get("Content-Type", "").startswith("application/problem+json"):
            code = str(response.json().get("code", ""))
        content = response.content
        answer = Answer(start, time.time(), action, key.name, response.status_code, replayed, code)
    except requests.RequestException as exc:
        answer = Answer(start, time.time(), action, key.name, None, error=type(exc).__name__)
    ledger.record(key, answer, content, payload)
    return answer


def client(
    tid: int, url: str, ledger: Ledger, deadline: float, seed: int, stop: threading.Event
) -> None:
    rng = random.Random(seed * 1000 + tid)
    session = requests.Session()
    actions = [a for a, _ in MIX]
    weights = [w for _, w in MIX]
    i = 0
    while time.time() < deadline and not stop.is_set():
        i += 1
        retry = ledger.due_retry()
        if retry is not None:
            call(session, url, retry, "retry", ledger)
            continue
        action = rng.choices(actions, weights)[0]
        name = f"{action[0]}{tid}-{i}-{uuid.uuid4().hex[:6]}"
        if action == "new":
            call(session, url, ledger.new_key(name, "work", {"n": i, "sleep": 0}), action, ledger)
        elif action == "slow":
            body = {"n": i, "sleep": round(rng.uniform(0.5, 2.0), 2)}
            call(session, url, ledger.new_key(name, "work", body), action, ledger)
        elif action == "parked":
            # The original runs 1.5 s; a duplicate sent meanwhile parks and gets the replay.
            key = ledger.new_key(name, "work", {"n": i, "sleep": 1.5})
            original = threading.Thread(
                target=call, args=(requests, url, key, "parked-original", ledger)
            )
            original.start()
            time.sleep(0.3)
            call(session, url, key, "parked-duplicate", ledger)
            original.join()
        elif action == "job":
            # Two callers race for one job key: one owns it, the other waits for its result.
            key = ledger.new_key(name, "job", {"key": name, "n": i, "sleep": 0.5})
            first = threading.Thread(target=call, args=(requests, url, key, "job", ledger))
            first.start()
            time.sleep(0.1)
            call(session, url, key, "job-duplicate", ledger)
            first.join()
        else:
            kind = "work" if action == "replay" else "job"
            key_or_none = ledger.completed(kind, rng)
            if key_or_none is not None:
                call(session, url, key_or_none, action, ledger)
    session.close()


# -- faults ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Window:
    kind: str  # "postgresql-cut" or "redis-down"
    start: float
    end: float


def fault_loop(
    args: argparse.Namespace,
    t0: float,
    deadline: float,
    proxy: TcpProxy,
    redis_server: RedisServer,
    windows: list[Window],
    stop: threading.Event,
) -> None:
    """Alternately kill Redis and cut PostgreSQL; nothing starts in the last 20 s."""
    at = t0 + args.first_fault
    kind = 0
    while at <= deadline - 20 and not stop.is_set():
        if stop.wait(max(0.0, at - time.time())):
            return
        start = time.time()
        if kind == 0:
            redis_server.kill()  # SIGKILL by pid
            stop.wait(args.redis_down)
            redis_server.start()  # same port
            windows.append(Window("redis-down", start, time.time()))
        else:
            proxy.cut()
            try:
                stop.wait(args.cut_seconds)
            finally:
                proxy.restore()
            windows.append(Window("postgresql-cut", start, time.time()))
        print(f"  {windows[-1].kind} at +{start - t0:.0f} s", flush=True)
        kind ^= 1
        at += args.fault_every


# -- resources ------------------------------------------------------------------------------


def proc_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Sampler:
    """Every ``SAMPLE_EVERY`` s: each worker's RSS and fds, the app's server connections."""

    def __init__(self, server: GunicornServer, db_dsn: str, redis_port: int, t0: float) -> None:
        self.server = server
        self.db_dsn = db_dsn
        self.redis_port = redis_port
        self.t0 = t0
        self.rows: list[dict[str, Any]] = []
        self.pids_seen: set[int] = set()

    def pg_connections(self) -> int | None:
        try:
            with psycopg2.connect(self.db_dsn, connect_timeout=3) as conn, conn.cursor() as cur:
                cur.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND application_name = %s",
                    (APP_NAME,),
                )
                return int(cur.fetchone()[0])
        except psycopg2.Error:
            return None

    def redis_clients(self) -> int | None:
        client = redis.Redis(port=self.redis_port, socket_timeout=2, socket_connect_timeout=2)
        try:
            return len(client.client_list()) - 1  # not this one
        except redis.RedisError:
            return None
        finally:
            client.close()

    def sample(self, phase: str) -> dict[str, Any]:
        pids = sorted(self.server.worker_pids())
        self.pids_seen.update(pids)
        row: dict[str, Any] = {
            "t": round(time.time() - self.t0, 1),
            "phase": phase,
            "load1": float(loadavg().split()[0]),
            "workers": " ".join(map(str, pids)),
            "rss_kib": " ".join(str(proc_rss_kib(p)) for p in pids),
            "fds": " ".join(str(proc_fds(p)) for p in pids),
            "pg_connections": self.pg_connections(),
            "redis_clients": self.redis_clients(),
        }
        self.rows.append(row)
        return row

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(SAMPLE_EVERY):
            self.sample("load")


# -- the run --------------------------------------------------------------------------------


@contextmanager
def soak_database(base_url: str) -> Any:
    """``soak_<random>`` on the server of ``base_url``, dropped afterwards (also on failure)."""
    name = f"soak_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(dsn(base_url), connect_timeout=3)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        try:
            yield make_url(base_url).set(database=name)
        finally:
            with admin.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()


def settle(url: str, ledger: Ledger, within: float) -> None:
    """Retry every key without its answer (a 503 in a cut, a 409) until it has one."""
    deadline = time.time() + within
    session = requests.Session()
    while time.time() < deadline:
        pending = ledger.unsettled()
        if not pending:
            break
        for key in pending:
            call(session, url, key, "settle", ledger)
        time.sleep(1.0)
    session.close()


def cut_off_completions(view_log: Path) -> list[str]:
    """Keys whose owner could not store its result: the store was cut at its completion."""
    if not view_log.exists():
        return []
    return sorted(
        {
            fields[5]
            for fields in (line.split() for line in view_log.read_text().splitlines())
            if fields[2:5] == ["store-error", "database", "complete"] and fields[5] != "-"
        }
    )


def audit(url: str, ledger: Ledger, view_log: Path) -> None:
    """Ask once more, after a lease, for every key whose completion a cut swallowed.

    Its client got its answer, so the traffic may never have asked again; a late
    duplicate shows whether the result was kept or the claim lapsed and the view
    runs a second time (what C14/C15 allow when the completion never committed).
    """
    keys = [ledger.keys[name] for name in cut_off_completions(view_log) if name in ledger.keys]
    if not keys:
        return
    time.sleep(LEASE + 1)
    session = requests.Session()
    for key in keys:
        call(session, url, key, "audit", ledger)
    session.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    redis_binary = system_binary("redis-server")
    if redis_binary is None:
        raise SystemExit("soak: redis-server is not on PATH")
    with (
        soak_database(args.database_url) as db_url,
        tempfile.TemporaryDirectory(prefix="soak-") as tmp,
    ):
        direct = db_url.render_as_string(hide_password=False)
        engine = create_store_engine(direct)
        DurableStore(lambda: engine, table_name=TABLE).create_table()
        engine.dispose()
        view_log = Path(tmp) / "views.log"
        redis_server = RedisServer(redis_binary, Path(tmp) / "redis").start()
        proxy = TcpProxy(db_url.host or "127.0.0.1", db_url.port or 5432).start()
        proxied = db_url.set(host="127.0.0.1", port=proxy.port).update_query_dict(
            {"application_name": APP_NAME}
        )
        server = GunicornServer(
            "bench.soakapp:create_app()",
            env={
                "DATABASE_URL": proxied.render_as_string(hide_password=False),
                "REDIS_URL": redis_server.url,
                "IDEM_TABLE": TABLE,
                "IDEM_WAIT": str(WAIT),
                "IDEM_LEASE": str(LEASE),
                "SOAK_VIEW_LOG": str(view_log),
            },
            workers=args.workers,
            threads=args.threads,
            timeout=120,
        )
        stop = threading.Event()
        try:
            server.start(ready_within=120)
            t0 = time.time()
            deadline = t0 + args.minutes * 60
            ledger = Ledger()
            windows: list[Window] = []
            sampler = Sampler(server, dsn(direct), redis_server.port, t0)
            sampler.sample("start")
            threads = [threading.Thread(target=sampler.loop, args=(stop,), daemon=True)]
            threads.append(
                threading.Thread(
                    target=fault_loop,
                    args=(args, t0, deadline, proxy, redis_server, windows, stop),
                    daemon=True,
                )
            )
            clients = [
                threading.Thread(
                    target=client,
                    args=(tid, server.url, ledger, deadline, args.seed, stop),
                    daemon=True,
                )
                for tid in range(args.clients)
            ]
            print(
                f"soak: {args.minutes:g} min, {args.clients} clients, gunicorn "
                f"{args.workers}x{args.threads} on {server.url}, load {loadavg()}",
                flush=True,
            )
            for thread in threads + clients:
                thread.start()
            for thread in clients:
                thread.join(timeout=args.minutes * 60 + REQUEST_TIMEOUT * 3)
            load_end = time.time()
            sampler.sample("end of load")
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
            proxy.restore()
            if redis_server.process is None:
                redis_server.start()
            # A claim whose completion a cut swallowed lapses with its lease (C15); then retry.
            if ledger.unsettled():
                time.sleep(LEASE + 1)
            settle(server.url, ledger, within=120)
            audit(server.url, ledger, view_log)
            time.sleep(SAMPLE_EVERY)
            sampler.sample("quiet")
            gunicorn_log = Path(server._log.name).read_text(errors="replace")
        finally:
            stop.set()
            server.stop()
            proxy.stop()
            redis_server.stop()
        views = view_log.read_text() if view_log.exists() else ""
        return analyse(
            args, t0, load_end, ledger, windows, sampler, views, gunicorn_log, str(db_url.database)
        )


# -- the verdict ----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def in_cut(answer: Answer, windows: list[Window]) -> bool:
    return any(
        w.kind == "postgresql-cut"
        and answer.start <= w.end + CUT_MARGIN_AFTER
        and answer.end >= w.start - CUT_MARGIN_BEFORE
        for w in windows
    )


def analyse(
    args: argparse.Namespace,
    t0: float,
    load_end: float,
    ledger: Ledger,
    windows: list[Window],
    sampler: Sampler,
    views: str,
    gunicorn_log: str,
    database: str,
) -> dict[str, Any]:
    executions: dict[str, list[list[str]]] = collections.defaultdict(list)
    store_errors: dict[str, list[list[str]]] = collections.defaultdict(list)
    for line in views.splitlines():
        fields = line.split()
        if fields[2] in ("view-start", "job-start"):
            executions[fields[3]].append(fields)
        elif fields[2] == "store-error":
            store_errors[fields[5]].append(fields)
    per_key = collections.Counter(len(executions.get(name, ())) for name in ledger.keys)
    cut_off = {
        name
        for name, errors in store_errors.items()
        if any(f[3:5] == ["database", "complete"] for f in errors)
    }
    twice = {
        name: {
            "starts": [round(float(f[0]) - t0, 2) for f in runs],
            "pids": [f[1] for f in runs],
            "store_errors": [" ".join(f[2:5]) for f in store_errors.get(name, [])],
            "cuts": [
                [round(w.start - t0, 1), round(w.end - t0, 1)]
                for w in windows
                if w.kind == "postgresql-cut"
                and float(runs[0][0]) <= w.end + CUT_MARGIN_AFTER
                and float(runs[-1][0]) >= w.start - LEASE - 60
            ],
            "answers": [
                [round(a.start - t0, 2), a.action, a.status, a.replayed, a.code]
                for a in ledger.answers
                if a.key == name
            ],
        }
        for name, runs in executions.items()
        if len(runs) > 1
    }
    unknown = sorted(set(executions) - set(ledger.keys))
    settled_without_run = sorted(
        name for name, key in ledger.keys.items() if key.settled and name not in executions
    )
    answers = ledger.answers
    fivexx = [a for a in answers if a.status is not None and a.status >= 500]
    fivexx_in = [a for a in fivexx if in_cut(a, windows)]
    fivexx_out = [a for a in fivexx if not in_cut(a, windows)]
    no_answer = [a for a in answers if a.status is None]

    minutes: list[dict[str, Any]] = []
    by_minute: dict[int, list[Answer]] = collections.defaultdict(list)
    for a in answers:  # the load's minutes; the settling retries afterwards are not in them
        if a.start < min(load_end, t0 + args.minutes * 60):
            by_minute[int((a.start - t0) // 60)].append(a)
    for minute in sorted(by_minute):
        got = by_minute[minute]
        latencies = [1000 * (a.end - a.start) for a in got if a.status is not None]
        fast = [
            1000 * (a.end - a.start)
            for a in got
            if a.status is not None and a.action in ("new", "replay", "job-replay")
        ]
        minutes.append(
            {
                "minute": minute + 1,
                "requests": len(got),
                "p50_ms": round(percentile(latencies, 0.50), 1),
                "p99_ms": round(percentile(latencies, 0.99), 1),
                "fast_p50_ms": round(percentile(fast, 0.50), 1),
                "fast_p99_ms": round(percentile(fast, 0.99), 1),
                "statuses": dict(sorted(collections.Counter(str(a.status) for a in got).items())),
            }
        )
    rows = sampler.rows
    first = next((r for r in rows if r["phase"] == "load" and r["t"] >= 25), rows[0])
    last_load = [r for r in rows if r["phase"] in ("load", "end of load")][-1]
    quiet = rows[-1]
    gunicorn_errors = [
        line for line in gunicorn_log.splitlines() if "Traceback" in line or "[ERROR]" in line
    ]
    summary: dict[str, Any] = {
        "minutes": args.minutes,
        "database": database,
        "clients": args.clients,
        "gunicorn": f"gthread {args.workers} workers x {args.threads} threads",
        "lease_s": LEASE,
        "wait_s": WAIT,
        "cut_margin_s": [CUT_MARGIN_BEFORE, CUT_MARGIN_AFTER],
        "load_avg": {
            "start": rows[0]["load1"],
            "end": last_load["load1"],
            "min": min(r["load1"] for r in rows),
            "max": max(r["load1"] for r in rows),
            "mean": round(statistics.mean(r["load1"] for r in rows), 2),
        },
        "faults": [
            {"kind": w.kind, "start_s": round(w.start - t0, 1), "end_s": round(w.end - t0, 1)}
            for w in windows
        ],
        "keys": len(ledger.keys),
        "keys_by_kind": dict(collections.Counter(k.kind for k in ledger.keys.values())),
        "unsettled_keys": [k.name for k in ledger.unsettled()],
        "executions_per_key": {str(n): c for n, c in sorted(per_key.items())},
        "executed_more_than_once": twice,
        "executions_of_unknown_keys": unknown,
        "settled_without_execution": settled_without_run,
        "replay_mismatches": ledger.replay_mismatches,
        "requests": len(answers),
        "by_action": {
            action: dict(
                sorted(
                    collections.Counter(
                        str(a.status) for a in answers if a.action == action
                    ).items()
                )
            )
            for action in sorted({a.action for a in answers})
        },
        "replays": sum(a.replayed for a in answers),
        "5xx_inside_cuts": dict(collections.Counter(str(a.status) for a in fivexx_in)),
        "5xx_outside_cuts": [
            [round(a.start - t0, 2), round(a.end - t0, 2), a.action, a.key, a.status, a.code]
            for a in fivexx_out
        ],
        "no_answer": [[round(a.start - t0, 2), a.action, a.key, a.error] for a in no_answer],
        "worker_pids_seen": sorted(sampler.pids_seen),
        "resources": {"start": first, "end_of_load": last_load, "quiet": quiet},
        "per_minute": minutes,
        "gunicorn_error_lines": gunicorn_errors[:50],
    }
    summary["completion_cut_off_keys"] = len(cut_off)
    summary["reruns_after_cut_off_completion"] = sorted(set(twice) & cut_off)
    summary["verdict"] = {
        "every_key_once": set(per_key) <= {1} and not unknown,
        "no_unexplained_rerun": not (set(twice) - cut_off),
        "no_5xx_outside_cuts": not fivexx_out,
        "no_500": not any(a.status == 500 for a in answers),
        "replays_identical": not ledger.replay_mismatches,
        "workers_never_replaced": len(sampler.pids_seen) == args.workers,
    }
    write_results(args, summary, t0, ledger, sampler, views, gunicorn_log)
    return summary


def write_results(
    args: argparse.Namespace,
    summary: dict[str, Any],
    t0: float,
    ledger: Ledger,
    sampler: Sampler,
    views: str,
    gunicorn_log: str,
) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(out / "samples.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(sampler.rows[0]))
        writer.writeheader()
        writer.writerows(sampler.rows)
    with gzip.open(out / "requests.csv.gz", "wt", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["start_s", "ms", "action", "key", "status", "replayed", "code", "error"])
        for a in sorted(ledger.answers, key=lambda a: a.start):
            writer.writerow(
                [
                    f"{a.start - t0:.3f}",
                    f"{1000 * (a.end - a.start):.1f}",
                    a.action,
                    a.key,
                    a.status or "",
                    int(a.replayed),
                    a.code,
                    a.error,
                ]
            )
    with gzip.open(out / "views.log.gz", "wt") as f:
        f.write(f"# t0 {t0:.3f}: time pid event key (store-error: tier action key)\n")
        f.write(views)
    (out / "gunicorn.log").write_text(gunicorn_log)
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, sampler.rows, Path(args.plot))


def _split(value: str) -> list[float]:
    return [float(v) for v in value.split() if v != "None"]


def markdown(s: dict[str, Any]) -> str:
    r = s["resources"]
    lines = [
        f"# Soak: {s['minutes']:g} minutes",
        "",
        f"{s['gunicorn']}, {s['clients']} client threads, lease {s['lease_s']:g} s, "
        f"wait {s['wait_s']:g} s; load average (1 min) {s['load_avg']['min']}–"
        f"{s['load_avg']['max']}, mean {s['load_avg']['mean']}.",
        "",
        f"- keys: {s['keys']} {s['keys_by_kind']}; requests: {s['requests']}; "
        f"replays: {s['replays']}",
        f"- executions per key: {s['executions_per_key']}",
        f"- keys executed more than once: {len(s['executed_more_than_once'])}, of them after"
        f" their first run's completion was cut off (C14/C15):"
        f" {len(s['reruns_after_cut_off_completion'])}",
        f"- keys whose completion was cut off: {s['completion_cut_off_keys']}; a late"
        f" request for each after one lease: {s['by_action'].get('audit', {})}",
        f"- keys never answered after settling: {len(s['unsettled_keys'])}",
        f"- replays not byte-identical: {len(s['replay_mismatches'])}",
        f"- 5xx inside PostgreSQL cuts: {s['5xx_inside_cuts']}; outside: "
        f"{len(s['5xx_outside_cuts'])}; no answer: {len(s['no_answer'])}",
        f"- faults: {collections.Counter(f['kind'] for f in s['faults'])}",
        f"- verdict: {s['verdict']}",
        "",
        "| | t (s) | load | worker RSS (MiB) | worker fds | PG connections | Redis clients |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in (
        ("start", r["start"]),
        ("end of load", r["end_of_load"]),
        ("quiet", r["quiet"]),
    ):
        rss = " / ".join(f"{v / 1024:.1f}" for v in _split(row["rss_kib"]))
        fds = " / ".join(f"{v:g}" for v in _split(row["fds"]))
        lines.append(
            f"| {label} | {row['t']} | {row['load1']} | {rss} | {fds} | "
            f"{row['pg_connections']} | {row['redis_clients']} |"
        )
    lines += [
        "",
        "| minute | requests | p50 ms | p99 ms | fast p50 ms | fast p99 ms | statuses |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in s["per_minute"]:
        statuses = ", ".join(f"{k}: {v}" for k, v in m["statuses"].items())
        lines.append(
            f"| {m['minute']} | {m['requests']} | {m['p50_ms']} | {m['p99_ms']} | "
            f"{m['fast_p50_ms']} | {m['fast_p99_ms']} | {statuses} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    minutes = summary["per_minute"]
    xs = [m["minute"] - 0.5 for m in minutes]
    ax = axes[0]
    ax.plot(xs, [m["p50_ms"] for m in minutes], "o-", label="p50, all requests")
    ax.plot(xs, [m["p99_ms"] for m in minutes], "o-", label="p99, all requests")
    ax.plot(xs, [m["fast_p50_ms"] for m in minutes], "s--", label="p50, new keys and replays")
    ax.plot(xs, [m["fast_p99_ms"] for m in minutes], "s--", label="p99, new keys and replays")
    ax.set_yscale("log")
    ax.set_ylabel("latency per minute (ms)")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    t = [r["t"] / 60 for r in rows]
    samples = [
        (axes[1], "rss_kib", 1 / 1024, "worker RSS (MiB)"),
        (axes[2], "fds", 1, "worker open fds"),
    ]
    for ax, field, scale, label in samples:
        per_worker = [_split(r[field]) for r in rows]
        for w in range(max(len(v) for v in per_worker)):
            ax.plot(
                t,
                [v[w] * scale if w < len(v) else float("nan") for v in per_worker],
                label=f"worker {w + 1}",
            )
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
    ax = axes[3]
    for field, label in (("pg_connections", "PostgreSQL"), ("redis_clients", "Redis")):
        ax.plot(
            t,
            [float("nan") if r[field] is None else r[field] for r in rows],
            "o-",
            markersize=3,
            label=label,
        )
    ax.set_ylabel("server connections")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("minutes")
    ax.legend(fontsize=8, loc="lower right")
    for ax in axes:
        for f in summary["faults"]:
            colour = "tab:red" if f["kind"] == "postgresql-cut" else "tab:blue"
            ax.axvspan(f["start_s"] / 60, f["end_s"] / 60, color=colour, alpha=0.25, lw=0)
    axes[0].set_title(
        f"Soak, {summary['minutes']:g} min: red = PostgreSQL cut, blue = Redis killed "
        f"(load avg {summary['load_avg']['mean']})",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--fault-every", type=float, default=60, help="seconds between faults")
    parser.add_argument("--first-fault", type=float, default=40, help="seconds into the run")
    parser.add_argument("--cut-seconds", type=float, default=5)
    parser.add_argument("--redis-down", type=float, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    parser.add_argument("--database-url", default=BASE_URL)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "soak"))
    parser.add_argument("--plot", default=str(REPO / "docs" / "soak.png"))
    args = parser.parse_args()
    started = time.time()
    summary = run(args)
    print(markdown(summary))
    print(f"soak: {time.time() - started:.0f} s; results in {args.out}, plot {args.plot}")
    if not all(summary["verdict"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
