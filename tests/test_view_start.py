"""Only an outcome of the view itself is stored (R48, C18).

The layer is a wrapper put in place of each marked view, so it decides after
every ``before_request`` hook (the app's, whenever registered, and the
blueprint's); a hook that rejects the request never claims the key, whatever way
the view was registered.
"""

from __future__ import annotations

import json

import pytest
from flask import Blueprint, abort, g, request
from flask.views import MethodView

from flask_idempotency import idempotent
from flask_idempotency.completion import heartbeat

KEY = {"Idempotency-Key": "view-start"}


def test_r48_blueprint_hook_rejection_releases_the_key(make_app) -> None:
    app, _ = make_app()
    bp = Blueprint("payments", __name__)
    calls: list[str] = []

    @bp.before_request
    def require_token():  # a blueprint hook: runs before the layer decides
        if request.headers.get("X-Token") != "ok":
            abort(401)

    @bp.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return {"paid": True}, 201

    app.register_blueprint(bp)
    client = app.test_client()
    assert client.post("/pay", json={}, headers=KEY).status_code == 401
    ok = client.post("/pay", json={}, headers={**KEY, "X-Token": "ok"})
    assert ok.status_code == 201 and "Idempotent-Replayed" not in ok.headers
    replay = client.post("/pay", json={}, headers={**KEY, "X-Token": "ok"})
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert calls == ["pay"]


def test_r48_decorator_above_the_route_still_tracks_the_view(make_app) -> None:
    """``@idempotent`` applied after registration marks the registered function itself."""
    app, _ = make_app()
    calls: list[str] = []

    @idempotent
    @app.post("/pay")
    def pay():
        calls.append("pay")
        return "paid", 201

    client = app.test_client()
    first = client.post("/pay", headers=KEY)
    again = client.post("/pay", headers=KEY)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert calls == ["pay"]


def test_r48_class_based_view_is_tracked(make_app) -> None:
    app, _ = make_app()
    calls: list[str] = []

    class Payments(MethodView):
        decorators = (idempotent(required=True),)

        def post(self):
            calls.append("post")
            return {"id": len(calls)}, 201

    app.add_url_rule("/payments", view_func=Payments.as_view("payments"))
    client = app.test_client()
    assert client.post("/payments", json={"a": 1}).status_code == 400  # C4 missing key
    first = client.post("/payments", json={"a": 1}, headers=KEY)
    again = client.post("/payments", json={"a": 1}, headers=KEY)
    assert first.get_json() == again.get_json() == {"id": 1}
    assert again.headers["Idempotent-Replayed"] == "true"
    assert calls == ["post"]


def test_c30_current_key_digest_names_the_owned_record_only(make_app) -> None:
    """The digest is the record's name: the same on a retry, None without a claim."""
    from flask_idempotency import current_key_digest
    from flask_idempotency.fingerprint import key_digest

    app, _ = make_app()
    seen: list[str | None] = []

    @app.post("/charge")
    @idempotent
    def charge():
        seen.append(current_key_digest())
        return "charged", 201

    client = app.test_client()
    client.post("/charge", headers=KEY)  # owns the key
    client.post("/charge")  # no key: runs unprotected
    assert seen == [key_digest("anonymous", "view-start"), None]


def test_r48_c5_a_hook_registered_after_init_app_runs_before_the_layer_decides(
    make_app,
) -> None:
    """The scope loader sees what the app's hooks loaded, whenever they were registered:
    two tenants using one key get a record each (C5), not one tenant's answer twice."""
    app, idempotency = make_app()

    @app.before_request  # registered after init_app, as most apps do
    def load_tenant():
        g.tenant = request.headers.get("X-Tenant")

    @idempotency.scope_loader
    def tenant():
        return g.get("tenant")

    @app.post("/pay")
    @idempotent
    def pay():
        return {"tenant": g.tenant}, 201

    client = app.test_client()
    acme = client.post("/pay", headers={**KEY, "X-Tenant": "acme"})
    globex = client.post("/pay", headers={**KEY, "X-Tenant": "globex"})
    assert acme.json == {"tenant": "acme"} and globex.json == {"tenant": "globex"}
    assert "Idempotent-Replayed" not in globex.headers


def test_r48_a_replay_passes_the_apps_before_request_hooks(make_app) -> None:
    """A stored answer is replayed only to a request the app's own checks let through."""
    app, idempotency = make_app()
    idempotency.scope_loader(lambda: "acme")  # the same scope with or without credentials

    @app.before_request
    def authenticate():
        if request.headers.get("Authorization") != "Bearer ok":
            abort(401)

    @app.post("/pay")
    @idempotent
    def pay():
        return {"paid": True}, 201

    client = app.test_client()
    authorized = {**KEY, "Authorization": "Bearer ok"}
    assert client.post("/pay", headers=authorized).status_code == 201
    assert client.post("/pay", headers=KEY).status_code == 401
    assert client.post("/pay", headers=authorized).headers["Idempotent-Replayed"] == "true"


def test_r48_c9_after_request_hooks_run_once_on_the_first_answer_and_on_the_replay(
    make_app,
) -> None:
    """The view's own response is stored; an ``after_request`` hook that rewrites the body
    runs once on the first answer and once on the replay, so both are the same bytes."""
    app, _ = make_app()
    calls: list[str] = []

    @app.after_request
    def envelope(response):
        if response.is_json:
            response.set_data(json.dumps({"data": response.get_json()}))
        return response

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return {"paid": True}, 201

    client = app.test_client()
    first = client.post("/pay", headers=KEY)
    again = client.post("/pay", headers=KEY)
    assert first.json == {"data": {"paid": True}}
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data and calls == ["pay"]


class _WorkerExit(BaseException):
    """Like gevent's Timeout or a worker's SystemExit: not an ``Exception``."""


def test_c15_c44_an_exit_raised_in_the_view_releases_the_claim_and_its_lease(make_app) -> None:
    """No answer follows an exit; the claim is released at once and the heartbeat stops
    renewing it, so a retry runs the view instead of waiting out a lease."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        if len(calls) == 1:
            raise _WorkerExit()
        return {"paid": True}, 201

    client = app.test_client()
    leases = heartbeat.renewer().registered()
    with pytest.raises(_WorkerExit):
        client.post("/pay", headers=KEY)
    assert heartbeat.renewer().registered() == leases
    retry = client.post("/pay", headers=KEY)
    assert retry.status_code == 201 and "Idempotent-Replayed" not in retry.headers
    assert calls == ["pay", "pay"]
