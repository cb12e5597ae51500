"""The one owner of what belongs to a worker process, not to an app or a request.

Engines the extension built, Redis clients shared by apps on the same URL, and the
wake-up listener threads. One ``os.register_at_fork`` hook resets them in a forked
child: a child must never use the parent's pooled sockets (two processes reading
one PostgreSQL connection get each other's rows) nor count on the parent's threads,
which do not exist after ``fork()``.

Locks here are made on first use, never at import or in ``init_app``: under
``gunicorn -k gevent --preload`` the app is imported before gevent patches
``threading``, and a real OS lock held by one greenlet blocks the whole worker.
The fork hook drops them, so a child makes its own (patched) locks. Nothing here
holds a lock across I/O.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from sqlalchemy import Engine

log = logging.getLogger("flask_idempotency")

T = TypeVar("T")


class Listener(Protocol):
    """What the registry needs of a per-process listener thread (the wake-up listener of
    :mod:`~flask_idempotency.notify.listener`): this module names no listener class, so
    it imports nothing that imports it."""

    #: Called by the thread when it ends (the registry sets it to forget the listener).
    on_exit: Callable[[], None] | None

    @property
    def usable(self) -> bool:
        """Still this process's listener (not stopped, not inherited over a fork)."""

    def stop(self, timeout: float = ...) -> None:
        """Stop the thread and close its connection."""

    def abandon(self) -> None:
        """Forget a listener inherited over ``fork()``: its thread does not exist here."""


L = TypeVar("L", bound=Listener)


class _LazyLock:
    """A lock created on first use; ``reset()`` forgets it (after fork)."""

    def __init__(self) -> None:
        self._slot: dict[str, Any] = {}

    def get(self) -> threading.Lock:
        lock = self._slot.get("lock")
        if lock is None:
            # dict.setdefault is atomic under the GIL: racing creators agree on one lock.
            lock = self._slot.setdefault("lock", threading.Lock())
        return lock  # type: ignore[no-any-return]

    def __enter__(self) -> None:
        self.get().acquire()

    def __exit__(self, *exc: object) -> None:
        self.get().release()

    def reset(self) -> None:
        self._slot.clear()


_lock = _LazyLock()
#: Engines built by the extension (never the app's own): disposed in a forked child.
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
#: Redis clients shared per process by configuration (URL and timeouts).
_shared: dict[Hashable, Any] = {}
#: Wake-up listeners of this process, by (Redis, channel).
_listeners: dict[Hashable, Listener] = {}


def lazy_lock() -> _LazyLock:
    """A lock that is made on first use and forgotten after fork (see the module doc)."""
    lock = _LazyLock()
    _lazy_locks.add(lock)
    return lock


_lazy_locks: weakref.WeakSet[_LazyLock] = weakref.WeakSet()


# -- engines ----------------------------------------------------------------------------


def own_engine(engine: Engine) -> Engine:
    """Take ownership of an engine the extension built: it is reset in forked children."""
    _engines.add(engine)
    return engine


def close_engines() -> None:
    """Close the idle pooled connections of every engine the extension built (tests, a
    graceful shutdown); each engine stays usable and connects again on its next use."""
    for engine in list(_engines):
        engine.dispose()


def once(slot: dict[str, T], build: Callable[[], T]) -> T:
    """``slot["value"]``, built on first need without holding a lock while building.

    Racing builders may both build; the first stored wins and the others' results
    are dropped (building must be cheap and side-effect free, like ``create_engine``).
    """
    value = slot.get("value")
    if value is None:
        value = slot.setdefault("value", build())
    return value


# -- shared clients -----------------------------------------------------------------------


def shared(key: Hashable, build: Callable[[], T]) -> T:
    """The process's one object for ``key`` (a Redis client per URL), built on first need."""
    value = _shared.get(key)
    if value is None:
        value = _shared.setdefault(key, build())
    return value  # type: ignore[no-any-return]


# -- listeners ------------------------------------------------------------------------------


def listener_for(key: Hashable, create: Callable[[], L]) -> L:
    """This process's listener for ``key`` (a Redis and channel), created on first need.

    ``create`` must make the same kind of listener for the same ``key`` every time."""
    with _lock:
        listener = _listeners.get(key)
        if listener is None or not listener.usable:
            listener = _listeners[key] = create()
            listener.on_exit = lambda: forget_listener(key, listener)
        return listener  # type: ignore[return-value]


def forget_listener(key: Hashable, listener: Listener) -> None:
    """Drop ``listener`` from the registry if it is still the one for ``key`` (it exited)."""
    with _lock:
        if _listeners.get(key) is listener:
            del _listeners[key]


def stop_listeners(timeout: float = 5.0) -> None:
    """Stop every listener of this process (tests; graceful shutdown)."""
    with _lock:
        listeners = list(_listeners.values())
        _listeners.clear()
    for listener in listeners:
        listener.stop(timeout)


def running_listeners() -> list[Listener]:
    """The listeners this process has started and not stopped."""
    with _lock:
        return [listener for listener in _listeners.values() if listener.usable]


# -- kept settlements ----------------------------------------------------------------------

#: Lock tokens of the claims whose settlement this process keeps (C59). A claim of this
#: process never takes such a record over once its lease looks lapsed: the settlement is
#: alive here and lands by itself.
_kept_tokens: set[str] = set()


def keep_token(token: str) -> None:
    _kept_tokens.add(token)


def forget_token(token: str) -> None:
    _kept_tokens.discard(token)


def keeps(token: str | None) -> bool:
    """Whether this process keeps the settlement of the claim holding ``token``."""
    return token is not None and token in _kept_tokens


# -- fork ---------------------------------------------------------------------------------

#: Resets of other per-process parts (the lease heartbeat), run by the one fork hook.
_fork_resets: list[Callable[[], None]] = []


def at_fork(reset: Callable[[], None]) -> None:
    """Run ``reset`` in every forked child, after the resets above."""
    _fork_resets.append(reset)


def _after_fork_in_child() -> None:
    """Reset everything per-process: the child starts afresh on first need."""
    _lock.reset()
    for lock in list(_lazy_locks):
        lock.reset()
    for listener in list(_listeners.values()):
        listener.abandon()  # its thread did not survive the fork
    _listeners.clear()
    _kept_tokens.clear()  # the parent's settlements stay the parent's
    _shared.clear()  # redis-py pools also check the pid; these are rebuilt in the child
    for engine in list(_engines):
        try:
            # close=False: the parent's connections stay open for the parent; the
            # child only forgets them and opens its own.
            engine.dispose(close=False)
        except Exception as exc:  # pragma: no cover - defensive: never break a fork
            log.warning("idempotency: resetting an engine after fork failed: %s", exc)
    for reset in _fork_resets:
        reset()


os.register_at_fork(after_in_child=_after_fork_in_child)
