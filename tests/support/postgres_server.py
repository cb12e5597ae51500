"""A private PostgreSQL for one test (or one module): its own cluster, port and process.

Tests that need a server setting of their own (more connections, a ``TimeZone``, a
replica, a failover) must never change or restart the machine's PostgreSQL, so they
start one of these: ``initdb`` into a directory of the test's own, ``postgres`` bound to
127.0.0.1 on a free port (no Unix socket), trust authentication for ``postgres``,
started, killed and stopped by process id. PostgreSQL refuses to run as root: started
as root, both ``initdb`` and the server run as ``postgres`` (or ``nobody``), and the
cluster lives where that user can reach it (a temporary directory of its own when the
test's directory is private to root, as pytest's are).

    server = PostgresServer(tmp_path / "pg", timezone="Europe/Berlin").start()
    engine = create_engine(server.url)  # postgresql+psycopg2://postgres@127.0.0.1:<port>/postgres
    server.kill()      # SIGKILL the postmaster and its children: a crash
    server.restart()   # same data, same port (crash=True: SIGKILL first)
    server.stop()      # fast shutdown; the directory stays for its logs unless it was temporary
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from tests.support.binaries import system_binary
from tests.support.private_server import PrivateServer
from tests.support.redis_server import free_port

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0

#: Settings for a throwaway cluster: small, and no fsync (a killed server loses nothing
#: the OS already has; only a machine crash would). Override any of them per server.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "16MB",
    "max_connections": "100",
    "unix_socket_directories": "",
    "listen_addresses": "127.0.0.1",
    "log_min_messages": "warning",
}


def postgres_bindir() -> str | None:
    """The directory holding ``initdb`` and ``postgres``, or ``None`` when neither is found:
    ``initdb`` on ``PATH`` (Debian puts neither there; some machines link them in), then
    ``pg_config --bindir``, then the newest ``/usr/lib/postgresql/<n>/bin``."""
    candidates: list[str] = []
    initdb = system_binary("initdb")
    if initdb:
        candidates.append(os.path.dirname(os.path.realpath(initdb)))
    pg_config = system_binary("pg_config")
    if pg_config:
        try:
            found = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            candidates.append(found)
        except (OSError, subprocess.SubprocessError):
            pass
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(versions, key=lambda p: int(Path(p).parent.name), reverse=True)
    for bindir in candidates:
        if all(os.access(os.path.join(bindir, b), os.X_OK) for b in ("initdb", "postgres")):
            return bindir
    return None


def unprivileged_user(preferred: str) -> pwd.struct_passwd | None:
    """Who a server runs as: ``None`` (this process's own user) unless we are root, then
    ``preferred`` if that account exists, else ``nobody``."""
    if os.geteuid() != 0:
        return None
    for name in (preferred, "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(f"running as root and neither {preferred!r} nor 'nobody' exists")


def _reachable_by(user: pwd.struct_passwd, directory: Path) -> bool:
    """Whether ``user`` may enter ``directory`` (searched on every ancestor)."""
    groups = {user.pw_gid} | set(os.getgrouplist(user.pw_name, user.pw_gid))
    path = directory.resolve()
    for part in [path, *path.parents]:
        info = part.stat()
        if info.st_uid == user.pw_uid:
            ok = info.st_mode & stat.S_IXUSR
        elif info.st_gid in groups:
            ok = info.st_mode & stat.S_IXGRP
        else:
            ok = info.st_mode & stat.S_IXOTH
        if not ok:
            return False
    return True


def server_directory(
    wanted: Path, user: pwd.struct_passwd | None, prefix: str
) -> tuple[Path, bool]:
    """A directory of the server's own and whether it is temporary (removed on stop).

    ``wanted`` itself when the server's user can reach it; otherwise (root, and a
    directory private to root such as pytest's) a new directory under the system's
    temporary directory. Either way it belongs to the server's user.
    """
    wanted = Path(wanted)
    wanted.mkdir(parents=True, exist_ok=True)
    if user is None or _reachable_by(user, wanted):
        directory, temporary = wanted, False
    else:
        directory, temporary = Path(tempfile.mkdtemp(prefix=prefix)), True
    if user is not None:
        os.chown(directory, user.pw_uid, user.pw_gid)
        os.chmod(directory, 0o700)
    return directory, temporary


def as_user(user: pwd.struct_passwd | None) -> dict[str, object]:
    """``subprocess`` arguments that run a child as ``user`` (nothing when ``None``)."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


class PostgresServer(PrivateServer):
    """One private cluster; ``start``/``kill``/``restart`` keep its data and port."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        timezone: str | None = None,
        settings: Mapping[str, str] | None = None,
        bindir: str | None = None,
        user: str = "postgres",
    ) -> None:
        found = bindir or postgres_bindir()
        if found is None:
            raise FileNotFoundError("initdb/postgres: no PostgreSQL server binaries found")
        self.bindir = found
        self._port_given = port is not None
        self.port = port or free_port()
        #: The server's zone, as its host's would be (``TZ`` for initdb and the server:
        #: initdb writes it as ``timezone`` and ``log_timezone``).
        self.timezone = timezone
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.user = unprivileged_user(user)
        self.directory, self._temporary = server_directory(Path(directory), self.user, "idem-pg-")
        self.data = self.directory / "data"
        self.log_path = self.directory / "postgres.log"
        self.process: subprocess.Popen[bytes] | None = None

    # -- addresses ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The ``postgres`` database as superuser ``postgres``, psycopg2 (``.replace``
        the driver for psycopg 3)."""
        return self.url_for("postgres")

    def url_for(self, database: str, driver: str = "psycopg2") -> str:
        return f"postgresql+{driver}://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs."""
        return None if self.process is None else self.process.pid

    # -- life cycle ---------------------------------------------------------------

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = env["LANG"] = "C.UTF-8"
        if self.user is not None:
            env["HOME"] = str(self.directory)
            env["USER"] = env["LOGNAME"] = self.user.pw_name
        if self.timezone is not None:
            env["TZ"] = self.timezone
        return env

    def _initdb(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        result = subprocess.run(
            [
                os.path.join(self.bindir, "initdb"),
                "--pgdata",
                str(self.data),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-sync",
            ],
            env=self._environment(),
            cwd=self.directory,
            capture_output=True,
            timeout=120,
            **as_user(self.user),  # type: ignore[arg-type]
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"initdb exited with {result.returncode}: {result.stdout!r} {result.stderr!r}"
            )

    def start(self) -> PostgresServer:
        """initdb (the first time), then the server; returns once it takes connections."""
        self._initdb()
        for _attempt in range(3):
            command = [os.path.join(self.bindir, "postgres"), "-D", str(self.data)]
            command += ["-p", str(self.port)]
            for name, value in self.settings.items():
                command += ["-c", f"{name}={value}"]
            with open(self.log_path, "ab") as log:
                if self.user is not None:
                    os.chown(self.log_path, self.user.pw_uid, self.user.pw_gid)
                self.process = subprocess.Popen(
                    command,
                    env=self._environment(),
                    cwd=self.directory,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    **as_user(self.user),  # type: ignore[arg-type]
                )
            try:
                self._wait_until_ready()
                return self
            except RuntimeError:
                self.process = None
                if "Address already in use" not in self.log() or self._port_given:
                    raise
                self.port = free_port()  # taken between free_port() and bind: once more
        raise RuntimeError(f"no free port for PostgreSQL: {self.log()}")

    def _wait_until_ready(self) -> None:
        import psycopg2

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.process.returncode}: {self.log()}")
            try:
                conn = psycopg2.connect(
                    host="127.0.0.1",
                    port=self.port,
                    user="postgres",
                    dbname="postgres",
                    connect_timeout=2,
                )
            except psycopg2.OperationalError:
                time.sleep(0.1)
                continue
            conn.close()
            return
        self.kill()
        raise RuntimeError(f"postgres on port {self.port} did not take connections: {self.log()}")

    def execute(self, sql: str, database: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement in autocommit; its rows (empty when it returns none)."""
        import psycopg2

        conn = psycopg2.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=database, connect_timeout=5
        )
        try:
            conn.autocommit = True
            with conn.cursor() as cursor:
                cursor.execute(sql)
                return list(cursor.fetchall()) if cursor.description else []
        finally:
            conn.close()

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend it started, by pid: a crash."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            children = child_pids(process.pid)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT)
            for pid in children:  # orphans now; shared memory is theirs until they go
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_TIMEOUT
            while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.process = None

    def stop(self, *, keep: bool = False) -> None:
        """Fast shutdown (SIGINT), then SIGKILL; safe to call twice. A temporary directory
        (see :func:`server_directory`) is removed unless ``keep``."""
        process = self.process
        if process is not None:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGINT)
                try:
                    process.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.kill()
            self.process = None
        if self._temporary and not keep:
            shutil.rmtree(self.directory, ignore_errors=True)
