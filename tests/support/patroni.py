"""A private Patroni HA pair for one test: etcd and two PostgreSQL nodes on loopback.

Debian's packages (``patroni``, ``etcd-server``, and PostgreSQL's own binaries under
``/usr/lib/postgresql/<version>/bin``). Every process listens on 127.0.0.1 on free ports
only, keeps its data in a temporary directory of its own, and is stopped by process
id: never by name, and nothing here touches the machine's own PostgreSQL (5432).

``initdb`` refuses to run as root, so under root etcd and Patroni run as a system user:
``PATRONI_TEST_USER`` if set, else ``postgres`` (there wherever Debian's PostgreSQL
is), else ``idemtest``, created with ``useradd --system`` the first time. A laptop
user who is not root runs them as themself.

    cluster = PatroniCluster(synchronous=True).start()
    url = cluster.url("psycopg2", "fo")       # multi-host, target_session_attrs=read-write
    old = cluster.leader()
    cluster.kill(old)                         # SIGKILL Patroni, its postmaster, backends
    new, promoted_at = cluster.wait_for_promotion(exclude=old)
    cluster.stop(); cluster.remove()

Failover takes about ``ttl`` seconds after the kill: the old leader's key in etcd must
expire before the standby may take it (measured here: 19.6-20.6 s with ``ttl`` 20,
``loop_wait`` 1). A ttl of 20 s is the floor production setups use (Patroni needs
``loop_wait + 2 * retry_timeout <= ttl``, and a shorter ttl makes a briefly slow leader
lose its key), so the test keeps it rather than fake a faster failover.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tests.support.gunicorn import child_pids, pid_alive
from tests.support.redis_server import free_port

START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0
DEFAULT_USER = "postgres"
CREATED_USER = "idemtest"


# -- what is installed ---------------------------------------------------------------


def patroni_binary() -> str | None:
    return shutil.which("patroni") or _existing("/usr/bin/patroni")


def etcd_binary() -> str | None:
    return shutil.which("etcd") or _existing("/usr/bin/etcd")


def postgres_bin_dir() -> str | None:
    """``PATRONI_PG_BIN_DIR``, else the newest ``/usr/lib/postgresql/<v>/bin`` with a server."""
    configured = os.environ.get("PATRONI_PG_BIN_DIR")
    if configured:
        return configured if _has_server(Path(configured)) else None
    root = Path("/usr/lib/postgresql")
    if not root.is_dir():
        return None
    versions = sorted(
        (p for p in root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name), reverse=True
    )
    for version in versions:
        if _has_server(version / "bin"):
            return str(version / "bin")
    return None


def missing_parts() -> list[str]:
    """What this machine lacks to run the pair (empty when it can)."""
    missing = []
    if patroni_binary() is None:
        missing.append("patroni (apt-get install patroni)")
    if etcd_binary() is None:
        missing.append("etcd (apt-get install etcd-server)")
    if postgres_bin_dir() is None:
        missing.append("PostgreSQL server binaries (/usr/lib/postgresql/<version>/bin)")
    return missing


def _existing(path: str) -> str | None:
    return path if os.access(path, os.X_OK) else None


def _has_server(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in ("postgres", "pg_ctl", "initdb"))


# -- who runs it ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunAs:
    """The account the servers run under; ``None`` fields: this process's own."""

    name: str
    uid: int | None = None
    gid: int | None = None

    def popen_args(self) -> dict[str, Any]:
        if self.uid is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def own(self, path: Path) -> None:
        if self.uid is None:
            return
        os.chown(path, self.uid, self.gid if self.gid is not None else -1)


def server_account() -> RunAs:
    """Root: a non-root system user (created if needed); anyone else: themself."""
    if os.geteuid() != 0:
        return RunAs(pwd.getpwuid(os.geteuid()).pw_name)
    wanted = os.environ.get("PATRONI_TEST_USER")
    for name in [wanted] if wanted else [DEFAULT_USER, CREATED_USER]:
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return RunAs(name, entry.pw_uid, entry.pw_gid)
    name = wanted or CREATED_USER
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam(name)
    return RunAs(name, entry.pw_uid, entry.pw_gid)


