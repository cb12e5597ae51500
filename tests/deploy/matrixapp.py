"""The small app each deployment-matrix cell runs under real gunicorn.

``tests/deploy/wsgi.py`` builds it at import, as a production wsgi module does. Each
execution of the protected view is recorded in ``<IDEM_TABLE>_executions``
(created by the test) before the view sleeps, so the test counts executions
across workers and hosts; the body carries ``finished_at`` (wall clock), so a
replay tells the client when the original finished (wake-up latency).

Environment: ``DATABASE_URL``, ``IDEM_TABLE``, ``IDEM_WAIT``, optional
``REDIS_URL``; ``DEPLOY_WARMUP=1`` sends a request (and its replay) through the
extension at import, i.e. in gunicorn's master under ``--preload``. The records
table is created by the extension itself (``IDEMPOTENCY_CREATE_TABLE``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid

from flask import Flask, jsonify, request
from sqlalchemy import Column, Integer, MetaData, Table, Text, insert
from sqlalchemy.engine import Engine

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.store.connect import create_store_engine


def executions_table(metadata: MetaData, records_table: str) -> Table:
    return Table(
        f"{records_table}_executions",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("idem_key", Text, nullable=False),
        Column("pid", Integer, nullable=False),
    )


_engines: dict[int, Engine] = {}
_engines_lock = threading.Lock()


def _engine() -> Engine:
    """The app's own engine, one per process (never shared across a fork)."""
    pid = os.getpid()
    with _engines_lock:
        if pid not in _engines:
            _engines[pid] = create_store_engine(
                os.environ["DATABASE_URL"], pool_size=2, max_overflow=20
            )
        return _engines[pid]


def create_app() -> Flask:
    records_table = os.environ["IDEM_TABLE"]
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=records_table,
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_WAIT=float(os.environ.get("IDEM_WAIT", "5")),
        IDEMPOTENCY_LEASE=float(os.environ.get("IDEM_LEASE", "30")),
    )
    if os.environ.get("REDIS_URL"):
        app.config["IDEMPOTENCY_REDIS_URL"] = os.environ["REDIS_URL"]
    Idempotency(app)
    executions = executions_table(MetaData(), records_table)

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/work/<name>")
    @idempotent
    def work(name: str):  # type: ignore[no-untyped-def]
        with _engine().begin() as conn:
            execution_id = conn.execute(
                insert(executions)
                .values(idem_key=request.headers.get("Idempotency-Key", ""), pid=os.getpid())
                .returning(executions.c.id)
            ).scalar_one()
        # X-Sleep is outside the fingerprint: a retry carries the same body and need not sleep.
        time.sleep(float(request.headers.get("X-Sleep", "0")))
        return jsonify(
            name=name, pid=os.getpid(), execution=execution_id, finished_at=time.time()
        ), 201

    return app


def warm_up(app: Flask) -> None:
    """One request and its replay through the extension, in this (the master) process."""
    key = f"warmup-{uuid.uuid4().hex}"
    with app.test_client() as client:
        for _ in range(2):
            response = client.post("/work/warmup", json={}, headers={"Idempotency-Key": key})
            if response.status_code != 201:
                raise RuntimeError(f"warm-up answered {response.status_code}: {response.data!r}")
