"""The gunicorn app the chaos suite attacks.

The store and the Redis tier go through fault-injecting proxies; the ledger the
tests count with goes to PostgreSQL *directly*, so cutting the store's network
never hides an execution. Two ledger tables, written by the worker itself:

- ``<IDEM_TABLE>_claims``: one row per claim the layer granted (the
  ``request_executed`` signal, sent before the view runs);
- ``<IDEM_TABLE>_runs``: one row per view execution, written before the view
  sleeps, with the worker pid (a test that SIGKILLs a pid can attribute the run)
  and, once the layer settles the request, how it ended (stored, released,
  store-error:complete, lease-lost).

Environment: ``DATABASE_URL`` (store, via proxy), ``LEDGER_URL`` (direct),
``IDEM_TABLE``, ``IDEM_WAIT``, ``IDEM_LEASE``, ``REDIS_URL`` (optional, via proxy),
``IDEM_REDIS_TIMEOUT``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flask import Flask, g, has_app_context, jsonify, request
from sqlalchemy import (
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    insert,
    update,
)

from flask_idempotency import Idempotency, idempotent, signals
from flask_idempotency.store.connect import create_store_engine


def ledger_tables(metadata: MetaData, records_table: str) -> tuple[Table, Table]:
    """``(claims, runs)`` for the records table ``records_table``."""
    claims = Table(
        f"{records_table}_claims",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("idem_key", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("how", Text, nullable=False),
    )
    runs = Table(
        f"{records_table}_runs",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("idem_key", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("claim_how", Text),  # NULL: the view ran without the layer granting a claim
        Column("outcome", Text),  # NULL: the worker never settled it (killed)
        Column("started_at", DateTime(timezone=True), server_default=func.now()),
    )
    return claims, runs


def create_app() -> Flask:
    records_table = os.environ["IDEM_TABLE"]
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=records_table,
        IDEMPOTENCY_WAIT=float(os.environ.get("IDEM_WAIT", "5")),
        IDEMPOTENCY_LEASE=float(os.environ.get("IDEM_LEASE", "60")),
        IDEMPOTENCY_REDIS_SOCKET_TIMEOUT=float(os.environ.get("IDEM_REDIS_TIMEOUT", "0.25")),
    )
    if os.environ.get("REDIS_URL"):
        app.config["IDEMPOTENCY_REDIS_URL"] = os.environ["REDIS_URL"]
    Idempotency(app)
    ledger = create_store_engine(os.environ["LEDGER_URL"], pool_size=3, max_overflow=12)
    claims, runs = ledger_tables(MetaData(), records_table)
    #: The latest run of each record (by key digest, as every signal names it), for the
    #: signals a settlement sends from the heartbeat's thread, where there is no ``g``.
    run_of_digest: dict[str, int] = {}
    _record_settlements(app, ledger, runs, run_of_digest)

    @signals.request_executed.connect_via(app)
    def claimed(sender: Any, **extra: Any) -> None:
        g.chaos_claim_how = extra["how"]
        g.chaos_key_digest = extra["key_digest"]
        with ledger.begin() as conn:
            conn.execute(
                insert(claims).values(idem_key=_raw_key(), pid=os.getpid(), how=extra["how"])
            )

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/work/<name>")
    @idempotent
    def work(name: str) -> Any:
        body = request.get_json(silent=True) or {}
        with ledger.begin() as conn:
            g.chaos_run_id = conn.execute(
                insert(runs)
                .values(idem_key=_raw_key(), pid=os.getpid(), claim_how=g.get("chaos_claim_how"))
                .returning(runs.c.id)
            ).scalar_one()
        run_of_digest[g.chaos_key_digest] = g.chaos_run_id
        # X-Sleep is not part of the fingerprint: a retry need not sleep again.
        time.sleep(float(request.headers.get("X-Sleep", body.get("sleep", 0))))
        return jsonify(name=name, pid=os.getpid(), run=g.chaos_run_id, body=body), 201

    return app


def _raw_key() -> str:
    return request.headers.get("Idempotency-Key", "")


def _record_settlements(
    app: Flask, ledger: Engine, runs: Table, run_of_digest: dict[str, int]
) -> None:
    """Write how each run ended into its ledger row, so a test can explain a second run.

    On the request's thread the run is the request's own (``g``); a settlement kept
    through an outage lands later on the heartbeat's thread, with no request's ``g``,
    and names its record's latest run by the key digest its signal carries.
    """

    def settle(outcome: str, extra: dict[str, Any]) -> None:
        run_id = g.get("chaos_run_id") if has_app_context() else None
        if run_id is None:
            run_id = run_of_digest.get(extra["key_digest"])
        if run_id is None:
            return
        with ledger.begin() as conn:
            conn.execute(update(runs).where(runs.c.id == run_id).values(outcome=outcome))

    @signals.response_stored.connect_via(app)
    def stored(sender: Any, **extra: Any) -> None:
        settle("stored", extra)

    @signals.claim_released.connect_via(app)
    def released(sender: Any, **extra: Any) -> None:
        settle(f"released:{extra['reason']}", extra)

    @signals.lease_lost.connect_via(app)
    def lost(sender: Any, **extra: Any) -> None:
        settle(f"lease-lost:{extra['action']}", extra)

    @signals.store_error.connect_via(app)
    def store_failed(sender: Any, **extra: Any) -> None:
        if extra.get("tier") == "database" and extra.get("action") in ("complete", "release"):
            settle(f"store-error:{extra['action']}", extra)