# -- processes -----------------------------------------------------------------------


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, read from /proc (children first-level first)."""
    found: list[int] = []
    queue = [pid]
    while queue:
        for child in child_pids(queue.pop(0)):
            if child not in found and pid_alive(child):
                found.append(child)
                queue.append(child)
    return found


def wait_gone(pids: list[int], within: float) -> list[int]:
    """Wait until none of ``pids`` is alive; the ones still alive at the deadline."""
    deadline = time.monotonic() + within
    alive = [pid for pid in pids if pid_alive(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if pid_alive(pid)]
    return alive


def http_json(url: str, timeout: float = 2.0) -> tuple[int, Any]:
    """``(status, parsed body)``; ``(0, None)`` when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read() or b"null")
        except ValueError:
            body = None
        return exc.code, body
    except (OSError, ValueError):
        return 0, None


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


# -- the servers ---------------------------------------------------------------------


class Etcd:
    """One etcd member (v3 API), its client and peer ports on 127.0.0.1."""

    def __init__(self, binary: str, directory: Path, account: RunAs) -> None:
        self.binary = binary
        self.directory = directory
        self.account = account
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = directory / "etcd.log"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> Etcd:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.account.own(self.directory)
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        command = [
            self.binary,
            "--name=idemtest",
            f"--data-dir={self.directory / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=idemtest={peer}",
            f"--initial-cluster-token={uuid.uuid4().hex}",
            "--initial-cluster-state=new",
        ]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.directory)}
        if os.uname().machine not in ("x86_64", "aarch64"):  # etcd's supported list
            env["ETCD_UNSUPPORTED_ARCH"] = os.uname().machine
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env=env,
                **self.account.popen_args(),
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}:\n{self.log()}")
            status, body = http_json(f"{client}/health", timeout=1.0)
            if status == 200 and isinstance(body, dict) and body.get("health") == "true":
                return self
            time.sleep(0.1)
        raise RuntimeError(f"etcd on {self.endpoint} did not become healthy:\n{self.log()}")

    def log(self) -> str:
        return tail(self.log_path)

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT)
        self.process = None


