"""Wake-up latency, replay latency and cache-hit share on one Redis node vs a 3-master Cluster.

Standalone (imports nothing from tests/): starts its own redis-server processes on free
loopback ports (stopped by process id), uses PostgreSQL from ``BENCH_DATABASE_URL``
(default ``postgresql+psycopg2://postgres@127.0.0.1:5432/test``), and runs two apps in
this process; a waiter parked in one is woken only by the Redis message the other's
completion publishes (each app's hub hears only its own local completions). The two
topologies are measured in turns, one wake-up or replay each, so that a change of load
on a shared machine falls on both alike; 400 wake-ups each by default, so that the p99
is a percentile, not the largest of a few dozen samples.

    python bench/topologies.py [--wakeups 400] [--replays 400] [--json out.json]

Issue 15 item 5 asks for the cluster within 1.2x of one node on wake-up p50/p99 and the
replay ratio, and at least 95% of replays from the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flask import Flask, jsonify, request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sqlalchemy import MetaData, Table, create_engine

from bench.harness import system_binary
from flask_idempotency import Idempotency, idempotent, signals

DATABASE_URL = os.environ.get(
    "BENCH_DATABASE_URL", "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
)


def _free_port(taken: set[int], limit: int = 55535) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in taken and port <= limit:
            taken.add(port)
            return port


#: The machine's redis-cli, not the Redis 6 one the dev extra puts in the virtualenv.
_REDIS_CLI = system_binary("redis-cli") or "redis-cli"


def _cli(port: int, *words: str) -> str:
    done = subprocess.run(
        [_REDIS_CLI, "-p", str(port), *words], capture_output=True, text=True, check=False
    )
    return done.stdout + done.stderr


def _start(args: list[str], port: int, workdir: Path) -> subprocess.Popen[bytes]:
    workdir.mkdir(parents=True, exist_ok=True)
    binary = system_binary("redis-server") or "redis-server"
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *args],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        if "PONG" in _cli(port, "PING"):
            return proc
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on {port} did not start")


class Servers:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-topologies-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.taken: set[int] = set()

    def single(self) -> str:
        port = _free_port(self.taken)
        self.procs.append(_start([], port, self.dir / "single"))
        return f"redis://127.0.0.1:{port}/0"

    def cluster(self) -> str:
        ports = []
        for n in range(3):
            port, bus = _free_port(self.taken), _free_port(self.taken)
            args = ["--cluster-enabled", "yes", "--cluster-port", str(bus),
                    "--cluster-config-file", f"nodes-{port}.conf"]  # fmt: skip
            self.procs.append(_start(args, port, self.dir / f"node{n}"))
            ports.append(port)
        out = subprocess.run(
            [_REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if "[OK]" not in out.stdout:
            raise RuntimeError(out.stdout + out.stderr)
        while not all("cluster_state:ok" in _cli(p, "CLUSTER", "INFO") for p in ports):
            time.sleep(0.1)
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(10)


class App:
    def __init__(self, redis_url: str, table: str) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.sources: list[str] = []
        app = Flask(f"bench_{uuid.uuid4().hex[:6]}")
        app.config.update(
            IDEMPOTENCY_DATABASE_URI=DATABASE_URL,
            IDEMPOTENCY_TABLE=table,
            IDEMPOTENCY_CREATE_TABLE=True,
            IDEMPOTENCY_REDIS_URL=redis_url,
            IDEMPOTENCY_WAIT=20,
        )
        Idempotency(app)

        @app.post("/pay")
        @idempotent
        def pay() -> Any:
            self.entered.set()
            self.gate.wait(30)
            return jsonify(key=request.headers["Idempotency-Key"]), 201

        signals.request_replayed.connect(
            lambda sender, **extra: self.sources.append(extra["source"]), app, weak=False
        )
        self.app = app
        self.client = app.test_client()

    def post(self, key: str) -> Any:
        return self.client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": key})


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Topology:
    """Two apps ("two worker processes") on one Redis topology and one table."""

    def __init__(self, redis_url: str) -> None:
        self.table = f"bench_topo_{uuid.uuid4().hex[:8]}"
        self.owner, self.waiter = App(redis_url, self.table), App(redis_url, self.table)
        self.woke: list[float] = []
        self.replayed: list[float] = []

    def warm(self) -> None:
        """Engines, table, Redis clients, the waiter's subscription."""
        for n in range(5):
            self.owner.post(f"warm-{n}-{uuid.uuid4().hex[:6]}")

    def wake_once(self) -> None:
        """The owner holds a key, the waiter parks on it, the owner finishes: the time from
        the owner's answer to the waiter's (woken only by the Redis message)."""
        owner, waiter = self.owner, self.waiter
        key = f"wake-{uuid.uuid4().hex}"
        owner.gate.clear()
        owner.entered.clear()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(owner.post, key)
            owner.entered.wait(30)
            second = pool.submit(waiter.post, key)
            hub = waiter.app.extensions["idempotency"].wakeups
            while hub.parked_count == 0:
                time.sleep(0.001)
            time.sleep(0.02)
            owner.gate.set()
            first.result(30)
            done_at = time.perf_counter()
            answer = second.result(30)
            self.woke.append((time.perf_counter() - done_at) * 1000)
            assert answer.status_code == 201

    def replay_once(self, key: str) -> None:
        started = time.perf_counter()
        answer = self.owner.post(key)
        self.replayed.append((time.perf_counter() - started) * 1000)
        assert answer.headers.get("Idempotent-Replayed") == "true"

    def results(self, replays: int) -> dict[str, Any]:
        return {
            "wakeup_ms_p50": round(statistics.median(self.woke), 2),
            "wakeup_ms_p99": round(_pct(self.woke, 0.99), 2),
            "replay_ms_p50": round(statistics.median(self.replayed), 3),
            "replay_ms_p99": round(_pct(self.replayed, 0.99), 3),
            "replays_from_cache": round(self.owner.sources.count("cache") / replays, 4),
            "samples": {"wakeups": len(self.woke), "replays": len(self.replayed)},
        }

    def close(self) -> None:
        engine = create_engine(DATABASE_URL)
        Table(self.table, MetaData()).drop(engine, checkfirst=True)
        engine.dispose()
        for app in (self.owner, self.waiter):
            app.app.extensions["idempotency"].store.engine.dispose()


