"""A private PgBouncer in transaction-pooling mode, in front of the test PostgreSQL.

Debian's ``/usr/sbin/pgbouncer`` runs in the foreground with its own config, auth
file, log and pid file in a temporary directory, listens on a free 127.0.0.1 port,
and is stopped by process id. Every database name is passed through to the real
server, so the session's private database is reachable as-is. PgBouncer refuses
to run as root; started as root it drops to ``postgres`` (or ``PGBOUNCER_USER``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy.engine import URL

from tests.support.private_server import log_tail
from tests.support.redis_server import free_port

BINARY_CANDIDATES = ("/usr/sbin/pgbouncer", "pgbouncer")


def pgbouncer_binary() -> str | None:
    for candidate in BINARY_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


class PgBouncer:
    """``PgBouncer(server_host, server_port).start()``; ``route(url)`` points a URL at it."""

    def __init__(
        self,
        binary: str,
        server_host: str = "127.0.0.1",
        server_port: int = 5432,
        *,
        pool_size: int = 10,
        max_client_conn: int = 400,
    ) -> None:
        self.binary = binary
        self.server_host = server_host
        self.server_port = server_port
        self.pool_size = pool_size
        self.max_client_conn = max_client_conn
        self.port = 0
        self.directory = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "pgbouncer.log"

    def route(self, url: URL) -> URL:
        """The same database, user and driver, reached through this PgBouncer."""
        return url.set(host="127.0.0.1", port=self.port)

    def _write_config(self) -> Path:
        users = self.directory / "userlist.txt"
        users.write_text('"postgres" ""\n')
        config = self.directory / "pgbouncer.ini"
        config.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={self.server_host} port={self.server_port}",
                    "",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {users}",
                    "pool_mode = transaction",
                    f"default_pool_size = {self.pool_size}",
                    "min_pool_size = 0",
                    "reserve_pool_size = 0",
                    f"max_client_conn = {self.max_client_conn}",
                    "server_reset_query =",
                    "ignore_startup_parameters = extra_float_digits,options",
                    f"logfile = {self.log_path}",
                    f"pidfile = {self.directory / 'pgbouncer.pid'}",
                    "",
                ]
            )
        )
        return config

    def start(self, ready_within: float = 20.0) -> PgBouncer:
        self.port = free_port()
        config = self._write_config()
        command = [self.binary]
        if os.geteuid() == 0:
            user = os.environ.get("PGBOUNCER_USER", "postgres")
            entry = pwd.getpwnam(user)
            os.chmod(self.directory, 0o755)
            for path in [self.directory, *self.directory.iterdir()]:
                os.chown(path, entry.pw_uid, entry.pw_gid)
            command += ["-u", user]
        command.append(str(config))
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            cwd=self.directory,
        )
        deadline = time.monotonic() + ready_within
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.process.returncode}: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer on port {self.port} did not listen: {self.log()}")

    def log(self) -> str:
        return log_tail(self.log_path)

    def stop(self) -> None:
        """SIGTERM (PgBouncer's immediate shutdown), then SIGKILL, by pid."""
        process = self.process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
        self.process = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> PgBouncer:  # noqa: PYI034 - not meant to be subclassed
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