class PatroniNode:
    """One Patroni process and the PostgreSQL it runs."""

    def __init__(self, cluster: PatroniCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.directory = cluster.directory / name
        self.data_dir = self.directory / "data"
        self.pg_port = free_port()
        #: The port other nodes reach this one on (``connect_address``: a standby streams
        #: from it); ``pg_port`` unless a proxy is put in between before ``start()``.
        self.connect_port = self.pg_port
        self.api_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.directory / "patroni.log"
        self.killed = False
        self.killed_at: float | None = None

    def __repr__(self) -> str:
        return f"<PatroniNode {self.name} pg=127.0.0.1:{self.pg_port}>"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def config(self) -> dict[str, Any]:
        cluster = self.cluster
        return {
            "scope": cluster.scope,
            "namespace": "/idemtest/",
            "name": self.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{self.api_port}",
                "connect_address": f"127.0.0.1:{self.api_port}",
            },
            "etcd3": {"hosts": [cluster.etcd.endpoint]},
            "bootstrap": {
                "dcs": {
                    "ttl": cluster.ttl,
                    "loop_wait": cluster.loop_wait,
                    "retry_timeout": cluster.retry_timeout,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": cluster.synchronous,
                    "postgresql": {"use_pg_rewind": False, "use_slots": True},
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.connect_port}",
                "data_dir": str(self.data_dir),
                "bin_dir": cluster.bin_dir,
                "pgpass": str(self.directory / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                },
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "parameters": {
                    "unix_socket_directories": str(self.directory),
                    "max_connections": 200,
                    "shared_buffers": "32MB",
                    # Processes are killed here, never the machine: the page cache
                    # survives a SIGKILL, so fsync would only slow a 2-core CI box.
                    # Synchronous replication still waits for the standby (C55).
                    "fsync": "off",
                    "wal_keep_size": "128MB",
                    "max_wal_senders": 10,
                    "max_replication_slots": 10,
                },
            },
            "watchdog": {"mode": "off"},
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }

    def start(self) -> PatroniNode:
        account = self.cluster.account
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        config_path = self.directory / "patroni.yml"
        # JSON is YAML: no YAML writer needed on the test side.
        config_path.write_text(json.dumps(self.config(), indent=2))
        for path in (self.directory, config_path):
            account.own(path)
        env = {
            "PATH": f"{self.cluster.bin_dir}:/usr/bin:/bin",
            "HOME": str(self.directory),
            "USER": account.name,
            "LOGNAME": account.name,
            "LC_ALL": "C.UTF-8",
        }
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.cluster.patroni, str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env=env,
                **account.popen_args(),
            )
        return self

    # -- state, as Patroni's REST API and PostgreSQL tell it

    def postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(first)
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def is_primary(self) -> bool:
        """Patroni says this node is the leader and its PostgreSQL is running."""
        status, _ = http_json(f"{self.api}/primary", timeout=1.0)
        return status == 200

    def accepts_writes(self) -> bool:
        """A read-write session can be opened on this node right now (what the app needs)."""
        import psycopg2  # the test's own driver; Patroni uses the system's

        try:
            conn = psycopg2.connect(
                host="127.0.0.1",
                port=self.pg_port,
                user="postgres",
                dbname="postgres",
                connect_timeout=1,
                target_session_attrs="read-write",
            )
        except psycopg2.Error:
            return False
        conn.close()
        return True

    def pids(self) -> list[int]:
        """Patroni, its helpers, the postmaster and every backend: what a host crash takes."""
        pids: list[int] = []
        if self.process is not None and self.process.poll() is None:
            pids.append(self.process.pid)
            pids.extend(descendants(self.process.pid))
        postmaster = self.postmaster_pid()
        if postmaster is not None:
            pids.append(postmaster)
            pids.extend(descendants(postmaster))
        return list(dict.fromkeys(pids))

    def kill(self) -> list[int]:
        """SIGKILL every process of this node at once; the pids.

        Patroni and the postmaster are stopped (SIGSTOP) first, so no backend is forked
        between reading the process tree and killing it: none survives as an orphan.
        ``killed_at`` is the ``time.monotonic()`` of the SIGKILLs.
        """
        postmaster = self.postmaster_pid()
        heads = [p for p in (self.process.pid if self.process else None, postmaster) if p]
        kill_pids(heads, signal.SIGSTOP)
        pids = self.pids()
        self.killed_at = time.monotonic()
        kill_pids(pids)
        self.killed = True
        if self.process is not None:
            self.process.wait(STOP_TIMEOUT)
        alive = wait_gone(pids, STOP_TIMEOUT)
        if alive:
            raise RuntimeError(f"{self}: still alive after SIGKILL: {alive}")
        return pids

    def stop(self) -> None:
        """SIGTERM Patroni (it shuts PostgreSQL down), then SIGKILL what is left, by pid."""
        pids = self.pids()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        leftover = [pid for pid in [*pids, *self.pids()] if pid_alive(pid)]
        kill_pids(leftover)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(STOP_TIMEOUT)
        wait_gone(leftover, STOP_TIMEOUT)
        self.process = None

    def log(self) -> str:
        return tail(self.log_path)


