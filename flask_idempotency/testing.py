"""A pytest plugin for applications that use Flask-Idempotency.

Installed with the package and loaded by pytest through the ``pytest11`` entry
point. It gives your tests:

- :func:`assert_idempotent`: fire concurrent duplicates and later retries of one
  request at an endpoint, through the Flask test client or at a live server URL,
  and assert that the work ran once, that every duplicate got the identical
  response, and that the same key with a changed body is refused with 422.
- the ``idempotency_store`` fixture: each test gets a fresh records table (and
  its own corner of the Redis cache), so no test replays another's keys. It uses
  your ``app`` fixture; :func:`isolated_store` does the same for any app.

See ``docs/testing.md``.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from flask import Flask

from . import signals
from .store import DurableStore

_UNSET: Any = object()
#: A field or member the changed request adds; the layer answers before the view sees it.
CHANGED_MARKER = "_assert_idempotent_changed"


@dataclasses.dataclass(frozen=True)
class Answer:
    """One response as the helper saw it."""

    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == name.lower():
                return value
        return None


@dataclasses.dataclass
class IdempotencyReport:
    """What :func:`assert_idempotent` observed; returned when every check passed."""

    key: str
    executions: int
    #: The final answer of each concurrent duplicate (after retrying its 409s), then the retries.
    answers: list[Answer]
    #: How many 409 ``request-in-progress`` answers were retried during the burst.
    in_progress_retried: int
    #: The answer to the same key with a changed body (``None`` when skipped).
    changed: Answer | None


def assert_idempotent(
    client: Any,
    method: str,
    path: str,
    *,
    json: Any = _UNSET,
    data: Any = None,
    headers: dict[str, str] | None = None,
    key: str | None = None,
    concurrency: int = 8,
    retries: int = 2,
    counter: Callable[[], int] | None = None,
    check_changed: bool = True,
    header: str = "Idempotency-Key",
    replay_header: str = "Idempotent-Replayed",
    timeout: float = 30.0,
) -> IdempotencyReport:
    """Assert that ``method path`` with one idempotency key runs once, whatever is sent.

    ``client`` is a Flask test client (requests run in threads, in this process)
    or the base URL of a live server (``"http://127.0.0.1:5000"``). The body is
    ``json=`` or ``data=`` (a dict for a form, or bytes), as for the test client.

    Checks, in order: ``concurrency`` identical requests sent at once (a 409
    ``request-in-progress`` is retried, as a client would), then ``retries``
    more one after another: the work ran exactly once, exactly one answer is the
    original and every other one carries ``Idempotent-Replayed: true`` with the
    same status and byte-identical body; then the same key with a changed body
    gets 422 (skipped with ``check_changed=False``).

    "Ran once" is read from ``counter``, a callable returning how many times the
    effect happened (rows in a table, calls to a fake gateway), when you give
    one; else from the extension's ``request_executed`` signal, which only a
    test client in this process can observe (so a live URL needs ``counter``).
    """
    if concurrency < 1 or retries < 0:
        raise ValueError("assert_idempotent: concurrency must be >= 1 and retries >= 0.")
    live = isinstance(client, str)
    if not live:
        _require_enabled(client.application, "assert_idempotent")
    if live and counter is None:
        raise TypeError(
            "assert_idempotent(<url>, ...) needs counter=: the extension's signals fire in"
            " the server's process, so count the effect yourself (rows, gateway calls)."
        )
    key = key or f"assert-idempotent-{uuid.uuid4().hex}"
    request = _Request(method.upper(), path, json, data, dict(headers or {}))
    send: Callable[[_Request, str | None], Answer] = (
        _url_sender(client, header) if live else _client_sender(client, header)
    )
    before = counter() if counter is not None else 0
    with _ExecutionCount(None if live else client.application).listening() as executions:
        answers, retried = _burst(send, request, key, concurrency, timeout, executions.threads)
        for _ in range(retries):
            answers.append(_until_settled(send, request, key, timeout, executions.threads)[0])
        changed = None
        if check_changed:
            changed = _call_in(executions.threads, lambda: send(request.changed(), key))
    ran = counter() - before if counter is not None else executions.count
    report = IdempotencyReport(key, ran, answers, retried, changed)
    _check(report, request, replay_header, counted_by="counter" if counter else "signals")
    return report


# -- checks ---------------------------------------------------------------------------


def _require_enabled(app: Flask, helper: str) -> None:
    state = app.extensions.get("idempotency")
    if state is not None and not state.settings.enabled:
        raise AssertionError(
            f"{helper}: app {app.name!r} has IDEMPOTENCY_ENABLED = False, so the layer is"
            " off and every request runs the view: nothing can be idempotent. Give this"
            " test an app with the layer on (IDEMPOTENCY_ENABLED = True, the default)."
        )


def _check(
    report: IdempotencyReport, request: _Request, replay_header: str, counted_by: str
) -> None:
    answers = report.answers
    what = f"{request.method} {request.path}"
    statuses = sorted({a.status for a in answers})
    if report.executions == 0 and counted_by == "signals":
        raise AssertionError(
            f"{what}: the idempotency layer never ran the view (no request_executed signal)."
            f" Answers: {statuses}. Is the view marked @idempotent, is {request.method} in"
            " IDEMPOTENCY_METHODS, and is the extension registered on this app?"
        )
    if report.executions != 1:
        raise AssertionError(
            f"{what} ran {report.executions} times for one key ({counted_by}), not once;"
            f" {len(answers)} requests were answered {statuses}. A retry or a concurrent"
            " duplicate repeated the work."
        )
    originals = [a for a in answers if a.header(replay_header) != "true"]
    if len(originals) != 1:
        raise AssertionError(
            f"{what}: {len(originals)} of {len(answers)} answers lack '{replay_header}: true'"
            " (expected exactly one original; every duplicate must be a replay)."
        )
    original = originals[0]
    if original.status >= 500:
        raise AssertionError(f"{what}: the original answer was {original.status}.")
    for answer in answers:
        if answer.status != original.status or answer.body != original.body:
            raise AssertionError(
                f"{what}: a replay differs from the original: {answer.status}"
                f" {answer.body[:200]!r} against {original.status} {original.body[:200]!r}."
            )
    if report.changed is not None and report.changed.status != 422:
        raise AssertionError(
            f"{what}: the same key with a changed body answered {report.changed.status},"
            f" not 422 key-reused: {report.changed.body[:200]!r}."
        )


# -- sending --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Request:
    method: str
    path: str
    json: Any
    data: Any
    headers: dict[str, str]

    def changed(self) -> _Request:
        """The same request with something in it changed, to provoke 422 (C7)."""
        if self.json is not _UNSET:
            value = self.json
            if isinstance(value, dict):
                return dataclasses.replace(self, json={**value, CHANGED_MARKER: True})
            return dataclasses.replace(self, json={CHANGED_MARKER: value})
        if isinstance(self.data, dict):
            return dataclasses.replace(self, data={**self.data, CHANGED_MARKER: "1"})
        if isinstance(self.data, (bytes, str)) and self.data:
            extra = b" " if isinstance(self.data, bytes) else " "
            return dataclasses.replace(self, data=self.data + extra)  # type: ignore[operator]
        separator = "&" if "?" in self.path else "?"
        return dataclasses.replace(self, path=f"{self.path}{separator}{CHANGED_MARKER}=1")


def _client_sender(client: Any, header: str) -> Callable[[_Request, str | None], Answer]:
    def send(request: _Request, key: str | None) -> Answer:
        headers = dict(request.headers)
        if key is not None:
            headers[header] = key
        kwargs: dict[str, Any] = {"headers": headers}
        if request.json is not _UNSET:
            kwargs["json"] = request.json
        elif request.data is not None:
            kwargs["data"] = request.data
        response = client.open(request.path, method=request.method, **kwargs)
        try:
            return Answer(response.status_code, dict(response.headers), response.get_data())
        finally:
            response.close()

    return send


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the redirect is the answer under test (Post/Redirect/Get)


def _url_sender(base: str, header: str) -> Callable[[_Request, str | None], Answer]:
    opener = urllib.request.build_opener(_NoRedirect)

    def send(request: _Request, key: str | None) -> Answer:
        headers = dict(request.headers)
        body: bytes | None = None
        if request.json is not _UNSET:
            body = jsonlib.dumps(request.json).encode("utf-8")
            headers.setdefault("Content-Type", "application/json")
        elif isinstance(request.data, dict):
            body = urllib.parse.urlencode(request.data, doseq=True).encode("ascii")
            headers.setdefault("Content-Type", "application/x-www-form-urlencoded")
        elif request.data is not None:
            body = request.data if isinstance(request.data, bytes) else request.data.encode()
        if key is not None:
            headers[header] = key
        req = urllib.request.Request(
            base.rstrip("/") + request.path, data=body, headers=headers, method=request.method
        )
        try:
            with opener.open(req, timeout=60) as response:
                return Answer(response.status, dict(response.headers.items()), response.read())
        except urllib.error.HTTPError as error:
            with error:
                return Answer(error.code, dict(error.headers.items()), error.read())

    return send


def _burst(
    send: Callable[[_Request, str | None], Answer],
    request: _Request,
    key: str,
    concurrency: int,
    timeout: float,
    threads: set[int],
) -> tuple[list[Answer], int]:
    """``concurrency`` identical requests released together; each retries its 409s."""
    barrier = threading.Barrier(concurrency)
    results: list[tuple[Answer, int] | BaseException] = [RuntimeError("no answer")] * concurrency

    def one(index: int) -> None:
        threads.add(threading.get_ident())
        try:
            barrier.wait(timeout)
            results[index] = _until_settled(send, request, key, timeout, threads)
        except BaseException as exc:  # reported below, in the test's thread
            results[index] = exc

    workers = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout * 2)
    answers: list[Answer] = []
    retried = 0
    for result in results:
        if isinstance(result, BaseException):
            raise AssertionError(f"a concurrent request failed: {result!r}") from result
        answers.append(result[0])
        retried += result[1]
    return answers, retried


def _until_settled(
    send: Callable[[_Request, str | None], Answer],
    request: _Request,
    key: str,
    timeout: float,
    threads: set[int],
) -> tuple[Answer, int]:
    """Send, and resend while the answer is 409 request-in-progress (what clients do)."""
    threads.add(threading.get_ident())
    deadline = time.monotonic() + timeout
    retried = 0
    while True:
        answer = send(request, key)
        if answer.status != 409 or time.monotonic() > deadline:
            return answer, retried
        retried += 1
        time.sleep(0.05)


def _call_in(threads: set[int], func: Callable[[], Answer]) -> Answer:
    threads.add(threading.get_ident())
    return func()


class _ExecutionCount:
    """Counts ``request_executed`` signals sent from the helper's own threads."""

    def __init__(self, app: Flask | None) -> None:
        self._app = app
        self.count = 0
        self.threads: set[int] = set()
        self._lock = threading.Lock()

    def _executed(self, sender: Any, **extra: Any) -> None:
        if threading.get_ident() in self.threads:
            with self._lock:
                self.count += 1

    @contextmanager
    def listening(self) -> Iterator[_ExecutionCount]:
        if self._app is None:
            yield self
            return
        signals.request_executed.connect(self._executed, self._app, weak=False)
        try:
            yield self
        finally:
            signals.request_executed.disconnect(self._executed, self._app)


