"""Start-up tells what will break (issue 35 item 2; CONTRACT C63, C56).

- An ``IDEMPOTENCY_*`` name in ``app.config`` that is no setting (a typo), or a
  ``FLASK_IDEMPOTENCY_*`` variable in the environment that names none, is named in
  a WARNING at ``init_app`` with the closest setting.
- A route whose options clash with the app's (lease >= ttl) and a marked route
  none of whose methods a key applies to are reported before the first request is
  answered, once: at ``init_app`` for the views registered by then, at the first
  request for the rest, and by ``flask idempotency check``. They never turn
  another route's requests into 500s; the clashing route itself answers a
  problem+json 500 naming the setting.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from flask import Blueprint, Flask, jsonify
from flask.views import MethodView

from flask_idempotency import Idempotency, idempotent

KEY = {"Idempotency-Key": "key-1"}


def _app(tmp_path: Any, name: str = "start_up", **config: Any) -> Flask:
    app = Flask(name, instance_path=str(tmp_path / name))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/{name}.sqlite3"
    app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    app.config.update(config)
    app.testing = True
    return app


def _said(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and r.levelno == level
    ]


def _health(app: Flask) -> None:
    @app.get("/health")
    def health():
        return jsonify(ok=True)


def _bad_lease_payments(app_or_bp: Any) -> None:
    @app_or_bp.post("/pay")
    @idempotent(lease=100000)
    def pay():
        return jsonify(paid=True), 201


# -- typos -----------------------------------------------------------------------------------


def test_c63_a_misspelt_setting_is_named_with_the_closest_one(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    Idempotency(_app(tmp_path, IDEMPOTENCY_TLL=5, IDEMPOTENCY_REDIS="redis://x"))
    said = [m for m in _said(caplog) if "no Flask-Idempotency setting" in m]
    assert len(said) == 2, said
    [tll] = [m for m in said if "IDEMPOTENCY_TLL" in m]
    assert "did you mean IDEMPOTENCY_TTL?" in tll and "ignored" in tll
    [redis] = [m for m in said if "'IDEMPOTENCY_REDIS'" in m]
    assert "did you mean IDEMPOTENCY_REDIS_URL?" in redis


def test_c63_a_name_like_no_setting_is_still_named(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    Idempotency(_app(tmp_path, IDEMPOTENCY_ZZZZZZ=1, IDEMPOTENT_TTL=5))
    said = [m for m in _said(caplog) if "no Flask-Idempotency setting" in m]
    [unlike] = [m for m in said if "IDEMPOTENCY_ZZZZZZ" in m]
    assert "did you mean" not in unlike and "docs/configuration" in unlike
    [prefix] = [m for m in said if "IDEMPOTENT_TTL" in m]
    assert "did you mean IDEMPOTENCY_TTL?" in prefix


def test_c63_known_settings_and_other_names_say_nothing(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    Idempotency(_app(tmp_path, IDEMPOTENCY_TTL=120, IDEMPOTENCY_WAIT=1, SECRET_KEY="x"))
    assert [m for m in _said(caplog) if "setting" in m] == []


def test_c63_a_misspelt_variable_in_the_environment_is_named(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLASK_IDEMPOTENCY_TLL", "5")
    monkeypatch.setenv("IDEMPOTENCY_TEST_ANYTHING", "the test suite's own: never named")
    Idempotency(_app(tmp_path))
    [said] = [m for m in _said(caplog) if "TLL" in m]
    assert "FLASK_IDEMPOTENCY_TLL" in said and "did you mean FLASK_IDEMPOTENCY_TTL?" in said
    assert not any("IDEMPOTENCY_TEST_ANYTHING" in m for m in _said(caplog))


def test_c63_a_misspelt_variable_loaded_by_from_prefixed_env_is_named_once(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLASK_IDEMPOTENCY_TLL", "5")
    app = _app(tmp_path)
    app.config.from_prefixed_env()
    Idempotency(app)
    said = [m for m in _said(caplog) if "TLL" in m]
    assert len(said) == 1 and "did you mean IDEMPOTENCY_TTL?" in said[0], said


# -- a route whose options clash with the app's ------------------------------------------------


def test_c63_a_bad_lease_never_turns_another_routes_requests_into_500s(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's reproduction: routes registered after init_app (an app factory's
    blueprints), one with @idempotent(lease=100000) under the default ttl. The first
    request to /health was a 500, and so was every request after it."""
    app = _app(tmp_path)
    Idempotency(app)
    _health(app)
    _bad_lease_payments(app)
    client = app.test_client()
    for _ in range(2):
        response = client.get("/health")
        assert response.status_code == 200, response.get_data(as_text=True)
    [error] = _said(caplog, logging.ERROR)
    assert "'pay'" in error and "@idempotent(lease=...) = 100000 s" in error
    assert "IDEMPOTENCY_TTL = 86400 s (its default)" in error
    assert "500" in error and "other routes" in error


