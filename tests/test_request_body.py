"""A protected request's body, over real HTTP: read once, never past the cap, never cut (C31).

Issue 34 items 1–3, each reproduced against a real server (Werkzeug's, in a thread; one
test on gunicorn) with a hand-written HTTP/1.1 client that sends chunked bodies
(``Transfer-Encoding: chunked``, no ``Content-Length``), since the test client never
does what a server does with them. A WSGI middleware counts the bytes the app read of
each body: the measure of "read before 413".

Before the fix: a key in the form field skipped the cap (an 8 MiB upload read in full
before 413 or the view); a chunked form or JSON body over the cap reached the view cut
at the cap (``amount=100000`` arrived as ``amount=10``, and was stored); a
``before_request`` hook that read the form (Flask-WTF's ``CSRFProtect``) read the whole
chunked body before the layer could cap it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask import Flask, jsonify, request
from werkzeug.serving import make_server

from flask_idempotency import idempotent

from .test_lifecycle import states

CAP = 64 * 1024
KEY = "key-34"
BOUNDARY = "b0undary34"


class CountingInput:
    """``wsgi.input`` as the server made it, counting what the app read of it."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self.read_bytes += len(data)
        return bytes(data)

    def readline(self, size: int = -1) -> bytes:
        data = self._stream.readline(size)
        self.read_bytes += len(data)
        return bytes(data)


