"""One Redis pub/sub subscriber per worker process, waking parked requests (C10, R83).

Every process keeps a single subscriber connection and a single daemon thread per
(Redis, channel), shared by every app that uses them, started on the first parked
request, never at import or in ``init_app``. Only that thread touches the redis-py
``PubSub`` object, which is not safe to share between threads. Request threads
only register their app's :class:`~flask_idempotency.notify.hub.WakeupHub` here.

Pub/sub is at-most-once: anything published while we are disconnected is lost.
So the listener counts as live only after the server's subscribe acknowledgement
has been read (``subscribe()`` returns before it), and every (re)subscription and
every disconnect wakes all local waiters so they re-read the store. A heartbeat
PING whose PONG never comes back exposes a half-open connection that a plain read
would wait on forever. After a fork the child forgets the parent's listeners (the
thread did not survive the fork and the socket is the parent's), so gunicorn
``--preload`` starts a fresh one in each worker on its first need.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, cast

from .. import process
from ..cache.outage import timed_out

if TYPE_CHECKING:
    from .hub import WakeupHub

log = logging.getLogger("flask_idempotency")

#: Seconds one read may block when the subscriber's socket cannot be waited on directly
#: (a test double, an exotic connection class). A real socket is waited on with
#: ``select`` until a message, the next heartbeat or ``stop()``: an idle listener
#: thread wakes once per heartbeat interval, not on a tick.
READ_TICK = 0.5
#: Seconds of silence after which the listener sends a heartbeat PING.
HEARTBEAT_INTERVAL = 5.0
#: Seconds a heartbeat or the subscribe acknowledgement may take before we reconnect.
ANSWER_TIMEOUT = 5.0
#: Reconnect back-off: first delay and ceiling, in seconds. It grows to ``BACKOFF_CAP``
#: only while attempts time out; attempts refused at once (Redis restarting, a failover)
#: cost nothing and go on every ``BACKOFF_QUICK_CAP`` at most, so the subscription is
#: back within about a second of Redis answering, however long it was away (C54).
BACKOFF_FIRST = 0.25
BACKOFF_CAP = 10.0
BACKOFF_QUICK_CAP = 1.0

_HEARTBEAT = "flask-idempotency-heartbeat"


class ListenerLost(Exception):
    """The subscription stopped answering; the listener reconnects."""


class TopologyChanged(Exception):
    """The subscriber's view of the masters is out of date: subscribe again."""


class _Idle(Exception):
    """Every app this listener served is gone: the thread ends and closes its connection."""


