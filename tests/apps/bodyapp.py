"""A protected route behind Flask-WTF's CSRFProtect, for the body tests under gunicorn (C31).

Every answer says how many bytes of its request's body the app read
(``X-Body-Read``), counted by a WSGI middleware under everything else, and what the
view saw. Configured by environment variables: ``IDEM_DB`` (a SQLite file) and
``IDEM_CAP`` (``IDEMPOTENCY_MAX_REQUEST_BYTES``).
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Response, jsonify, request
from flask_wtf.csrf import CSRFProtect, generate_csrf

from flask_idempotency import Idempotency, idempotent

_COUNTER = "tests.body_read"


class _Counting:
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


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        SECRET_KEY="bodyapp",
        IDEMPOTENCY_DATABASE_URI=f"sqlite:///{os.environ['IDEM_DB']}",
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_MAX_REQUEST_BYTES=int(os.environ["IDEM_CAP"]),
    )
    Idempotency(app)
    CSRFProtect(app)
    wsgi = app.wsgi_app

    def counting(environ: dict[str, Any], start_response: Any) -> Any:
        environ["wsgi.input"] = environ[_COUNTER] = _Counting(environ["wsgi.input"])
        return wsgi(environ, start_response)

    app.wsgi_app = counting  # type: ignore[method-assign]

    @app.after_request
    def body_read(response: Response) -> Response:
        response.headers["X-Body-Read"] = str(request.environ[_COUNTER].read_bytes)
        return response

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.get("/token")
    def token() -> Any:
        return jsonify(token=generate_csrf())

    @app.post("/orders")
    @idempotent
    def orders() -> Any:
        files = {name: len(upload.read()) for name, upload in request.files.items()}
        return jsonify(amount=request.form.get("amount"), files=files), 201

    return app
