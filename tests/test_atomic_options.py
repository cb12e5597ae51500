"""Options of transactional mode and the heartbeat are checked at start-up (C43, C44)."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.config import EffectiveOptions, RouteOptions, Settings


@pytest.mark.parametrize(
    ("given", "level"),
    [
        ("SERIALIZABLE", "SERIALIZABLE"),
        ("serializable", "SERIALIZABLE"),
        ("repeatable_read", "REPEATABLE READ"),
        ("Read Committed", "READ COMMITTED"),
    ],
)
def test_i12_2_c43_isolation_is_spelled_as_sql(given: str, level: str) -> None:
    assert RouteOptions(atomic=True, isolation=given).isolation == level


@pytest.mark.parametrize(
    "options",
    [
        {"atomic": True, "isolation": "SNAPSHOT"},
        {"atomic": True, "isolation": "SERIALIZABLE; DROP TABLE x"},
        {"atomic": True, "retries": -1},
        {"atomic": True, "retries": 1.5},
        {"atomic": True, "retries": True},
        {"atomic": False, "isolation": "SERIALIZABLE"},
        {"atomic": False, "retries": 3},
    ],
)
def test_i12_2_c43_bad_options_fail_when_the_route_is_marked(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        idempotent(**options)


def test_i12_2_c43_c63_isolation_without_atomic_is_reported_at_start_up(caplog) -> None:
    """Not atomic by the route nor by IDEMPOTENCY_ATOMIC: a clear error at init_app, in
    the log (C63: one route's options no longer stop the whole app), and the route
    answers a problem naming the fix."""
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URI"] = "sqlite://"

    @app.post("/x")
    @idempotent(isolation="SERIALIZABLE", retries=2)
    def x() -> str:
        return "ok"

    Idempotency(app)
    [error] = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "'x'" in error and "atomic=True" in error
    response = app.test_client().post("/x", headers={"Idempotency-Key": "k"})
    assert response.status_code == 500 and "atomic=True" in response.get_json()["detail"]


def test_i12_2_c43_route_options_reach_the_request() -> None:
    merged = EffectiveOptions.merge(
        Settings(atomic=True), RouteOptions(isolation="SERIALIZABLE", retries=3)
    )
    assert (merged.atomic, merged.isolation, merged.retries) == (True, "SERIALIZABLE", 3)
    plain = EffectiveOptions.merge(Settings(), RouteOptions())
    assert (plain.isolation, plain.retries) == (None, 0)


def test_i12_1_c44_heartbeat_settings() -> None:
    assert Settings.from_config({}).heartbeat is True
    assert Settings.from_config({}).max_runtime == 900.0
    settings = Settings.from_config(
        {"IDEMPOTENCY_HEARTBEAT": "false", "IDEMPOTENCY_MAX_RUNTIME": "120"}
    )
    assert (settings.heartbeat, settings.max_runtime) == (False, 120.0)
    for bad in ({"IDEMPOTENCY_HEARTBEAT": "maybe"}, {"IDEMPOTENCY_MAX_RUNTIME": 0}):
        with pytest.raises(ValueError):
            Settings.from_config(bad)