class WakeupListener:
    """The subscriber thread of one (process, Redis, channel)."""

    def __init__(
        self,
        connect: Callable[[], Any],
        channel: str,
        *,
        first_wait: float = 0.5,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        answer_timeout: float = ANSWER_TIMEOUT,
    ) -> None:
        self._connect = connect
        self.channel = channel
        self._first_wait = first_wait
        self._heartbeat_interval = heartbeat_interval
        self._answer_timeout = answer_timeout
        self._hubs: weakref.WeakSet[WakeupHub] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._confirmed = threading.Event()
        self._first_attempt_done = threading.Event()
        self._stopping = threading.Event()
        self._pid = os.getpid()
        #: How many times a subscription was confirmed (1 + reconnects); for tests and stats.
        self.subscriptions = 0
        #: Wake-up messages received and dispatched.
        self.messages = 0
        #: How many times the thread woke from waiting on its socket (idle cost; tests).
        self.wakeups = 0
        #: Called by the thread when it ends (the registry forgets it).
        self.on_exit: Callable[[], None] | None = None
        self._interrupt: tuple[socket.socket, socket.socket] | None = None

    # -- request threads -----------------------------------------------------------

    def ensure(self, hub: WakeupHub) -> bool:
        """Deliver wake-ups to ``hub``; ``True`` once the subscription is confirmed.

        The first caller in a process starts the thread and waits a little for the
        acknowledgement, so the first parked request already gets messages; later
        callers never wait (they poll until the listener is back).
        """
        with self._lock:
            if self._stopping.is_set():
                return False  # ended (idle or stopped): the next park gets a new listener
            self._hubs.add(hub)
            if self._thread is None:
                self._interrupt = socket.socketpair()  # stop() wakes the blocked thread
                self._thread = threading.Thread(
                    target=self._run, name="flask-idempotency-wakeups", daemon=True
                )
                self._thread.start()
        if not self._confirmed.is_set() and not self._first_attempt_done.is_set():
            self._first_attempt_done.wait(self._first_wait)
        return self._confirmed.is_set()

    @property
    def live(self) -> bool:
        """Whether the subscription is confirmed right now."""
        return self._confirmed.is_set()

    @property
    def usable(self) -> bool:
        """Still the listener of this process (not stopped, not inherited over a fork)."""
        return not self._stopping.is_set() and self._pid == os.getpid()

    def wait_until_live(self, timeout: float) -> bool:
        """Block until the subscription is confirmed (tests, health checks)."""
        return self._confirmed.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the connection; for tests and shutdown."""
        self._stopping.set()
        with self._lock:
            thread = self._thread
            interrupt = self._interrupt
        if interrupt is not None:
            try:
                interrupt[1].send(b"x")
            except OSError:
                pass  # the thread already ended and closed it
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def abandon(self) -> None:
        """Forget a listener inherited over ``fork()``: its thread does not exist here."""
        self._stopping.set()
        self._confirmed.clear()

    # -- the listener thread -----------------------------------------------------

    def _run(self) -> None:
        backoff = BACKOFF_FIRST
        outage_logged = False
        while not self._stopping.is_set():
            pubsub = None
            slow = False
            try:
                pubsub = self._connect().pubsub(ignore_subscribe_messages=False)
                pubsub.subscribe(self.channel)
                self._read_until_lost(pubsub)
            except _Idle:
                self._stopping.set()
            except Exception as exc:
                slow = isinstance(exc, ListenerLost) or timed_out(exc)
                new_outage = self._confirmed.is_set() or not outage_logged
                if new_outage and not self._stopping.is_set():
                    log.info(
                        "idempotency: wake-up listener lost Redis (%s); parked requests"
                        " poll the database until it returns",
                        _describe(exc),
                    )
                    outage_logged = True
            finally:
                was_live = self._confirmed.is_set()
                self._confirmed.clear()
                self._first_attempt_done.set()
                if pubsub is not None:
                    _close_quietly(pubsub)
                self._wake_all()  # messages may be lost from now on: everyone re-checks
            if was_live:
                backoff = BACKOFF_FIRST
            if self._stopping.wait(backoff) or self._idle():
                break
            backoff = min(backoff * 2, BACKOFF_CAP if slow else BACKOFF_QUICK_CAP)
        self._stopping.set()
        with self._lock:
            interrupt, self._interrupt = self._interrupt, None
        if interrupt is not None:
            for end in interrupt:
                end.close()
        if self.on_exit is not None:
            self.on_exit()

    def _read_until_lost(self, pubsub: Any) -> None:
        """Dispatch messages until the connection fails, goes quiet, or we stop."""
        started = last_heard = time.monotonic()
        ping_sent_at: float | None = None
        check_interval = float(getattr(pubsub, "check_interval", math.inf))
        waited = False
        while not self._stopping.is_set():
            if self._idle():
                raise _Idle
            sockets = sockets_of(pubsub)
            if sockets is None:  # nothing to select on: read on a tick
                message = pubsub.get_message(timeout=READ_TICK)
                self.wakeups += 1
            else:
                message = pubsub.get_message(timeout=0.0)  # what is buffered or readable now
                if message is None and not waited:
                    # Sleep on the socket until data, the next deadline, or stop().
                    if ping_sent_at is not None:
                        due = ping_sent_at + self._answer_timeout
                    elif not self._confirmed.is_set():
                        due = started + self._answer_timeout
                    else:
                        due = last_heard + self._heartbeat_interval
                    timeout = min(due - time.monotonic(), check_interval)
                    if timeout > 0:
                        self._block(sockets, timeout)
                        self.wakeups += 1
                        waited = True
                        continue
                waited = False
            now = time.monotonic()
            if message is not None:
                last_heard = now
                kind = message.get("type")
                if kind == "message":
                    self._dispatch(message.get("data"))
                elif kind == "subscribe":
                    self._on_subscribed()
                elif kind == "pong":
                    ping_sent_at = None
                elif kind == "unsubscribe":
                    raise ListenerLost("the server dropped the subscription")
            if not self._confirmed.is_set() and now - started > self._answer_timeout:
                raise ListenerLost("no subscribe acknowledgement")
            if ping_sent_at is not None:
                if now - ping_sent_at > self._answer_timeout:
                    raise ListenerLost("heartbeat unanswered (half-open connection?)")
            elif now - last_heard >= self._heartbeat_interval:
                pubsub.ping(_HEARTBEAT)
                ping_sent_at = now

    def _block(self, sockets: list[socket.socket], timeout: float) -> None:
        interrupt = self._interrupt
        watched = [*sockets, interrupt[0]] if interrupt is not None else sockets
        if interrupt is not None and interrupt[0].fileno() in wait_readable(watched, timeout):
            try:
                interrupt[0].recv(64)
            except OSError:
                pass

    def _on_subscribed(self) -> None:
        if self.subscriptions:
            log.info("idempotency: wake-up listener subscribed again")
        self.subscriptions += 1
        self._wake_all()  # whatever was published before the acknowledgement is lost
        self._confirmed.set()
        self._first_attempt_done.set()

    def _dispatch(self, data: Any) -> None:
        """Wake the waiters of the digest named in the message; the payload is only a hint."""
        try:
            digest = json.loads(data)["k"]
        except (ValueError, TypeError, KeyError):
            return
        if not isinstance(digest, str):
            return
        self.messages += 1
        for hub in self._hub_list():
            hub.wake(digest)

    def _wake_all(self) -> None:
        for hub in self._hub_list():
            hub.wake_all()

    def _idle(self) -> bool:
        """No app uses this listener any more (the registry holds hubs weakly, 9.8)."""
        with self._lock:
            if self._hubs:
                return False
            self._stopping.set()  # under the lock: ensure() cannot add a hub to a dying thread
            return True

    def _hub_list(self) -> list[WakeupHub]:
        with self._lock:
            return list(self._hubs)


# -- one listener per process (the registry lives in process.py) --------------------


def listener_for(key: Hashable, create: Callable[[], WakeupListener]) -> WakeupListener:
    """This process's listener for ``key`` (a Redis and channel), created on first need."""
    return process.listener_for(key, create)


