"""What the suite's private database servers share (:mod:`.postgres_server`,
:mod:`.mariadb_server`): a restart that keeps the data and the port, the tail of the
server's log for a failure's message, and use as a context manager."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the suite runs on 3.10 too
    from typing import Self


def log_tail(path: Path) -> str:
    """The last 4,000 characters of a server's log ('' when there is none yet)."""
    try:
        return path.read_text(errors="replace")[-4000:]
    except OSError:
        return ""


class PrivateServer:
    """A server process a test started, with its data directory and log file."""

    #: The server's own log file (set by the subclass).
    log_path: Path

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self, *, keep: bool = False) -> None:
        """Stop the server; ``keep``: leave its data for a :meth:`start` again."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL the server (a crash)."""
        raise NotImplementedError

    def restart(self, *, crash: bool = False) -> Self:
        """Stop (or SIGKILL when ``crash``) and start again with the same data and port;
        after :meth:`kill` it just starts."""
        if crash:
            self.kill()
        else:
            self.stop(keep=True)
        return self.start()

    def log(self) -> str:
        return log_tail(self.log_path)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