class PatroniCluster:
    """etcd and two Patroni nodes on loopback, in a temporary directory of their own."""

    def __init__(
        self,
        *,
        synchronous: bool = True,
        nodes: int = 2,
        ttl: int = 20,
        loop_wait: int = 1,
        retry_timeout: int = 9,
        directory: Path | None = None,
    ) -> None:
        missing = missing_parts()
        if missing:
            raise RuntimeError("cannot start a Patroni pair: missing " + ", ".join(missing))
        self.patroni = str(patroni_binary())
        self.bin_dir = str(postgres_bin_dir())
        self.synchronous = synchronous
        self.ttl = ttl
        self.loop_wait = loop_wait
        self.retry_timeout = retry_timeout
        self.scope = f"idemtest-{uuid.uuid4().hex[:8]}"
        self.account = server_account()
        self.directory = Path(directory or tempfile.mkdtemp(prefix="patroni-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        # The servers' user must reach its own directories under this one.
        os.chmod(self.directory, 0o755)
        self.etcd = Etcd(str(etcd_binary()), self.directory / "etcd", self.account)
        self.nodes = [PatroniNode(self, f"node{i}") for i in range(nodes)]

    # -- life cycle

    def start(self) -> PatroniCluster:
        try:
            self.etcd.start()
            first, *others = self.nodes
            first.start()
            self._wait(lambda: first.is_primary(), f"{first.name} to bootstrap as leader")
            for node in others:
                node.start()
            self._wait(self._all_streaming, "every standby to stream from the leader")
            if self.synchronous:
                self._wait(self._sync_standby_set, "a synchronous standby")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.etcd.stop()

    def remove(self) -> None:
        """Delete the directory (after :meth:`stop`); keep ``keep_logs_in`` first if wanted."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def keep_logs(self, destination: Path) -> None:
        """Copy every server log to ``destination`` (for a failed test's report)."""
        destination.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copy2(self.etcd.log_path, destination / "etcd.log")
        for node in self.nodes:
            with contextlib.suppress(OSError):
                shutil.copy2(node.log_path, destination / f"{node.name}-patroni.log")
            log_dir = node.data_dir / "log"
            if log_dir.is_dir():
                for path in log_dir.iterdir():
                    with contextlib.suppress(OSError):
                        shutil.copy2(path, destination / f"{node.name}-{path.name}")

    # -- state

    def members(self) -> list[dict[str, Any]]:
        """Patroni's view of the cluster (``/cluster`` of any node that answers)."""
        for node in self.nodes:
            if node.killed:
                continue
            status, body = http_json(f"{node.api}/cluster", timeout=1.0)
            if status == 200 and isinstance(body, dict):
                return list(body.get("members", []))
        return []

    def _all_streaming(self) -> bool:
        members = self.members()
        if len(members) < len(self.nodes):
            return False
        standbys = [m for m in members if m.get("role") != "leader"]
        return all(m.get("state") in ("streaming", "running") for m in standbys) and all(
            m.get("lag", 0) in (0, None) for m in standbys
        )

    def _sync_standby_set(self) -> bool:
        return any(m.get("role") == "sync_standby" for m in self.members())

    def leader(self) -> PatroniNode:
        for node in self.nodes:
            if not node.killed and node.is_primary():
                return node
        raise RuntimeError(f"no leader: {self.members()}")

    def standbys(self) -> list[PatroniNode]:
        leader = self.leader()
        return [node for node in self.nodes if node is not leader and not node.killed]

    def url(self, driver: str, database: str, user: str = "postgres") -> str:
        """A multi-host SQLAlchemy URL over every node, to whichever takes writes."""
        hosts = "&".join(f"host=127.0.0.1:{node.pg_port}" for node in self.nodes)
        return f"postgresql+{driver}://{user}@/{database}?{hosts}&target_session_attrs=read-write"

    def dsn(self, node: PatroniNode, database: str = "postgres") -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": node.pg_port, "user": "postgres", "dbname": database}

    # -- failover

    def kill(self, node: PatroniNode) -> list[int]:
        """SIGKILL the node's Patroni, postmaster and backends (a host crash); their pids."""
        return node.kill()

    def wait_for_promotion(
        self, *, exclude: PatroniNode, within: float = 90.0, interval: float = 0.05
    ) -> tuple[PatroniNode, float]:
        """Poll until another node takes writes; ``(node, time.monotonic() it first did)``."""
        candidates = [node for node in self.nodes if node is not exclude and not node.killed]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for node in candidates:
                if node.accepts_writes():
                    return node, time.monotonic()
            time.sleep(interval)
        raise RuntimeError(f"no standby was promoted within {within} s:\n{self.logs()}")

    # -- reports

    def logs(self) -> str:
        parts = [f"--- etcd\n{self.etcd.log()}"]
        parts.extend(f"--- {node.name}\n{node.log()}" for node in self.nodes)
        return "\n".join(parts)

    def _wait(self, condition: Any, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.process is not None and node.process.poll() is not None:
                    raise RuntimeError(
                        f"patroni {node.name} exited with {node.process.returncode} "
                        f"while waiting for {what}:\n{self.logs()}"
                    )
            if condition():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}: {self.members()}\n{self.logs()}")

    def __enter__(self) -> PatroniCluster:  # noqa: PYI034 - not meant to be subclassed
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.remove()