# -- an isolated store per test --------------------------------------------------------


@contextmanager
def isolated_store(app: Flask) -> Iterator[DurableStore]:
    """Give ``app`` a fresh records table and cache namespace for the block; then drop it.

    Same database and Redis as configured, so the test still exercises them, but
    a key used by another test (or an earlier run) is never seen here.
    """
    state = app.extensions.get("idempotency")
    if state is None:
        raise RuntimeError("isolated_store(app): Flask-Idempotency is not registered on app.")
    if not state.settings.enabled:  # the layer is off: no table to make, none to drop
        yield state.store
        return
    salt = uuid.uuid4().hex[:12]
    old_store, old_cache = state.store, state.cache
    store = DurableStore(old_store._engine_factory, table_name=f"idem_test_{salt}")
    store.create_table()
    state.store = store
    state.cache = _SaltedCache(old_cache, salt)
    try:
        yield store
    finally:
        state.store, state.cache = old_store, old_cache
        store.table.drop(store.engine, checkfirst=True)
        store.identity_table.drop(store.engine, checkfirst=True)


class _SaltedCache:
    """The app's cache under names of this test's own (same protocol, same Redis).

    Wake-ups are not the cache's business: they travel under the real digest, and
    a stray one from another test is only a hint to re-read this test's table.
    """

    def __init__(self, inner: Any, salt: str) -> None:
        self._inner = inner
        self._salt = salt

    def _name(self, key_digest: str) -> str:
        return f"{self._salt}{key_digest}"

    def get(self, key_digest: str) -> Any:
        return self._inner.get(self._name(key_digest))

    def probe(self, key_digest: str) -> Any:
        return self._inner.probe(self._name(key_digest))

    def promote(self, key_digest: str, record: Any, ttl_ms: int) -> None:
        self._inner.promote(self._name(key_digest), record, ttl_ms)

    def discard(self, key_digest: str) -> None:
        self._inner.discard(self._name(key_digest))

    def record_name(self, key_digest: str) -> Any:
        return self._inner.record_name(self._name(key_digest))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def idempotency_store(request: pytest.FixtureRequest) -> Iterator[DurableStore]:
    """A records table (and cache namespace) of this test's own, on your ``app`` fixture."""
    try:
        app = request.getfixturevalue("app")
    except pytest.FixtureLookupError:
        raise pytest.UsageError(
            "The idempotency_store fixture needs an `app` fixture that returns your Flask app;"
            " or use flask_idempotency.testing.isolated_store(app) directly."
        ) from None
    with isolated_store(app) as store:
        yield store
