"""A deadline for the store's statements: a server that stops answering is not waited for.

CONTRACT C25, C55.

libpq has a ``connect_timeout`` but nothing bounds the wait for a statement's answer:
a database host that drops off the network, freezes, or sits behind a proxy or load
balancer whose backend died keeps the statement waiting until TCP gives up (about
15 minutes), with the request's thread, its pooled connection and, behind it, every
request that needs one. The server's ``statement_timeout`` cannot help: the server
is what does not answer.

So each statement of the store, with its COMMIT, runs under a deadline
(:data:`STATEMENT_DEADLINE`): one watchdog thread per process sleeps until the earliest
deadline of the statements under way. At a statement's deadline it first asks the server
to cancel it, by the driver's own means (psycopg 3's ``cancel_safe()``, libpq's
``PQcancel`` for psycopg2, :func:`_libpq_cancel`; sent on a connection of its own, which
PgBouncer forwards to the server connection running it): a statement stuck behind a lock
or a slow server then ends with ``query_canceled`` and was never applied, so a cut claim
cannot commit later and hold its key for a lease (C58), and the connection stays in the
pool. Only if no answer comes within :func:`grace` more (a dead network, a frozen host:
the cancel cannot reach the server either) does it shut down the statement's socket
(``shutdown(2)`` on a duplicate of the descriptor: the driver's own descriptor stays
open until the driver closes it). The driver then reports the connection lost,
SQLAlchemy drops it from its pool, and the store answers
:class:`~flask_idempotency.store.errors.StoreError` at once: 503 with ``Retry-After``
(C25). That statement's outcome is unknown (:attr:`Deadline.cut`): it may still have
been applied. Kernel-level limits (``tcp_user_timeout``, keepalives, set by
:mod:`.connect`) catch a peer that stopped acknowledging packets; this catches the rest,
such as a peer whose kernel still acknowledges but which never answers.

Why not the server's ``statement_timeout``: the request path's statements on
PostgreSQL run one per round trip in autocommit (:mod:`.direct`), where ``SET LOCAL``
has no transaction to live in, and a session setting does not stick behind a
transaction pooler (a connection option is dropped by PgBouncer); the cancel works
in every one of those set-ups, and only the watchdog can give up on a server that
does not answer at all. MariaDB's connections get the server's own limit instead
(``max_statement_time``, :mod:`.engines`).

Only PostgreSQL connections are watched (psycopg2 and psycopg 3 connections expose
their socket as ``fileno()``). Under gevent the watchdog is a greenlet and fires only
where the driver yields to the hub (psycopg 3; psycopg2 with ``psycogreen``);
``tcp_user_timeout`` still applies there.

A watched statement costs a lock taken twice and a dictionary entry; the thread wakes
about once per deadline while statements run, and sleeps while none does.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import process

log = logging.getLogger("flask_idempotency")

#: Seconds a statement of the store (its COMMIT included) may wait for its answer.
STATEMENT_DEADLINE = 5.0


def grace(seconds: float) -> float:
    """How long after asking the server to cancel a statement its socket is shut down."""
    return min(1.0, max(0.2, seconds / 2))


class Deadline:
    """One store call's deadline; :attr:`fired` once its statement was cut off (a cancel
    was sent), :attr:`cut` once its socket had to be shut down (no answer even to the
    cancel: the statement may still have been applied, C58)."""

    __slots__ = ("canceller", "connection", "cut", "due", "fd", "fired", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.due = 0.0
        self.fd = -1
        self.fired = False
        self.cut = False
        self.connection: Any = None
        self.canceller: threading.Thread | None = None


class Watchdog:
    """The statements under way and the thread that cuts off the late ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # taken directly where no waiting is involved
        self._cond = threading.Condition(self._lock)
        #: Deadlines under way (a dict for its order and O(1) removal).
        self._watched: dict[Deadline, None] = {}
        self._thread: threading.Thread | None = None
        #: When the waiting thread wakes by itself (``inf``: only when told); ``None``
        #: while it is not waiting (it looks at every deadline before it waits again).
        self._wakes_at: float | None = None
        #: Statements cut off by this process (tests, diagnostics).
        self.fired = 0

    def watch(self, deadline: Deadline, dbapi_connection: Any) -> bool:
        """Watch the statement about to run on ``dbapi_connection``; ``False`` (not
        watched) when the connection shows no socket."""
        try:
            fd = dbapi_connection.fileno()
        except Exception:  # not a PostgreSQL driver's connection, or already closed
            return False
        due = time.monotonic() + deadline.seconds
        with self._lock:
            deadline.fd, deadline.due, deadline.connection = fd, due, dbapi_connection
            self._watched[deadline] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idempotency-deadline", daemon=True
                )
                self._thread.start()
            elif self._wakes_at is not None and due < self._wakes_at:
                self._wakes_at = None
                self._cond.notify()
        return True

    def unwatch(self, deadline: Deadline) -> None:
        """The statement is over: once this returns, its socket is never shut down, and
        no cancel of it is still on its way (one arriving later would cancel whatever
        statement the connection runs next, for another request)."""
        with self._lock:
            self._watched.pop(deadline, None)
            canceller, deadline.connection = deadline.canceller, None
        if canceller is not None:
            canceller.join(grace(deadline.seconds))
            if canceller.is_alive():  # the cancel is still on its way: never reuse this
                _shut_down(deadline.fd)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # pragma: no cover - a bug here must not pass silently
            log.exception("idempotency: the statement deadline watchdog stopped")
            with self._lock:
                self._thread = None  # the next statement starts another

    def _loop(self) -> None:
        with self._cond:
            while True:
                if not self._watched:
                    self._wakes_at = math.inf  # the next watch wakes it
                    self._cond.wait()
                    self._wakes_at = None
                    continue
                now = time.monotonic()
                earliest = min(d.due for d in self._watched)
                if earliest > now:
                    self._wakes_at = earliest
                    self._cond.wait(earliest - now)
                    self._wakes_at = None
                    continue
                for late in [d for d in self._watched if d.due <= now]:
                    if not late.fired:  # first the server is asked to cancel it
                        late.fired = True
                        self.fired += 1
                        late.due = now + grace(late.seconds)
                        late.canceller = threading.Thread(
                            target=_cancel,
                            args=(_canceller(late.connection, grace(late.seconds)),),
                            name="idempotency-cancel",
                            daemon=True,
                        )
                        late.canceller.start()
                        log.debug(
                            "idempotency: no answer from the database within %g s: cancelled",
                            late.seconds,
                        )
                        continue
                    del self._watched[late]  # no answer even to the cancel
                    late.cut = True
                    _shut_down(late.fd)
                    log.debug(
                        "idempotency: no answer from the database to a cancel either:"
                        " connection closed"
                    )


