"""Engines the extension built are released with their app (C47)."""

from __future__ import annotations

import gc

from flask import Flask

from flask_idempotency import Idempotency, idempotent


def test_c47_an_apps_own_engine_closes_its_connections_when_the_app_is_gone(tmp_path) -> None:
    """A short-lived app (a test, a CLI run) leaves no open database connection behind:
    Python 3.13 reports each one the garbage collector has to close as a ResourceWarning."""
    app = Flask("short_lived", instance_path=str(tmp_path / "instance"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/idem.sqlite3"
    app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    Idempotency(app)

    @app.post("/pay")
    @idempotent
    def pay() -> tuple[str, int]:
        return "paid", 201

    assert app.test_client().post("/pay", headers={"Idempotency-Key": "k1"}).status_code == 201
    engine = app.extensions["idempotency"].store.engine
    assert engine.pool.checkedin() >= 1  # the store's pooled connection is open

    del app, pay
    gc.collect()
    assert engine.pool.checkedin() == 0  # disposed with the app, not left to the collector
