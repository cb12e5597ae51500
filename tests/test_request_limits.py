"""What a protected request may make the layer do before its view runs (issue 26 items 9, 10).

C16, C31, C44: a body over ``IDEMPOTENCY_MAX_REQUEST_BYTES`` is refused with 413
before a byte of it is read (the layer reads the body before any authentication
decorator on the view); a 401 or 403 is never stored; a streamed response keeps its
lease renewed until its body has been read and stored.
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import pytest
from flask import Flask, Response, jsonify

from flask_idempotency import idempotent

from .test_lifecycle import KEY, REPLAYED, states


class CountingInput(io.BytesIO):
    """A request body that counts what was read of it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        chunk = super().read(size)
        self.read_bytes += len(chunk)
        return chunk

    def readline(self, size: int | None = -1) -> bytes:
        chunk = super().readline(size)
        self.read_bytes += len(chunk)
        return chunk


def protected(app: Flask, calls: list[int], status: int = 201) -> None:
    @app.post("/upload")
    @idempotent
    def upload():
        calls.append(1)
        return jsonify(n=len(calls)), status


def test_i26_10_c31_a_body_over_the_cap_is_413_before_a_byte_is_read(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_MAX_REQUEST_BYTES": 1024})
    assert app.config.get("MAX_CONTENT_LENGTH") is None  # Flask's default: no limit at all
    calls: list[int] = []
    protected(app, calls)
    body = CountingInput(b'{"a": "' + b"x" * 4096 + b'"}')
    response = app.test_client().post(
        "/upload",
        input_stream=body,
        headers={**KEY, "Content-Type": "application/json", "Content-Length": "4106"},
    )
    assert response.status_code == 413
    assert response.mimetype == "application/problem+json"
    assert response.get_json()["code"] == "request-too-large"
    assert "IDEMPOTENCY_MAX_REQUEST_BYTES" in response.get_json()["detail"]
    assert body.read_bytes == 0
    assert calls == [] and states(app) == []


def test_i26_10_c31_the_cap_defaults_to_ten_mib_and_zero_turns_it_off(make_app) -> None:
    app, _ = make_app()
    assert app.extensions["idempotency"].settings.max_request_bytes == 10 * 1024 * 1024
    app, _ = make_app({"IDEMPOTENCY_MAX_REQUEST_BYTES": 0})
    calls: list[int] = []
    protected(app, calls)
    big = {"a": "x" * 20_000}
    assert app.test_client().post("/upload", json=big, headers=KEY).status_code == 201


def test_i26_10_c31_a_body_within_the_cap_and_a_request_without_a_key_are_untouched(
    make_app,
) -> None:
    app, _ = make_app({"IDEMPOTENCY_MAX_REQUEST_BYTES": 1024})
    calls: list[int] = []
    protected(app, calls)
    client = app.test_client()
    assert client.post("/upload", json={"a": "x" * 100}, headers=KEY).status_code == 201
    assert client.post("/upload", json={"a": "x" * 4096}).status_code == 201  # no key: no layer


def test_i26_10_c31_a_body_without_content_length_is_refused_past_the_cap(make_app) -> None:
    """C31: a body without Content-Length is read up to the cap and one byte, then 413
    (on every supported Flask: the layer's own stream, not Flask 3.1's per-request limit,
    which cut the body silently where the form parser and get_data() read)."""
    app, _ = make_app({"IDEMPOTENCY_MAX_REQUEST_BYTES": 1024})
    calls: list[int] = []
    protected(app, calls)
    body = CountingInput(b"x" * 100_000)
    response = app.test_client().post(
        "/upload",
        input_stream=body,
        headers={**KEY, "Content-Type": "application/octet-stream", "Transfer-Encoding": "chunked"},
        environ_overrides={"wsgi.input_terminated": True},  # as gunicorn says of a chunked body
    )
    assert response.status_code == 413 and response.get_json()["code"] == "request-too-large"
    assert body.read_bytes == 1024 + 1  # the byte past the cap, not the rest
    assert calls == []


@pytest.mark.parametrize("status", [401, 403])
def test_i26_10_c16_an_answer_about_the_caller_is_released_not_stored(make_app, status) -> None:
    """A 401/403 answers who is asking, not what was done: the retry with credentials
    (same key, same body) runs the view; the refusal is never replayed (C16)."""
    app, _ = make_app()
    calls: list[int] = []

    @app.post("/orders")
    @idempotent
    def orders():
        calls.append(1)
        if len(calls) == 1:
            return jsonify(error="who are you?"), status
        return jsonify(created=True), 201

    client = app.test_client()
    assert client.post("/orders", json={"a": 1}, headers=KEY).status_code == status
    assert states(app) == []
    again = client.post("/orders", json={"a": 1}, headers=KEY)
    assert again.status_code == 201 and REPLAYED not in again.headers
    assert calls == [1, 1]


def test_i26_9_c44_a_slow_stream_keeps_its_lease_until_its_body_is_stored(make_app) -> None:
    """A 2.5 s stream with a 1 s lease: a duplicate arriving while the body is read gets
    409, never the key: the heartbeat renews until the body is stored (C44, C8)."""
    app, _ = make_app({"IDEMPOTENCY_LEASE": 1.0, "IDEMPOTENCY_WAIT": 0})
    calls: list[int] = []
    streaming = threading.Event()

    @app.post("/export")
    @idempotent
    def export():
        calls.append(1)

        def generate() -> Any:
            streaming.set()
            for _ in range(10):
                time.sleep(0.25)
                yield b"row\n"

        return Response(generate(), status=201, mimetype="text/csv")

    answers: dict[str, Any] = {}
    first = threading.Thread(
        target=lambda: answers.setdefault(
            "first", app.test_client().post("/export", json={"a": 1}, headers=KEY)
        )
    )
    first.start()
    assert streaming.wait(5)
    time.sleep(1.6)  # past the lease: only renewals keep it
    duplicate = app.test_client().post("/export", json={"a": 1}, headers=KEY)
    first.join(10)
    assert calls == [1], "the duplicate took the key over while the stream was read"
    assert duplicate.status_code == 409
    assert answers["first"].status_code == 201 and answers["first"].data == b"row\n" * 10
    replay = app.test_client().post("/export", json={"a": 1}, headers=KEY)
    assert replay.headers.get(REPLAYED) == "true" and replay.data == b"row\n" * 10
