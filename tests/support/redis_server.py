"""A private redis-server for one test: its own port, its own directory, no persistence.

Tests that kill, restart or flush Redis must never touch a shared server, so each
gets one of its own, bound to 127.0.0.1 on a free port and stopped by process id.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT = 30.0


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process; ``start``/``kill``/``restart`` keep the same port."""

    def __init__(self, binary: str, directory: Path, port: int | None = None) -> None:
        self.binary = binary
        self.directory = Path(directory)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._log = self.directory / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                    "--protected-mode",
                    "yes",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
            )
        self._wait_until_ready()
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.process.returncode}: {self._log.read_text()}"
                )
            if self.command(b"PING") == b"+PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def command(self, *words: bytes) -> bytes | None:
        """Send one inline command; the first reply line, or ``None`` if unreachable."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2.0) as sock:
                sock.sendall(b" ".join(words) + b"\r\n")
                reply = sock.recv(4096)
        except OSError:
            return None
        return reply.split(b"\r\n", 1)[0]

    def flushall(self) -> None:
        assert self.command(b"FLUSHALL") == b"+OK"

    def kill(self) -> None:
        """SIGKILL: no goodbye to clients, the way a crash or an OOM kill looks."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(START_TIMEOUT)
        self.process = None

    def stop(self) -> None:
        """Terminate politely, then kill; safe to call twice."""
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

    def restart(self) -> None:
        """Start again on the same port (after ``kill`` or ``stop``)."""
        self.stop()
        self.start()
