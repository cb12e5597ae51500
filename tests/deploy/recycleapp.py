"""The app of the recycled-workers cell (tests/deploy/test_recycled_workers.py).

Each execution of the protected view appends one line (key, pid) to ``EXEC_LOG``
before it sleeps ``VIEW_SECONDS`` (the cell's own keys only), so the test counts
executions across workers and their successors without the database (which is
down for part of the run).

Environment: ``DATABASE_URL``, ``IDEM_TABLE``, ``IDEM_LEASE``, ``EXEC_LOG``,
``SPOOL_DIR`` (``off``: no spool), ``VIEW_SECONDS``.
"""

from __future__ import annotations

import os
import time

from flask import Flask, jsonify, request

from flask_idempotency import Idempotency, idempotent


def create_app() -> Flask:
    app = Flask(__name__)
    spool = os.environ["SPOOL_DIR"]
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=os.environ["IDEM_TABLE"],
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_WAIT=0,
        IDEMPOTENCY_LEASE=float(os.environ["IDEM_LEASE"]),
        IDEMPOTENCY_SPOOL_DIR=False if spool == "off" else spool,
    )
    Idempotency(app)
    log_path = os.environ["EXEC_LOG"]
    pause = float(os.environ.get("VIEW_SECONDS", "1"))

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/work")
    @idempotent
    def work():  # type: ignore[no-untyped-def]
        key = request.headers.get("Idempotency-Key", "")
        line = f"{key} {os.getpid()}\n".encode()
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        if key.startswith("recycled-"):  # the cell's views; the other traffic is quick
            time.sleep(pause)
        return jsonify(key=key, pid=os.getpid(), at=time.time()), 201

    return app