class Served:
    """An app behind a real HTTP server on a free loopback port, in this process."""

    def __init__(self, app: Flask) -> None:
        self.app = app
        self.inputs: list[CountingInput] = []
        wsgi = app.wsgi_app

        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            counted = CountingInput(environ["wsgi.input"])
            environ["wsgi.input"] = counted
            self.inputs.append(counted)
            return wsgi(environ, start_response)

        self.server = make_server("127.0.0.1", 0, counting, threaded=True)
        self.port = self.server.server_port
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    @property
    def last_read(self) -> int:
        return self.inputs[-1].read_bytes

    def post(
        self,
        path: str,
        body: bytes,
        content_type: str,
        *,
        chunked: bool = True,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        return post(self.port, path, body, content_type, chunked=chunked, headers=headers)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def post(
    port: int,
    path: str,
    body: bytes,
    content_type: str,
    *,
    chunked: bool = True,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` over a fresh connection; chunked (16 KiB chunks) unless told not to.

    The body is sent from a thread while the answer is read, as a real client's would be:
    a server that answers 413 early may stop reading, and the rest of the body is then
    refused by the socket, which is the point.
    """
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Type: {content_type}"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}")
    lines.extend(f"{name}: {value}" for name, value in (headers or {}).items())
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send() -> None:
        try:
            sock.sendall(head)
            if not chunked:
                sock.sendall(body)
                return
            for start in range(0, len(body), 16384):
                chunk = body[start : start + 16384]
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed: the rest was never read
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        response = http.client.HTTPResponse(sock)
        response.begin()
        data = response.read()
        answer = (response.status, dict(response.getheaders()), data)
        response.close()
    finally:
        try:  # wakes a send blocked on a server that stopped reading (close alone does not)
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        sender.join(30)
    return answer


@pytest.fixture
def serve() -> Iterator[Callable[[Flask], Served]]:
    servers: list[Served] = []

    def start(app: Flask) -> Served:
        servers.append(Served(app))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def orders_app(make_app: Any, hook: str | None = None, **config: Any) -> tuple[Flask, list[Any]]:
    """``POST /orders`` (protected) answering what its view saw of the body, and counting
    its runs. ``hook``: a ``before_request`` hook that reads the form first (``"form"``: a
    locale switch reading ``request.values``; ``"csrf"``: Flask-WTF's ``CSRFProtect``)."""
    settings = {"IDEMPOTENCY_MAX_REQUEST_BYTES": CAP, "SECRET_KEY": "s3", **config}
    app, _ = make_app(settings)
    seen: list[Any] = []
    if hook == "form":

        @app.before_request
        def locale() -> None:
            request.values.get("lang")

    elif hook == "csrf":
        from flask_wtf.csrf import CSRFProtect, generate_csrf

        CSRFProtect(app)

        @app.get("/token")
        def token() -> Any:
            return jsonify(token=generate_csrf())

    @app.post("/orders")
    @idempotent
    def orders() -> Any:
        if request.mimetype == "application/json":
            body = request.get_json()
            seen.append(body)
            return jsonify(items=len(body["items"]), amount=body["amount"]), 201
        if request.mimetype == "application/octet-stream":
            data = request.get_data()
            seen.append(len(data))
            return jsonify(amount=data.rsplit(b"=", 1)[1].decode(), size=len(data)), 201
        amount = request.form.get("amount")
        files = {name: len(upload.read()) for name, upload in request.files.items()}
        seen.append(amount)
        return jsonify(amount=amount, memo=len(request.form.get("memo", "")), files=files), 201

    return app, seen


def urlencoded_at_the_cap(amount: str = "100000") -> bytes:
    """``memo=<padding>&amount=100000`` whose first ``CAP`` bytes end in ``amount=10``."""
    tail = f"&amount={amount}".encode()
    padding = CAP - len(b"memo=") - len(b"&amount=10")
    body = b"memo=" + b"x" * padding + tail
    assert body[:CAP].endswith(b"&amount=10") and len(body) > CAP
    return body


def multipart(fields: dict[str, str], upload: int) -> bytes:
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    parts.append(
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="upload"; filename="a.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + b"u" * upload
        + b"\r\n"
    )
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


FORM = "application/x-www-form-urlencoded"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


@pytest.mark.parametrize("hook", [None, "form"])
@pytest.mark.parametrize("key_in", ["header", "form"])
def test_c31_a_chunked_form_over_the_cap_is_413_never_a_cut_body(
    make_app: Any, serve: Any, hook: str | None, key_in: str
) -> None:
    """C31, issue 34 item 2: ``memo=<padding>&amount=100000`` chunked, its first 64 KiB
    ending in ``amount=10``. It used to reach the view as ``amount=10`` (201, stored);
    now 413 ``request-too-large`` having read at most the cap and one byte, the view
    never run, whether the key is a header or a form field, with or without a hook
    that read ``request.values`` first."""
    app, seen = orders_app(make_app, hook)
    server = serve(app)
    body = urlencoded_at_the_cap()
    headers = {"Idempotency-Key": KEY} if key_in == "header" else {}
    if key_in == "form":
        body = b"_idempotency_key=" + KEY.encode() + b"&" + body
    status, response_headers, data = server.post("/orders", body, FORM, headers=headers)
    assert (status, seen) == (413, []), data
    assert response_headers["Content-Type"] == "application/problem+json"
    assert json.loads(data)["code"] == "request-too-large"
    assert server.last_read <= CAP + 1


@pytest.mark.parametrize("kind", ["json", "raw"])
def test_c31_a_chunked_json_body_over_the_cap_is_413_never_a_cut_body(
    make_app: Any, serve: Any, kind: str
) -> None:
    """C31, issue 34 item 2: a 131 KB JSON body, chunked, used to be fingerprinted (and
    parsed by the view) as its first 65,536 bytes; two bodies that differ only after the
    cap shared one fingerprint. Now 413, at most the cap and one byte read."""
    app, seen = orders_app(make_app)
    server = serve(app)
    body = json.dumps({"items": ["x" * 100] * 1300, "amount": 100000}).encode()
    assert len(body) > 2 * CAP
    media = "application/json" if kind == "json" else "application/octet-stream"
    status, _, data = server.post("/orders", body, media, headers={"Idempotency-Key": KEY})
    assert (status, seen) == (413, []), data
    assert json.loads(data)["code"] == "request-too-large"
    assert server.last_read <= CAP + 1


@pytest.mark.parametrize("hook", [None, "form", "csrf"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_c31_an_8_mib_upload_with_a_form_key_is_refused_before_it_is_read(
    make_app: Any, serve: Any, hook: str | None, chunked: bool
) -> None:
    """C31, issue 34 items 1 and 3: an 8 MiB multipart upload whose key is a form field
    (C49), cap 64 KiB. It used to be read in full (8,388,881 bytes) and its upload
    spooled and hashed before the view answered; with a ``before_request`` hook that
    read the form (a locale switch, Flask-WTF's ``CSRFProtect``) the chunked body was
    read in full before the layer could cap it. Now: with a Content-Length, 413 having
    read nothing; chunked, 413 having read at most the cap and one byte."""
    app, seen = orders_app(make_app, hook)
    server = serve(app)
    body = multipart({"_idempotency_key": KEY, "amount": "5"}, 8 * 1024 * 1024)
    status, _, data = server.post("/orders", body, MULTIPART, chunked=chunked)
    read = server.last_read
    print(f"hook={hook} chunked={chunked}: {read} bytes read of {len(body)} before {status}")
    assert (status, seen) == (413, []), data
    assert json.loads(data)["code"] == "request-too-large"
    assert read <= (CAP + 1 if chunked else 0)


def test_c31_a_form_without_a_key_is_read_through_the_cap_too(make_app: Any, serve: Any) -> None:
    """C31, issue 34 item 1: on a protected route the layer parses a form to look for its
    key field (C49), so a form with no key at all is read through the cap as well: it
    used to be parsed whole, uploads spooled, before the view ran."""
    app, seen = orders_app(make_app)
    server = serve(app)
    body = multipart({"amount": "5"}, 8 * 1024 * 1024)
    status, _, _ = server.post("/orders", body, MULTIPART)
    assert (status, seen) == (413, [])
    assert server.last_read <= CAP + 1


@pytest.mark.parametrize("hook", [None, "form", "csrf"])
@pytest.mark.parametrize("kind", ["urlencoded", "multipart", "json", "raw"])
def test_c31_a_chunked_body_within_the_cap_reaches_the_view_whole(
    make_app: Any, serve: Any, hook: str | None, kind: str
) -> None:
    """C31: a chunked body under the cap is read once, and the view gets all of it (its
    form, files or JSON); the retry is replayed, and the same key with another amount,
    differing only near the end of the body, is 422."""
    app, seen = orders_app(make_app, hook)
    server = serve(app)
    headers = {"Idempotency-Key": KEY}
    if hook == "csrf":
        _, token_headers, data = post_get(server.port, "/token")
        headers["Cookie"] = token_headers["Set-Cookie"].split(";", 1)[0]
        headers["X-CSRFToken"] = json.loads(data)["token"]

    def body(amount: str) -> tuple[bytes, str]:
        if kind == "urlencoded":
            return b"memo=" + b"x" * 50_000 + f"&amount={amount}".encode(), FORM
        if kind == "multipart":
            return multipart({"memo": "x" * 1000, "amount": amount}, 40_000), MULTIPART
        if kind == "raw":
            return b"x" * 60_000 + f"amount={amount}".encode(), "application/octet-stream"
        document = {"items": ["x" * 100] * 400, "amount": int(amount)}
        return json.dumps(document).encode(), "application/json"

    first = server.post("/orders", *body("100000"), headers=headers)
    assert first[0] == 201, first
    answer = json.loads(first[2])
    assert str(answer["amount"]) == "100000"
    if kind == "multipart":
        assert answer["files"] == {"upload": 40_000}
    again = server.post("/orders", *body("100000"), headers=headers)
    assert again[0] == 201 and again[1].get("Idempotent-Replayed") == "true"
    other = server.post("/orders", *body("100001"), headers=headers)
    assert other[0] == 422
    assert len(seen) == 1


def post_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.mark.slow
def test_c31_under_gunicorn_an_upload_with_a_form_key_is_refused_before_it_is_read(
    tmp_path: Any,
) -> None:
    """C31, issue 34 items 1 and 3, on gunicorn (which marks every body
    ``wsgi.input_terminated``, Content-Length or not) behind Flask-WTF's ``CSRFProtect``,
    whose hook reads the form before the layer: the 8 MiB upload with its key in a form
    field gets 413 having read nothing (Content-Length) or at most the cap and one byte
    (chunked), and a small one goes through."""
    from tests.support.gunicorn import GunicornServer

    server = GunicornServer(
        "tests.apps.bodyapp:create_app()",
        env={"IDEM_DB": str(tmp_path / "idem.sqlite3"), "IDEM_CAP": str(CAP)},
        workers=1,
        threads=4,
    ).start()
    try:
        body = multipart({"_idempotency_key": KEY, "amount": "5"}, 8 * 1024 * 1024)
        for chunked, most in ((True, CAP + 1), (False, 0)):
            status, headers, data = post(server.port, "/orders", body, MULTIPART, chunked=chunked)
            print(f"gunicorn chunked={chunked}: {headers.get('X-Body-Read')} bytes read")
            assert status == 413 and json.loads(data)["code"] == "request-too-large", data
            assert int(headers["X-Body-Read"]) <= most
        _, token_headers, token = post_get(server.port, "/token")
        form = {"_idempotency_key": KEY, "csrf_token": json.loads(token)["token"], "amount": "5"}
        cookie = {"Cookie": token_headers["Set-Cookie"].split(";", 1)[0]}
        small = multipart(form, 1000)
        for replayed in ("", "true"):
            status, headers, data = post(server.port, "/orders", small, MULTIPART, headers=cookie)
            assert status == 201 and json.loads(data) == {"amount": "5", "files": {"upload": 1000}}
            assert headers.get("Idempotent-Replayed", "") == replayed
    finally:
        server.stop()


def post_cut_short(port: int, path: str, declared: int, sent: bytes) -> tuple[int, bytes]:
    """POST with ``Content-Length: declared`` and only ``sent`` of it, then end the
    sending side: a client gone half-way through its body."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {KEY}\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    try:
        sock.sendall(head + sent)
        sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()
    finally:
        sock.close()


def test_c31_a_content_length_body_that_ends_early_is_400_never_stored(
    make_app: Any, serve: Any
) -> None:
    """A JSON body read straight from the server's stream (issue 36: a ``Content-Length``
    body is read without Werkzeug's stream layers): one that ends before its
    ``Content-Length`` is the client gone, 400 as Werkzeug answers it, never fingerprinted
    as the part that came nor run; the whole body then runs once and replays."""
    app, seen = orders_app(make_app)
    server = serve(app)
    body = json.dumps({"items": ["x"] * 3, "amount": 5}).encode()
    status, _ = post_cut_short(server.port, "/orders", len(body), body[:-9])
    assert status == 400 and seen == []
    assert states(app) == []
    headers = {"Idempotency-Key": KEY}
    first = server.post("/orders", body, "application/json", chunked=False, headers=headers)
    again = server.post("/orders", body, "application/json", chunked=False, headers=headers)
    assert (first[0], again[0], again[1].get("Idempotent-Replayed")) == (201, 201, "true")
    assert seen == [{"items": ["x"] * 3, "amount": 5}]


def test_c31_the_apps_max_content_length_still_refuses_a_longer_body_unread(
    make_app: Any, serve: Any
) -> None:
    """``MAX_CONTENT_LENGTH`` below the layer's cap: a ``Content-Length`` over it is 413
    before a byte is read, as Werkzeug's stream refuses it, also where the layer reads
    the body itself."""
    app, seen = orders_app(make_app, MAX_CONTENT_LENGTH=100)
    server = serve(app)
    body = json.dumps({"items": ["x" * 50] * 3, "amount": 5}).encode()
    status, _, data = server.post(
        "/orders", body, "application/json", chunked=False, headers={"Idempotency-Key": KEY}
    )
    assert (status, seen, server.last_read) == (413, [], 0), data
    assert json.loads(data)["code"] == "request-too-large"


def test_c31_a_view_that_reads_the_stream_after_the_layer_finds_it_spent(
    make_app: Any, serve: Any
) -> None:
    """After the layer read a ``Content-Length`` body, ``request.stream`` is spent, as after
    Flask's own ``get_data()``: the view reads ``b""`` at once (it never waits on the
    socket for bytes the client will not send), and ``get_data()`` has the body."""
    app, _ = make_app({"SECRET_KEY": "s3"})

    @app.post("/raw")
    @idempotent
    def raw() -> Any:
        return jsonify(stream=request.stream.read().decode(), data=request.get_data().decode())

    server = serve(app)
    status, _, data = server.post(
        "/raw", b'{"a": 1}', "application/json", chunked=False, headers={"Idempotency-Key": KEY}
    )
    assert status == 200 and json.loads(data) == {"stream": "", "data": '{"a": 1}'}
