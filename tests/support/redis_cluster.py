"""Real Redis topologies on loopback for the topology tests: a Cluster and a Sentinel group.

Every process listens on 127.0.0.1 on a port picked free at run time and is stopped
by its process id. ``RedisCluster3``: three masters made with ``redis-cli --cluster
create``. ``SentinelGroup``: one master, one replica and three sentinels.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.support.binaries import system_binary
from tests.support.redis_server import free_port

START_TIMEOUT = 30.0


def redis_cli(port: int, *words: str, timeout: float = 10.0) -> str:
    """``redis-cli -p port words...``: its output and errors, as text."""
    cli = system_binary("redis-cli") or "redis-cli"
    done = subprocess.run(
        [cli, "-h", "127.0.0.1", "-p", str(port), *words],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.stdout + done.stderr


def _major_version(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    version = out.stdout.partition("v=")[2].split(".")[0]
    return int(version) if version.isdigit() else 7


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Node:
    """One redis-server (or sentinel) process with its own directory."""

    def __init__(self, binary: str, directory: Path, args: list[str], port: int) -> None:
        self.binary = binary
        self.directory = directory
        self.args = args
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError((self.directory / "server.log").read_text()[-2000:])
            if "PONG" in redis_cli(self.port, "PING", timeout=2):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis on port {self.port} did not answer PING")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(START_TIMEOUT)
        self.process = None

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(START_TIMEOUT)
        self.process = None

    def cli(self, *words: str) -> str:
        return redis_cli(self.port, *words)


class RedisCluster3:
    """Three masters, each with ``replicas`` replicas (none by default: a killed master's
    slots go dark and the others serve on; with one, its replica is promoted)."""

    def __init__(self, binary: str, directory: Path, replicas: int = 0) -> None:
        self.replicas = replicas
        self.nodes: list[Node] = []
        self._first_masters: set[int] = set()
        taken: set[int] = set()

        def pick(limit: int = 65535) -> int:
            port = free_port()
            while port in taken or port > limit:
                port = free_port()
            taken.add(port)
            return port

        # Redis 6 has no --cluster-port: its bus listens on port + 10000.
        fixed_bus = _major_version(binary) < 7
        for n in range(3 * (1 + replicas)):
            port = pick(55535)  # redis-server refuses higher ports in cluster mode
            while fixed_bus and not _is_free(port + 10000):
                port = pick(55535)
            bus = [] if fixed_bus else ["--cluster-port", str(pick())]
            node_dir = Path(directory) / f"node{n}"
            args = [
                "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                *bus, "--cluster-node-timeout", "1500",
                "--cluster-require-full-coverage", "no",
                "--protected-mode", "yes",
            ]  # fmt: skip
            self.nodes.append(Node(binary, node_dir, args, port))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisCluster3:
        for node in self.nodes:
            node.start()
        out = redis_cli(
            self.nodes[0].port,
            "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
            "--cluster-replicas", str(self.replicas), "--cluster-yes",
            timeout=60,
        )  # fmt: skip
        if "[OK]" not in out:
            raise RuntimeError(f"redis-cli --cluster create failed: {out[-2000:]}")
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes) and all(
                "master_link_status:up" in n.cli("INFO", "replication")
                for n in self.nodes
                if "role:slave" in n.cli("INFO", "replication")
            ):
                masters = self.masters()
                if len(masters) == 3:
                    self._first_masters = {n.port for n in masters}
                    return self
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def masters(self) -> list[Node]:
        """The nodes that are masters now (after a failover, a promoted replica is one)."""
        return [
            n
            for n in self.nodes
            if n.process is not None and "role:master" in n.cli("INFO", "replication")
        ]

    def wait_promoted(self, dead: Node, within: float = START_TIMEOUT) -> Node:
        """After ``dead`` (a master) was killed: the replica that took its place."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            alive = [n for n in self.nodes if n is not dead and n.process is not None]
            masters = [n for n in alive if "role:master" in n.cli("INFO", "replication")]
            if len(masters) == 3 and all(
                "cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in alive
            ):
                return next(n for n in masters if n.port not in self._first_masters)
            time.sleep(0.1)
        raise RuntimeError("no replica was promoted")

    def flushall(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                node.cli("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelGroup:
    """A master, a replica and three sentinels watching ``service``."""

    service = "idem-master"

    def __init__(self, binary: str, directory: Path) -> None:
        directory = Path(directory)
        common = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        master_port = free_port()
        replica_port = free_port()
        while replica_port == master_port:
            replica_port = free_port()
        self.master = Node(
            binary, directory / "master", ["--port", str(master_port), *common], master_port
        )
        self.replica = Node(
            binary,
            directory / "replica",
            ["--port", str(replica_port), *common, "--replicaof", "127.0.0.1", str(master_port)],
            replica_port,
        )
        self.sentinels: list[Node] = []
        taken = {master_port, replica_port}
        for n in range(3):
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            sdir = directory / f"sentinel{n}"
            sdir.mkdir(parents=True, exist_ok=True)
            conf = sdir / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {sdir}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {master_port} 2\n"
                f"sentinel down-after-milliseconds {self.service} 1000\n"
                f"sentinel failover-timeout {self.service} 4000\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
            self.sentinels.append(Node(binary, sdir, [str(conf), "--sentinel"], port))

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def start(self) -> SentinelGroup:
        self.master.start()
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.start()
            # Each sentinel reads a replica's INFO every second, not every 10 s: after a
            # failover the group then settles (below) within a second of the old master's
            # conversion instead of up to 10 s after it.
            sentinel.cli("SENTINEL", "DEBUG", "info-period", "1000")
        self.wait_settled()
        return self

    def master_port(self) -> int:
        out = self.sentinels[0].cli("SENTINEL", "get-master-addr-by-name", self.service)
        return int(out.split()[1])

    def wait_settled(self, within: float = START_TIMEOUT) -> None:
        """Until the replica is in sync with the master, and every sentinel knows both
        the other sentinels and the replica, as a replica of that master.

        The last part matters after a forced failover: the old master stays a master
        until a sentinel converts it, and that sentinel then still holds the role it
        last read (master) until its next ``INFO`` of the replica (a second here, 10 s by
        default). A failover promoted inside that window is undone by it at once (its
        stale role is older than the 8 s it waits before converting), and aborted, again
        and again (``-failover-abort-slave-timeout``: CI's "the failover did not finish").
        """
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            port = self.master_port()
            replica = self.replica if port == self.master.port else self.master
            synced = "master_link_status:up" in replica.cli("INFO", "replication")
            if synced and all(self._sees_settled(s, replica.port, port) for s in self.sentinels):
                return
            time.sleep(0.2)
        raise RuntimeError("the sentinel group did not settle")

    def _sees_settled(self, sentinel: Node, replica: int, master: int) -> bool:
        """Whether ``sentinel`` counts the two other sentinels and last read the replica
        (on port ``replica``) as a replica of ``master``."""
        if "num-other-sentinels\n2" not in sentinel.cli("SENTINEL", "master", self.service):
            return False
        lines = sentinel.cli("SENTINEL", "replicas", self.service).splitlines()
        seen = dict(zip(lines[0::2], lines[1::2], strict=False))
        return (
            seen.get("port") == str(replica)
            and seen.get("role-reported") == "slave"
            and seen.get("master-port") == str(master)
        )

    def failover(self) -> int:
        """Force a failover; the new master's port once the sentinels agree on it.

        First until the group has settled (:meth:`wait_settled`): right after the previous
        failover the old master may still be resyncing, or a sentinel may still hold it for
        a master, and the request is accepted (OK) only to be aborted.
        """
        self.wait_settled()
        before = self.master_port()
        out = self.sentinels[0].cli("SENTINEL", "FAILOVER", self.service)
        if "OK" not in out:
            raise RuntimeError(f"SENTINEL FAILOVER: {out}")
        deadline = time.monotonic() + 2 * START_TIMEOUT
        asked_again = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            ports = {
                int(s.cli("SENTINEL", "get-master-addr-by-name", self.service).split()[1])
                for s in self.sentinels
            }
            if len(ports) == 1 and ports != {before}:
                return ports.pop()
            if ports == {before} and time.monotonic() > asked_again:
                # A sentinel that was starved of CPU (a parallel run's heavy tests) can
                # drop a forced failover it accepted; asking again is the setup's retry,
                # not the behaviour under test. Only while every sentinel still names the
                # old master: asked once the new one is known to some, a second failover
                # would promote the old master back, and the two could flip for good.
                self.sentinels[0].cli("SENTINEL", "FAILOVER", self.service)
                asked_again = time.monotonic() + 10.0
            time.sleep(0.1)
        raise RuntimeError("the failover did not finish")

    def stop(self) -> None:
        for node in [*self.sentinels, self.replica, self.master]:
            node.stop()
