"""No credential leaves through a repr, a log line or a signal (C61, issue 34 item 6).

An error reporter (Sentry and the like) captures the locals of every frame of a failing
request and shows them by their ``repr``: the settings and the app's state were among
them when a scope loader raised, and their reprs held the database's and Redis's
passwords. Here a real PostgreSQL URL and a real Redis URL carry passwords (the
PostgreSQL server trusts loopback, so it accepts any; the private Redis requires its
own), and the test looks for them, the scope secret and the store's own secret in:
every log line from the app's start to a request whose scope loader raises, every
signal sent, the repr of every local of that request's failing frames, and the repr
of every object of the package reachable from the extension (walked through their
attributes and containers; plain strings and containers are data, not reprs).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from flask import jsonify

from flask_idempotency import idempotent, signals

PG_PASSWORD = "pg-Pw-3f9c1e"
REDIS_PASSWORD = "rd-Pw-7a2e4b"
SCOPE_SECRET = "scope-Pw-5b8d0a"
ALL_SIGNALS = [
    value
    for name in dir(signals)
    if hasattr(value := getattr(signals, name), "connect") and hasattr(value, "receivers")
]


def _walk(roots: list[Any]) -> list[tuple[str, str]]:
    """``(path, repr)`` of every object of the package reachable from ``roots``, and of
    every other object (not a str, bytes or container) found among their attributes."""
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    stack = [(repr(type(root).__name__), root) for root in roots]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, bytearray, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend((f"{path}[{k!r}]", v) for k, v in list(obj.items()))
            stack.extend((f"{path}.key", k) for k in list(obj))
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((f"{path}[]", item) for item in list(obj))
            continue
        found.append((path, repr(obj)))
        if type(obj).__module__.startswith("flask_idempotency"):
            attributes = dict(getattr(obj, "__dict__", {}))
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    attributes[slot] = getattr(obj, slot)
            stack.extend((f"{path}.{name}", value) for name, value in attributes.items())
    return found


@pytest.mark.redis
@pytest.mark.parametrize("scope_secret", [None, SCOPE_SECRET], ids=["store-secret", "setting"])
def test_c61_no_password_or_secret_in_a_repr_a_log_line_or_a_signal(
    make_pg_app: Any,
    pg_driver_url: Any,
    redis_server: Any,
    caplog: pytest.LogCaptureFixture,
    scope_secret: str | None,
) -> None:
    assert redis_server.command(b"CONFIG", b"SET", b"requirepass", REDIS_PASSWORD.encode())
    caplog.set_level(logging.DEBUG)
    config = {
        "IDEMPOTENCY_DATABASE_URI": pg_driver_url.set(password=PG_PASSWORD).render_as_string(
            hide_password=False
        ),
        "IDEMPOTENCY_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_server.port}/0",
    }
    if scope_secret is not None:
        config["IDEMPOTENCY_SCOPE_SECRET"] = scope_secret
    app, ext = make_pg_app(config)
    sent: list[str] = []
    for signal in ALL_SIGNALS:
        signal.connect(lambda sender, **extra: sent.append(repr(extra)), app, weak=False)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(paid=True), 201

    headers = {"Idempotency-Key": "k-61", "Authorization": "Bearer t-61"}
    client = app.test_client()
    assert client.post("/pay", json={"a": 1}, headers=headers).status_code == 201
    replayed = client.post("/pay", json={"a": 1}, headers=headers)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    state = app.extensions["idempotency"]
    store_secret = state.store.identity().secret.decode()

    failing_locals: list[tuple[str, str]] = []

    def capture(sender: Any, exception: BaseException, **extra: Any) -> None:
        tb = exception.__traceback__
        while tb is not None:  # what an error reporter captures: each frame's locals
            frame = tb.tb_frame
            for name, value in frame.f_locals.items():
                failing_locals.append((f"{frame.f_code.co_name}:{name}", repr(value)))
            tb = tb.tb_next

    from flask import got_request_exception

    got_request_exception.connect(capture, app, weak=False)

    def loader() -> str:
        raise LookupError("the tenant service is down")

    ext.scope_loader(loader)
    app.testing = False  # Flask answers the exception with a 500 and logs it
    app.config["PROPAGATE_EXCEPTIONS"] = False
    assert client.post("/pay", json={"a": 2}, headers=headers).status_code == 500
    assert failing_locals, "the failing request's frames were captured"

    secrets = [PG_PASSWORD, REDIS_PASSWORD, store_secret] + ([scope_secret] if scope_secret else [])
    reprs = _walk([ext, state, state.settings, state.store, state.cache, state.wakeups])
    reprs += [("identity", repr(state.store.identity()))]
    assert any("***" in text for _, text in reprs)  # the URLs are there, masked
    places = {
        "log": [("log", caplog.text)],
        "signal": [("signal", text) for text in sent],
        "locals": failing_locals,
        "repr": reprs,
    }
    for where, texts in places.items():
        leaked = [(path, secret) for path, text in texts for secret in secrets if secret in text]
        assert not leaked, (where, leaked[:5])
    assert len(sent) >= 2  # executed, replayed, stored…: the signals were heard
