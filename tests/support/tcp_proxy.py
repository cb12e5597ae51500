"""A loopback TCP proxy a test can cut: the database "goes away" without stopping it.

``cut()`` closes every open connection and refuses new ones, which is what an
application sees when its database host drops off the network; ``stall()`` keeps
every connection open but forwards nothing (a half-open peer: only a timeout can
tell); ``restore()`` lets traffic through again. ``cut_after_reply_to(marker)``
forwards the next client message containing ``marker`` (``b"COMMIT"``), lets the
server answer it, then drops that answer and the connection: the write was
applied but the client never learns so (a lost COMMIT reply).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from .gunicorn import free_port

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the suite runs on 3.10 too
    from typing import Self


class LoopbackProxy:
    """What every proxy of the suite shares: a loopback listener on a free port, and an
    accept loop that connects each client to the target and hands the pair on
    (:meth:`_connected`); a client that comes while the proxy is cut is refused."""

    #: The name of the accept loop's thread.
    thread_name = "proxy"

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        self._open.set()
        self._thread = threading.Thread(
            target=self._accept_loop, name=self.thread_name, daemon=True
        )
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._open.is_set():
                client.close()  # refused while cut
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=3)
            except OSError:
                client.close()
                continue
            self._connected(client, upstream)

    def _connected(self, client: socket.socket, upstream: socket.socket) -> None:
        """Carry the bytes between a new client and its upstream connection."""
        raise NotImplementedError

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`restore`."""
        raise NotImplementedError

    def restore(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self._stopped.set()
        self.cut()
        if self._listener is not None:
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)


class TcpProxy(LoopbackProxy):
    thread_name = "tcp-proxy"

    def __init__(self, target_host: str, target_port: int) -> None:
        super().__init__(target_host, target_port)
        self._connections: set[socket.socket] = set()
        self._stalled = threading.Event()
        self._marker: bytes | None = None
        #: Reads from clients forwarded upstream: with a client that waits for each
        #: answer before it sends again, one per round trip.
        self.client_sends = 0
        self._marker_skip = 0
        self.cuts_after_reply = 0

    def _connected(self, client: socket.socket, upstream: socket.socket) -> None:
        with self._lock:
            self._connections.update((client, upstream))
        threading.Thread(
            target=self._pump, args=(client, upstream), name="tcp-proxy-pump", daemon=True
        ).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(client, selectors.EVENT_READ, upstream)
            selector.register(upstream, selectors.EVENT_READ, client)
        except (OSError, ValueError):  # cut() closed the pair before this thread began
            selector.close()
            self._close_pair(client, upstream)
            return
        try:
            while not self._stopped.is_set() and self._open.is_set():
                if self._stalled.is_set():
                    time.sleep(0.05)  # bytes wait in the kernel buffers, unread
                    continue
                for key, _ in selector.select(timeout=0.2):
                    source: Any = key.fileobj
                    data = source.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
                    if source is client:
                        with self._lock:
                            self.client_sends += 1
                    if source is client and self._matches(data):
                        self._swallow_reply(client, upstream)
                        return
        except OSError:
            return
        finally:
            selector.close()
            self._close_pair(client, upstream)

    def _matches(self, data: bytes) -> bool:
        with self._lock:
            if self._marker is None or self._marker not in data:
                return False
            if self._marker_skip > 0:
                self._marker_skip -= 1
                return False
            self._marker = None
            self.cuts_after_reply += 1
            return True

    @staticmethod
    def _swallow_reply(client: socket.socket, upstream: socket.socket) -> None:
        """Wait until the server has answered (so the statement is applied), drop the answer.

        What the client sends meanwhile is still forwarded: psycopg 3 may send one
        statement in pieces (its pipeline's Bind, Execute and Sync after the Parse that
        holds the text), and the server answers, and commits, only once it has them.
        Answers that follow within a moment (the rest of a reply sent in pieces, the
        commit's) are dropped too.
        """
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ)
        selector.register(upstream, selectors.EVENT_READ)
        give_up = time.monotonic() + 5
        answered_at: float | None = None
        try:
            while time.monotonic() < give_up:
                if answered_at is not None and time.monotonic() > answered_at + 0.1:
                    return
                for key, _ in selector.select(timeout=0.02):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.fileobj is client:
                        upstream.sendall(data)
                    elif answered_at is None:
                        answered_at = time.monotonic()
        except OSError:
            pass
        finally:
            selector.close()

    def cut_after_reply_to(self, marker: bytes, *, skip: int = 0) -> None:
        """Once: forward the ``skip+1``-th client message containing ``marker``, let the
        server apply and answer it, then close that connection without passing the answer on."""
        with self._lock:
            self._marker = marker
            self._marker_skip = skip

    def _close_pair(self, *sockets: socket.socket) -> None:
        with self._lock:
            for sock in sockets:
                self._connections.discard(sock)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`restore`."""
        self._open.clear()
        with self._lock:
            connections = list(self._connections)
        self._close_pair(*connections)

    def stall(self) -> None:
        """Keep connections (and accept new ones) but forward nothing until :meth:`restore`."""
        self._stalled.set()

    def restore(self) -> None:
        self._stalled.clear()
        super().restore()
