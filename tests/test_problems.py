"""One error handler on ``IdempotencyProblem`` sees every problem (issue 9 item 11; C27).

Flask files a handler for an ``HTTPException`` class under the class's ``code``
and looks a raised exception up under its own code, then under "no code". A base
class with ``code = 400`` therefore caught only the two 400 problems; the 409,
422 and 503 went past it. Each of the five is produced here the way a client
meets it, against the real layer.
"""

from __future__ import annotations

import threading

import pytest
from flask import Blueprint, Flask, jsonify
from werkzeug.exceptions import BadRequest, Conflict, HTTPException

from flask_idempotency import Idempotency, IdempotencyProblem, idempotent
from flask_idempotency.problems import (
    InvalidKeyProblem,
    KeyReused,
    MissingKey,
    RequestInProgress,
    StoreUnavailable,
)
from tests.support.gunicorn import free_port

PARK_LIMIT = 20.0


def _protected_app(app: Flask, handled: list[str]) -> threading.Event:
    entered, release = threading.Event(), threading.Event()

    @app.errorhandler(IdempotencyProblem)
    def by_base(exc: IdempotencyProblem):
        handled.append(exc.problem()["code"])
        return jsonify(handled=exc.problem()["code"], status=exc.code), exc.code

    @app.post("/pay")
    @idempotent(required=True, wait=0)
    def pay():
        entered.set()
        assert release.wait(PARK_LIMIT)
        return jsonify(ok=True), 201

    app.config["_entered"] = entered
    return release


def test_i9_11_c27_a_handler_on_the_base_class_catches_all_five(make_app) -> None:
    """C27: missing-key, invalid-key, request-in-progress, key-reused: one handler."""
    app, _ = make_app({"TESTING": False})
    handled: list[str] = []
    release = _protected_app(app, handled)
    client = app.test_client()

    assert client.post("/pay").json == {"handled": "missing-key", "status": 400}
    bad = client.post("/pay", headers={"Idempotency-Key": '"abc'})
    assert bad.json == {"handled": "invalid-key", "status": 400}

    result: dict[str, int] = {}
    original = threading.Thread(
        target=lambda: result.update(
            status=app.test_client()
            .post("/pay", json={"a": 1}, headers={"Idempotency-Key": "k"})
            .status_code
        ),
        daemon=True,
    )
    original.start()
    assert app.config["_entered"].wait(PARK_LIMIT)
    busy = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "k"})
    assert busy.status_code == 409
    assert busy.json == {"handled": "request-in-progress", "status": 409}
    release.set()
    original.join(PARK_LIMIT)
    assert result == {"status": 201}

    reused = client.post("/pay", json={"a": 2}, headers={"Idempotency-Key": "k"})
    assert reused.status_code == 422
    assert reused.json == {"handled": "key-reused", "status": 422}
    assert handled == ["missing-key", "invalid-key", "request-in-progress", "key-reused"]


def test_i9_11_c25_c27_the_base_class_handler_catches_store_unavailable() -> None:
    """C25/C27: the 503 of an unreachable database reaches the base-class handler too."""
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URI"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    )
    Idempotency(app)
    handled: list[str] = []
    _protected_app(app, handled)
    response = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "k"})
    assert response.status_code == 503
    assert response.json == {"handled": "store-unavailable", "status": 503}
    assert handled == ["store-unavailable"]


def test_i9_11_c27_blueprint_handler_on_the_base_class(make_app) -> None:
    """C27: the same holds for a blueprint's own handler."""
    app, _ = make_app({"TESTING": False, "IDEMPOTENCY_WAIT": 0})
    bp = Blueprint("bp", __name__)

    @bp.errorhandler(IdempotencyProblem)
    def by_base(exc: IdempotencyProblem):
        return jsonify(bp=exc.problem()["code"]), exc.code

    @bp.post("/charge")
    @idempotent
    def charge():
        return jsonify(ok=True), 201

    app.register_blueprint(bp)
    client = app.test_client()
    assert (
        client.post("/charge", json={"a": 1}, headers={"Idempotency-Key": "k"}).status_code == 201
    )
    reused = client.post("/charge", json={"a": 2}, headers={"Idempotency-Key": "k"})
    assert reused.status_code == 422 and reused.json == {"bp": "key-reused"}


def test_i9_11_c27_code_handlers_still_win_and_werkzeug_classes_still_match(make_app) -> None:
    """C27: ``errorhandler(409)`` and ``errorhandler(Conflict)`` keep working beside the base."""
    app, _ = make_app({"TESTING": False})
    handled: list[str] = []
    release = _protected_app(app, handled)

    @app.errorhandler(400)
    def by_code(exc: HTTPException):
        return jsonify(by="code"), 400

    client = app.test_client()
    assert client.post("/pay").json == {"by": "code"}
    release.set()
    assert handled == []


@pytest.mark.parametrize(
    ("cls", "status", "werkzeug"),
    [
        (MissingKey, 400, BadRequest),
        (InvalidKeyProblem, 400, BadRequest),
        (RequestInProgress, 409, Conflict),
        (KeyReused, 422, HTTPException),
        (StoreUnavailable, 503, HTTPException),
    ],
)
def test_i9_11_c27_every_problem_keeps_its_status_and_werkzeug_base(
    cls: type[IdempotencyProblem], status: int, werkzeug: type[HTTPException]
) -> None:
    """C27: each concrete problem has its status; the base is filed under no single code."""
    problem = cls("why")
    assert problem.code == status
    assert isinstance(problem, werkzeug) and isinstance(problem, IdempotencyProblem)
    assert problem.get_response().status_code == status
    assert IdempotencyProblem.code is None


def test_i9_11_c27_the_base_class_is_never_raised_itself() -> None:
    """C27: every problem the layer sends has a status; the code-less base cannot be sent."""
    with pytest.raises(TypeError, match="concrete"):
        IdempotencyProblem("why")