def stop_all(timeout: float = 5.0) -> None:
    """Stop every listener of this process (tests; graceful shutdown)."""
    process.stop_listeners(timeout)


def running_listeners() -> list[WakeupListener]:
    """The listeners this process has started and not stopped."""
    return cast("list[WakeupListener]", process.running_listeners())  # the only kind there is


def sockets_of(pubsub: Any) -> list[socket.socket] | None:
    """The sockets a subscriber's messages arrive on, or ``None`` if they cannot be
    waited on with ``select`` (then the listener reads on a tick). Subscribers that
    span several connections (the cluster's) say so with a ``sockets()`` method."""
    own = getattr(pubsub, "sockets", None)
    if callable(own):
        result: list[socket.socket] | None = own()
        return result
    sock = getattr(getattr(pubsub, "connection", None), "_sock", None)
    return [sock] if isinstance(sock, socket.socket) else None


def wait_readable(sockets: list[socket.socket], timeout: float) -> set[int]:
    """The file descriptors among ``sockets`` readable within ``timeout`` seconds.

    ``poll``, not ``select``: a busy worker's descriptors can exceed ``select``'s 1024.
    """
    if not hasattr(select, "poll"):  # pragma: no cover - Windows
        readable, _, _ = select.select(sockets, [], [], timeout)
        return {sock.fileno() for sock in readable}
    poller = select.poll()
    for sock in sockets:
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return {fd for fd, _ in poller.poll(max(0, int(timeout * 1000) + 1))}


def readable_now(fds: Iterable[int]) -> set[int]:
    """Which of the file descriptors ``fds`` have data (or an error) right now; no wait."""
    if not hasattr(select, "poll"):  # pragma: no cover - Windows
        readable, _, _ = select.select(list(fds), [], [], 0)
        return set(readable)
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return {fd for fd, _ in poller.poll(0)}


def _close_quietly(pubsub: Any) -> None:
    try:
        pubsub.close()
    except Exception as exc:
        log.debug("idempotency: closing the wake-up subscriber: %s", _describe(exc))


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
