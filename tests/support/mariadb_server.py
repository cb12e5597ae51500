"""A private MariaDB for one test (or one module): its own data directory, socket, port.

Tests that need a server of their own (a host time zone, ``time_zone=SYSTEM`` in a zone
with daylight saving time, a crash) must never change or restart the machine's MariaDB,
so they start one of these: ``mariadb-install-db`` into a directory of the test's own,
``mariadbd --no-defaults`` (no ``/etc/mysql`` file is read) bound to 127.0.0.1 on a free
port with its own socket, ``root`` without a password, started and stopped by process id.
Started as root, the server runs as ``mysql`` (or ``nobody``) and lives where that user
can reach it (see :func:`tests.support.postgres_server.server_directory`).

    server = MariaDBServer(tmp_path / "mariadb", timezone="Europe/Berlin").start()
    engine = create_engine(server.url)  # mysql+pymysql://root@127.0.0.1:<port>/test
    server.stop()

``timezone`` is the server's host zone: it is the ``TZ`` of ``mariadbd``'s environment,
so ``@@system_time_zone`` follows it and the default ``time_zone=SYSTEM`` converts through
it, daylight saving time included (``mysql.time_zone*`` tables stay empty).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.binaries import system_binary
from tests.support.postgres_server import server_directory, unprivileged_user
from tests.support.private_server import PrivateServer
from tests.support.redis_server import free_port

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
#: A Unix socket path must fit in sun_path (108 bytes).
SOCKET_PATH_LIMIT = 100

SERVER_CANDIDATES = ("/usr/sbin/mariadbd", "mariadbd", "/usr/sbin/mysqld")
INSTALL_CANDIDATES = ("mariadb-install-db", "mysql_install_db")

#: Small and quick: a few MiB of buffer pool and redo log, no binary log, no name lookups.
SERVER_OPTIONS = (
    "--bind-address=127.0.0.1",
    "--skip-name-resolve",
    "--skip-log-bin",
    "--innodb-buffer-pool-size=32M",
    "--innodb-log-file-size=16M",
    "--character-set-server=utf8mb4",
    "--collation-server=utf8mb4_general_ci",
)


def _first(candidates: tuple[str, ...]) -> str | None:
    for candidate in candidates:
        found = candidate if os.path.isabs(candidate) else system_binary(candidate)
        if found and os.access(found, os.X_OK):
            return found
    return None


def mariadb_binaries() -> tuple[str, str] | None:
    """``(mariadbd, mariadb-install-db)``, or ``None`` when either is missing."""
    server, install = _first(SERVER_CANDIDATES), _first(INSTALL_CANDIDATES)
    return None if server is None or install is None else (server, install)


class MariaDBServer(PrivateServer):
    """One private ``mariadbd``; ``start``/``kill``/``restart`` keep its data and port."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        timezone: str | None = None,
        options: tuple[str, ...] = (),
        user: str = "mysql",
        database: str = "test",
    ) -> None:
        binaries = mariadb_binaries()
        if binaries is None:
            raise FileNotFoundError("mariadbd/mariadb-install-db: no MariaDB server binaries")
        self.binary, self.install_binary = binaries
        self._port_given = port is not None
        self.port = port or free_port()
        self.timezone = timezone
        self.options = options
        self.database = database
        self.user = unprivileged_user(user)
        self.directory, self._temporary = server_directory(
            Path(directory), self.user, "idem-mariadb-"
        )
        self.data = self.directory / "data"
        #: The server's own temporary directory (never the shared /tmp).
        self.tmpdir = self.directory / "tmp"
        self.log_path = self.directory / "error.log"
        socket = self.directory / "mariadb.sock"
        self._socket_dir: Path | None = None
        if len(str(socket)) > SOCKET_PATH_LIMIT:
            self._socket_dir = Path(tempfile.mkdtemp(prefix="idem-mdb-"))
            if self.user is not None:
                os.chown(self._socket_dir, self.user.pw_uid, self.user.pw_gid)
            socket = self._socket_dir / "mariadb.sock"
        self.socket = socket
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``test`` database (created at start) as ``root``, through PyMySQL."""
        return self.url_for(self.database)

    def url_for(self, database: str, driver: str = "pymysql") -> str:
        return f"mysql+{driver}://root@127.0.0.1:{self.port}/{database}"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MYSQL")}
        env.pop("TZ", None)
        if self.timezone is not None:
            env["TZ"] = self.timezone
        return env

    def _user_options(self) -> list[str]:
        return [] if self.user is None else [f"--user={self.user.pw_name}"]

    def _install(self) -> None:
        self.tmpdir.mkdir(exist_ok=True)
        if self.user is not None:
            os.chown(self.tmpdir, self.user.pw_uid, self.user.pw_gid)
        if (self.data / "mysql").is_dir():
            return
        result = subprocess.run(
            [
                self.install_binary,
                "--no-defaults",
                f"--datadir={self.data}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
                *self._user_options(),
                "--innodb-log-file-size=16M",
                # Its own temporary directory: the bootstrap's temporary tables in the
                # shared /tmp were removed under a parallel run ("Could not remove
                # temporary table '/tmp/#sql-temptable-...'", then 1051 and abort).
                f"--tmpdir={self.tmpdir}",
            ],
            env=self._environment(),
            cwd=self.directory,
            capture_output=True,
            timeout=180,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"mariadb-install-db exited with {result.returncode}: "
                f"{result.stdout[-2000:]!r} {result.stderr[-2000:]!r}"
            )

    def start(self) -> MariaDBServer:
        """Install (the first time), then the server; returns once ``root`` can connect
        and the ``test`` database exists."""
        self._install()
        for _attempt in range(3):
            command = [
                self.binary,
                "--no-defaults",
                f"--datadir={self.data}",
                f"--port={self.port}",
                f"--socket={self.socket}",
                f"--pid-file={self.directory / 'mariadbd.pid'}",
                f"--log-error={self.log_path}",
                f"--tmpdir={self.tmpdir}",
                *self._user_options(),
                *SERVER_OPTIONS,
                *self.options,
            ]
            # mariadbd switches to --user itself (it must start as root to do so).
            self.process = subprocess.Popen(
                command,
                env=self._environment(),
                cwd=self.directory,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                self._wait_until_ready()
                break
            except RuntimeError:
                self.process = None
                if "already in use" not in self.log() or self._port_given:
                    raise
                self.port = free_port()
        else:
            raise RuntimeError(f"no free port for MariaDB: {self.log()}")
        self.execute(f"CREATE DATABASE IF NOT EXISTS `{self.database}` CHARACTER SET utf8mb4")
        return self

    def _connect(self, database: str | None = None, timeout: int = 5) -> object:
        import pymysql

        return pymysql.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            database=database,
            connect_timeout=timeout,
            autocommit=True,
        )

    def _wait_until_ready(self) -> None:
        import pymysql

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"mariadbd exited with {self.process.returncode}: {self.log()}")
            try:
                conn = self._connect(timeout=2)
            except pymysql.err.OperationalError:
                time.sleep(0.1)
                continue
            conn.close()  # type: ignore[attr-defined]
            return
        self.kill()
        raise RuntimeError(f"mariadbd on port {self.port} did not take connections: {self.log()}")

    def execute(self, sql: str, database: str | None = None) -> list[tuple[object, ...]]:
        """Run one statement as root; its rows (empty when it returns none)."""
        conn = self._connect(database)
        try:
            with conn.cursor() as cursor:  # type: ignore[attr-defined]
                cursor.execute(sql)
                return list(cursor.fetchall())
        finally:
            conn.close()  # type: ignore[attr-defined]

    def kill(self) -> None:
        """SIGKILL, by pid: a crash (InnoDB recovers at the next start)."""
        process = self.process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_TIMEOUT)
        self.process = None

    def stop(self, *, keep: bool = False) -> None:
        """Shut down (SIGTERM), then SIGKILL; safe to call twice. Temporary directories
        are removed unless ``keep``."""
        process = self.process
        if process is not None:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
                try:
                    process.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.kill()
            self.process = None
        if keep:
            return
        if self._temporary:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