def test_c63_the_clashing_route_answers_a_problem_naming_the_setting(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(tmp_path)
    Idempotency(app)
    _bad_lease_payments(app)
    client = app.test_client()
    for headers in (KEY, {}):  # with a key or without: never run unprotected
        response = client.post("/pay", json={"amount": 1}, headers=headers)
        assert response.status_code == 500
        assert response.mimetype == "application/problem+json"
        problem = response.get_json()
        assert problem["code"] == "route-misconfigured" and problem["status"] == 500
        assert "@idempotent(lease=...)" in problem["detail"]
        assert "IDEMPOTENCY_TTL" in problem["detail"]
    assert len(_said(caplog, logging.ERROR)) == 1  # said once, not per request


def test_c63_a_clashing_route_registered_before_init_app_is_reported_there(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """init_app used to raise (a traceback at import, and `flask idempotency check`
    could not even load the app); it reports, and the rest of the app serves."""
    app = _app(tmp_path)
    _health(app)
    _bad_lease_payments(app)
    Idempotency(app)
    [error] = _said(caplog, logging.ERROR)  # before any request
    assert "'pay'" in error and "@idempotent(lease=...)" in error
    client = app.test_client()
    assert client.get("/health").status_code == 200
    assert client.post("/pay", json={}, headers=KEY).status_code == 500
    assert len(_said(caplog, logging.ERROR)) == 1


def test_c63_a_route_ttl_below_the_app_lease_names_both(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(tmp_path)

    @app.post("/quick")
    @idempotent(ttl=30)
    def quick():
        return "ok", 201

    Idempotency(app)
    [error] = _said(caplog, logging.ERROR)
    assert "'quick'" in error and "@idempotent(ttl=...) = 30 s" in error
    assert "IDEMPOTENCY_LEASE = 60 s (its default)" in error


def test_c63_a_blueprint_route_is_reported_at_the_first_request_before_its_answer(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(tmp_path)
    Idempotency(app)
    bp = Blueprint("shop", __name__)
    _bad_lease_payments(bp)
    app.register_blueprint(bp)
    _health(app)
    assert _said(caplog, logging.ERROR) == []
    seen_before_answer: list[int] = []

    @app.after_request
    def count(response):
        seen_before_answer.append(len(_said(caplog, logging.ERROR)))
        return response

    assert app.test_client().get("/health").status_code == 200
    assert seen_before_answer == [1]
    assert "'shop.pay'" in _said(caplog, logging.ERROR)[0]


def test_c63_a_class_based_view_with_a_clashing_handler(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    class Things(MethodView):
        def get(self):
            return jsonify(things=[])

        @idempotent(lease=100000)
        def post(self):
            return jsonify(ok=True), 201

    app = _app(tmp_path)
    Idempotency(app)
    app.add_url_rule("/things", view_func=Things.as_view("things"))
    client = app.test_client()
    assert client.get("/things").status_code == 200  # the unmarked method runs
    response = client.post("/things", json={}, headers=KEY)
    assert response.status_code == 500 and response.get_json()["code"] == "route-misconfigured"
    [error] = _said(caplog, logging.ERROR)
    assert "'things'" in error and "POST" in error


def test_c63_c56_a_get_only_route_is_named_at_init_app(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """It used to wait for the first request (issue 35, item 5)."""
    app = _app(tmp_path)

    @app.get("/report")
    @idempotent
    def report():
        return jsonify(ok=True)

    Idempotency(app)
    [warning] = [m for m in _said(caplog) if "@idempotent" in m]
    assert "'report'" in warning and "unprotected" in warning
    app.test_client().get("/report")
    assert len([m for m in _said(caplog) if "@idempotent" in m]) == 1  # once


def test_c63_a_disabled_app_says_nothing_of_its_routes(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """IDEMPOTENCY_ENABLED = False: marked views run plainly, nothing would answer 500."""
    app = _app(tmp_path, IDEMPOTENCY_ENABLED=False)
    _bad_lease_payments(app)
    Idempotency(app)
    assert _said(caplog, logging.ERROR) == []
    assert app.test_client().post("/pay", json={}, headers=KEY).status_code == 201


# -- flask idempotency check -----------------------------------------------------------------


def test_c63_check_lists_the_routes_that_will_break_and_fails(tmp_path) -> None:
    app = _app(tmp_path)
    Idempotency(app)
    _health(app)
    _bad_lease_payments(app)

    @app.get("/report")
    @idempotent
    def report():
        return jsonify(ok=True)

    runner = app.test_cli_runner()
    assert runner.invoke(args=["idempotency", "create-table"]).exit_code == 0
    result = runner.invoke(args=["idempotency", "check"])
    output = result.output
    assert result.exit_code == 1, output
    assert "error: @idempotent on 'pay'" in output and "@idempotent(lease=...)" in output
    assert "warning: @idempotent on endpoint 'report'" in output
    assert "1 route cannot be served" in output
    assert "OK: the table" in output  # the other checks still ran


def test_c63_check_with_sound_routes_passes(tmp_path) -> None:
    app = _app(tmp_path)
    _health(app)

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(ok=True), 201

    Idempotency(app)
    runner = app.test_cli_runner()
    assert runner.invoke(args=["idempotency", "create-table"]).exit_code == 0
    result = runner.invoke(args=["idempotency", "check"])
    assert result.exit_code == 0, result.output
    assert "OK: 1 route marked @idempotent, none misconfigured." in result.output


def test_c63_c40_an_atomic_route_without_db_is_reported_and_answers_a_problem(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """It was a RuntimeError at its first keyed request: an HTML 500 and a traceback."""
    app = _app(tmp_path)

    @app.post("/orders")
    @idempotent(atomic=True)
    def order():
        return jsonify(ok=True), 201

    Idempotency(app)  # no db=
    [error] = _said(caplog, logging.ERROR)
    assert "'order'" in error and "Idempotency(db=db)" in error
    response = app.test_client().post("/orders", json={}, headers=KEY)
    assert response.status_code == 500 and response.get_json()["code"] == "route-misconfigured"
    assert "Idempotency(db=db)" in response.get_json()["detail"]
