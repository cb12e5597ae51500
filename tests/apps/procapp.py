"""The app multi-process tests run under gunicorn.

Every execution of the protected view is recorded in PostgreSQL *before* it
sleeps, so a test can count executions across processes, and see which worker
runs a request it is about to kill. Configured by environment variables:

- ``DATABASE_URL``: PostgreSQL for both the records and the executions table
- ``IDEM_TABLE``: the records table; executions go to ``<IDEM_TABLE>_executions``
- ``IDEM_WAIT``, ``IDEM_LEASE``, ``IDEM_TTL``: extension settings
- ``REDIS_URL``: optional Redis tier
"""

from __future__ import annotations

import os
import time

from flask import Flask, jsonify, request
from sqlalchemy import Column, DateTime, Integer, MetaData, Table, Text, func, insert

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.store.connect import create_store_engine


def executions_table(metadata: MetaData, records_table: str) -> Table:
    return Table(
        f"{records_table}_executions",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("idem_key", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("started_at", DateTime(timezone=True), server_default=func.now()),
    )


def create_app() -> Flask:
    records_table = os.environ["IDEM_TABLE"]
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=records_table,
        IDEMPOTENCY_WAIT=float(os.environ.get("IDEM_WAIT", "5")),
        IDEMPOTENCY_LEASE=float(os.environ.get("IDEM_LEASE", "60")),
        IDEMPOTENCY_TTL=float(os.environ.get("IDEM_TTL", "86400")),
    )
    if os.environ.get("REDIS_URL"):
        app.config["IDEMPOTENCY_REDIS_URL"] = os.environ["REDIS_URL"]
    Idempotency(app)
    engine = create_store_engine(os.environ["DATABASE_URL"])
    executions = executions_table(MetaData(), records_table)

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/work/<name>")
    @idempotent
    def work(name: str):  # type: ignore[no-untyped-def]
        body = request.get_json(silent=True) or {}
        with engine.begin() as conn:
            execution_id = conn.execute(
                insert(executions)
                .values(idem_key=request.headers.get("Idempotency-Key", ""), pid=os.getpid())
                .returning(executions.c.id)
            ).scalar_one()
        # X-Sleep is outside the fingerprint: a retry can carry the same body and not sleep.
        time.sleep(float(request.headers.get("X-Sleep", body.get("sleep", 0))))
        return jsonify(name=name, pid=os.getpid(), execution=execution_id, body=body), 201

    return app
