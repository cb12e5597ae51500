"""A loopback TCP proxy that delivers what the server sends ``lag`` seconds late.

Put between a PostgreSQL standby and its primary (the primary's ``connect_address``),
it makes the standby receive the WAL ``lag`` seconds after the primary wrote it: a
replication lag of a known size, with nothing else slowed (what the client sends goes
through at once). ``cut()`` is the primary's host dying: every connection closes and
whatever was still on its way is dropped, never delivered, so the standby ends with
the WAL it had received ``lag`` seconds before the crash. New connections are refused
until ``restore()``.

    proxy = LagProxy("127.0.0.1", primary_port, lag=0.5).start()
    ...
    proxy.cut()
    proxy.stop()
"""

from __future__ import annotations

import collections
import socket
import threading
import time

from .tcp_proxy import LoopbackProxy


class _Pair:
    """One client connection and its upstream, with the server's bytes still in flight."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.in_flight: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.closed = False

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.in_flight.clear()
            self.ready.notify_all()
        for sock in (self.client, self.upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class LagProxy(LoopbackProxy):
    thread_name = "lag-proxy"

    def __init__(self, target_host: str, target_port: int, *, lag: float) -> None:
        super().__init__(target_host, target_port)
        self.lag = lag
        self._pairs: set[_Pair] = set()
        #: Bytes of the server's dropped by cut() before they were delivered.
        self.dropped = 0

    def _connected(self, client: socket.socket, upstream: socket.socket) -> None:
        upstream.settimeout(None)
        pair = _Pair(client, upstream)
        with self._lock:
            self._pairs.add(pair)
        for target, name in (
            (self._to_server, "lag-proxy-up"),
            (self._from_server, "lag-proxy-down"),
            (self._deliver, "lag-proxy-deliver"),
        ):
            threading.Thread(target=target, args=(pair,), name=name, daemon=True).start()

    def _to_server(self, pair: _Pair) -> None:
        """The client's bytes, at once."""
        try:
            while data := pair.client.recv(65536):
                pair.upstream.sendall(data)
        except OSError:
            pass
        self._drop(pair)

    def _from_server(self, pair: _Pair) -> None:
        """The server's bytes, queued to be delivered ``lag`` seconds after they came."""
        try:
            while data := pair.upstream.recv(65536):
                with pair.ready:
                    if pair.closed:
                        return
                    pair.in_flight.append((time.monotonic() + self.lag, data))
                    pair.ready.notify()
        except OSError:
            pass
        with pair.ready:  # the server closed: deliver what is queued, then close
            pair.in_flight.append((time.monotonic() + self.lag, b""))
            pair.ready.notify()

    def _deliver(self, pair: _Pair) -> None:
        while True:
            with pair.ready:
                while not pair.in_flight and not pair.closed:
                    pair.ready.wait()
                if pair.closed:
                    return
                due, data = pair.in_flight[0]
                wait = due - time.monotonic()
                if wait > 0:
                    pair.ready.wait(wait)
                    continue
                pair.in_flight.popleft()
            if not data:
                self._drop(pair)
                return
            try:
                pair.client.sendall(data)
            except OSError:
                self._drop(pair)
                return

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)
        with pair.ready:
            self.dropped += sum(len(data) for _, data in pair.in_flight)
        pair.close()

    def cut(self) -> None:
        """The host is gone: close everything now, drop what is in flight, refuse new ones."""
        self._open.clear()
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._drop(pair)
