"""A small app for the per-process tests (tests/test_process.py) under gunicorn.

Environment: ``DATABASE_URL`` and ``IDEM_TABLE`` (the extension builds the engine
and creates the table itself), optional ``REDIS_URL``, ``WARMUP=1`` to send one
protected request in the master before gunicorn forks (``--preload``), and
``PSYCOGREEN=1`` to make psycopg2 cooperate with gevent.
"""

from __future__ import annotations

import os
import uuid

from flask import Flask, jsonify, request

from flask_idempotency import Idempotency, idempotent


def create_app() -> Flask:
    if os.environ.get("PSYCOGREEN"):
        from psycogreen.gevent import patch_psycopg

        patch_psycopg()
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=os.environ["IDEM_TABLE"],
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_WAIT=float(os.environ.get("IDEM_WAIT", "10")),
    )
    if os.environ.get("REDIS_URL"):
        app.config["IDEMPOTENCY_REDIS_URL"] = os.environ["REDIS_URL"]
    Idempotency(app)

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/echo/<name>")
    @idempotent
    def echo(name: str):  # type: ignore[no-untyped-def]
        return (
            jsonify(
                name=name,
                key=request.headers.get("Idempotency-Key"),
                body=request.get_json(silent=True),
                pid=os.getpid(),
            ),
            201,
        )

    if os.environ.get("WARMUP"):
        # A health check or smoke test in the master: the store's pool now holds sockets.
        answer = app.test_client().post(
            "/echo/warm", json={"warm": True}, headers={"Idempotency-Key": uuid.uuid4().hex}
        )
        assert answer.status_code == 201, answer.get_data(as_text=True)
    return app
