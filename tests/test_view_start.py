"""Only an outcome of the view itself is stored (R48, C18).

The claim is taken in the app's ``before_request``; hooks that run after it
(blueprint hooks, app hooks registered later) may still reject the request.
Those answers must release the key, whatever way the view was registered.
"""

from __future__ import annotations

from flask import Blueprint, abort, request
from flask.views import MethodView

from flask_idempotency import idempotent

KEY = {"Idempotency-Key": "view-start"}


def test_r48_blueprint_hook_rejection_releases_the_key(make_app) -> None:
    app, _ = make_app()
    bp = Blueprint("payments", __name__)
    calls: list[str] = []

    @bp.before_request
    def require_token():  # runs after the app's hooks, so after the claim
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