def measure(urls: dict[str, str], wakeups: int, replays: int) -> dict[str, dict[str, Any]]:
    """Every topology measured in turns, one wake-up or replay each, the order alternating:
    on a shared machine a change of load falls on all of them alike, not on whichever
    happened to run during it."""
    topologies = {name: Topology(url) for name, url in urls.items()}
    try:
        for topology in topologies.values():
            topology.warm()
        order = list(topologies.values())
        for _ in range(wakeups):
            for topology in order:
                topology.wake_once()
            order.reverse()
        keys = {name: [f"replay-{n}-{uuid.uuid4().hex[:6]}" for n in range(replays)]
                for name in topologies}  # fmt: skip
        for name, topology in topologies.items():
            for key in keys[name]:
                topology.owner.post(key)
            topology.owner.sources.clear()
        names = list(topologies)
        for n in range(replays):
            for name in names:
                topologies[name].replay_once(keys[name][n])
            names.reverse()
        return {name: topology.results(replays) for name, topology in topologies.items()}
    finally:
        for topology in topologies.values():
            topology.close()


def command_cpu(single_url: str, cluster_url: str, rounds: int = 2000) -> dict[str, float]:
    """Thread CPU time per cache ``GET``, per wake-up publish and per completion (the
    record's ``SET`` and the check for a waiter; nobody waits here, the usual case), in
    microseconds: redis-py's own calls on one node
    and through ``RedisCluster``'s routing, and the paths the extension uses (``fast``:
    pre-packed on one node; ``direct``: pre-packed on the slot owner's connection). CPU
    time, unlike the latencies above, does not depend on what else the machine runs."""
    from flask_idempotency import redis_clients
    from flask_idempotency._wire.redis import _reader_for, direct_cluster
    from flask_idempotency.notify.cluster import shard_tags
    from flask_idempotency.redis_clients import _client_from_url

    single = _client_from_url(single_url, socket_timeout=1.0, connect_timeout=1.0)
    fast = _reader_for(single)
    assert fast is not None
    routed = redis_clients.cluster_from_url(cluster_url, socket_timeout=1.0, connect_timeout=1.0)
    direct = direct_cluster(routed)
    tag = uuid.uuid4().hex
    key = f"bench:{{{tag}}}"
    waiting = f"bench:waiting:{{{tag}}}"  # nobody waits: the usual completion
    value = b"x" * 300
    single.set(key, value)
    routed.set(key, value)
    tags = shard_tags(routed)
    channel = "bench:done:{" + tags[routed.get_node_from_key(key).name] + "}"
    assert direct.set_and_wake(key, value, 60_000, waiting, "SPUBLISH", channel, "x")

    def per_call(call: Any) -> float:
        for _ in range(200):
            call()
        started = time.thread_time()
        for _ in range(rounds):
            call()
        return round((time.thread_time() - started) / rounds * 1e6, 1)

    def routed_completion() -> None:
        routed.set(key, value, px=60_000)
        if routed.exists(waiting):
            routed.spublish(channel, "x")

    return {
        "get_us_single": per_call(lambda: single.get(key)),
        "get_us_single_fast": per_call(lambda: fast.get(key.encode())),
        "get_us_cluster_routed": per_call(lambda: routed.get(key)),
        "get_us_cluster_direct": per_call(lambda: direct.get(key)),
        "publish_us_single": per_call(lambda: single.publish("bench:done", "x")),
        "spublish_us_cluster_routed": per_call(lambda: routed.spublish(channel, "x")),
        "spublish_us_cluster_direct": per_call(lambda: direct.spublish(channel, "x")),
        "completion_us_single_fast": per_call(
            lambda: fast.set_and_wake(
                key, value, 60_000, waiting, lambda: ("PUBLISH", "bench:done", "x")
            )
        ),
        "completion_us_cluster_routed": per_call(routed_completion),
        "completion_us_cluster_direct": per_call(
            lambda: direct.set_and_wake(key, value, 60_000, waiting, "SPUBLISH", channel, "x")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wakeups", type=int, default=400)
    parser.add_argument("--replays", type=int, default=400)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    servers = Servers()
    try:
        single_url, cluster_url = servers.single(), servers.cluster()
        load_before = os.getloadavg()[0]
        results: dict[str, Any] = measure(
            {"single": single_url, "cluster": cluster_url}, args.wakeups, args.replays
        )
        results["command_cpu"] = command_cpu(single_url, cluster_url)
        results["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    finally:
        servers.stop()
        shutil.rmtree(servers.dir, ignore_errors=True)
    single, cluster = results["single"], results["cluster"]
    results["cluster_vs_single"] = {
        name: round(cluster[name] / single[name], 2) if single[name] else None
        for name in ("wakeup_ms_p50", "wakeup_ms_p99", "replay_ms_p50", "replays_from_cache")
    }
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
