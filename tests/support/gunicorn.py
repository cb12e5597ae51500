"""Run a real gunicorn server on loopback for multi-process tests.

Started on a free 127.0.0.1 port, stopped by process id (master, then any
worker still alive), its log kept for the failure message.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (gunicorn's workers), read from /proc."""
    children: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    if not task_dir.exists():
        return children
    for task in task_dir.iterdir():
        try:
            children.extend(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return children


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, not ours
        return True
    # A zombie still answers kill(0); treat it as dead.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class GunicornServer:
    """``GunicornServer("tests.apps.procapp:create_app()", env={...}).start()``."""

    def __init__(
        self,
        app: str,
        *,
        env: dict[str, str] | None = None,
        workers: int = 3,
        threads: int = 8,
        worker_class: str = "gthread",
        preload: bool = False,
        timeout: int = 60,
        health_path: str = "/healthz",
        extra_args: list[str] | None = None,
    ) -> None:
        self.app = app
        self.env = dict(env or {})
        self.workers = workers
        self.threads = threads
        self.worker_class = worker_class
        self.preload = preload
        self.timeout = timeout
        self.health_path = health_path
        self.extra_args = list(extra_args or [])
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        # Kept open for the server's lifetime and closed in stop(), so not a `with` block.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="gunicorn-", suffix=".log", delete=False
        )
        self.final_log = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_within: float = 60.0) -> GunicornServer:
        self.port = free_port()
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            f"127.0.0.1:{self.port}",
            "--workers",
            str(self.workers),
            "--threads",
            str(self.threads),
            "--worker-class",
            self.worker_class,
            "--timeout",
            str(self.timeout),
            "--graceful-timeout",
            "3",
            "--log-level",
            "warning",
        ]
        if self.preload:
            command.append("--preload")
        command.extend(self.extra_args)
        command.append(self.app)
        env = {**os.environ, **self.env, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + ready_within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited early:\n{self.log()}")
            if self._healthy() and len(self.worker_pids()) >= self.workers:
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gunicorn did not become ready:\n{self.log()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def worker_pids(self) -> list[int]:
        if self.proc is None:
            return []
        return [pid for pid in child_pids(self.proc.pid) if pid_alive(pid)]

    def wait_for_workers(self, count: int | None = None, within: float = 30.0) -> list[int]:
        """Wait until the master has ``count`` live workers (after a kill it forks a new one)."""
        wanted = self.workers if count is None else count
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            pids = self.worker_pids()
            if len(pids) >= wanted and self._healthy():
                return pids
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn has {self.worker_pids()} workers, wanted {wanted}")

    def log(self) -> str:
        """The tail of the server's log (kept after :meth:`stop` as ``final_log``)."""
        try:
            return Path(self._log.name).read_text(errors="replace")[-8000:]
        except OSError:
            return self.final_log

    def stop(self) -> None:
        """Stop the master by pid, then any worker it left behind."""
        if self.proc is None:
            return
        workers = self.worker_pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in workers:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc = None
        self.final_log = self.log()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __enter__(self) -> GunicornServer:  # noqa: PYI034 - not meant to be subclassed
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