def _canceller(connection: Any, timeout: float) -> Callable[[], None]:
    """What asks the server to cancel the statement ``connection`` runs, prepared now
    (under the watchdog's lock: the statement is still under way, so the connection is
    open) and sent from a thread of its own (it may wait on a dead network)."""
    cancel_safe = getattr(connection, "cancel_safe", None)
    if cancel_safe is not None:  # psycopg 3: bounded by its own timeout
        return lambda: cancel_safe(timeout=timeout)
    pgconn = getattr(connection, "pgconn_ptr", None)
    if isinstance(pgconn, int) and pgconn:  # psycopg2
        return _libpq_cancel(connection, pgconn)
    cancel = getattr(connection, "cancel", None)
    return cancel if callable(cancel) else (lambda: None)


def _libpq_cancel(connection: Any, pgconn: int) -> Callable[[], None]:
    """psycopg2's cancel, sent with the interpreter lock released.

    psycopg2's own ``connection.cancel()`` holds the GIL while libpq's ``PQcancel``
    connects to the server: with the network silent, the whole process froze (every
    thread, the watchdog's too) until TCP gave up. So the same libpq calls are made
    through ctypes, which releases the GIL: ``PQgetCancel`` copies what the cancel
    needs (no I/O; the connection may be closed afterwards), ``PQcancel`` sends it.
    """
    lib = _psycopg2_libpq()
    if lib is None:
        return lambda: None
    handle = lib.PQgetCancel(ctypes.c_void_p(pgconn))
    if not handle:
        return lambda: None

    def send() -> None:
        try:
            errors = ctypes.create_string_buffer(256)
            if not lib.PQcancel(handle, errors, len(errors)):
                log.debug("idempotency: the cancel was not sent: %s", errors.value)
        finally:
            lib.PQfreeCancel(handle)

    return send


_libpq: list[Any] = []


def _psycopg2_libpq() -> Any:
    """The libpq psycopg2 is linked against (its C extension's symbols resolve to it),
    with the three functions' signatures; ``None`` when it cannot be loaded.

    The C extension is ``psycopg2._psycopg``: the connection's type names
    ``psycopg2.extensions`` as its module, a Python file that cannot be loaded as a
    library (every psycopg2 cancel was silently not sent, and a late statement only
    had its socket shut down, still running on the server).
    """
    if not _libpq:
        try:
            module = importlib.import_module("psycopg2._psycopg")  # imported already
            lib = ctypes.CDLL(module.__file__)
            lib.PQgetCancel.argtypes = [ctypes.c_void_p]
            lib.PQgetCancel.restype = ctypes.c_void_p
            lib.PQcancel.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
            lib.PQcancel.restype = ctypes.c_int
            lib.PQfreeCancel.argtypes = [ctypes.c_void_p]
            lib.PQfreeCancel.restype = None
        except Exception as exc:  # then only the socket's shutdown is left
            log.warning(
                "idempotency: psycopg2's libpq cannot be reached to cancel a statement"
                " past its deadline (%s); such a statement has its socket shut down"
                " instead and may still run on the server",
                exc,
            )
            lib = None
        _libpq.append(lib)
    return _libpq[0]


def _cancel(send: Callable[[], None]) -> None:
    """Send a prepared cancel; a failure leaves the socket's shutdown to the watchdog."""
    try:
        send()
    except Exception as exc:
        log.debug("idempotency: could not cancel a late statement: %s", exc)


def _shut_down(fd: int) -> None:
    """Shut down the socket behind ``fd`` (a duplicate is closed, never ``fd`` itself)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


_watchdog: Watchdog | None = None
_made = process.lazy_lock()


def watchdog() -> Watchdog:
    """This process's watchdog, made on first use and afresh in a forked child."""
    global _watchdog
    current = _watchdog
    if current is None:
        with _made:
            current = _watchdog
            if current is None:
                current = _watchdog = Watchdog()
    return current


def _reset_after_fork() -> None:
    """A forked child's watchdog starts afresh: the parent's thread does not exist there."""
    global _watchdog
    _watchdog = None


process.at_fork(_reset_after_fork)
