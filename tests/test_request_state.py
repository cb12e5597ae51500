"""Per-request state belongs to its request (issue 9 item 6; CONTRACT C1, C19).

Flask keeps ``g`` on the app context, and a request pushed while an app context
is already active (a test under ``with app.app_context():``, a sub-request made
from inside a view) shares it. The layer's record of "this request owns a claim"
must not leak from one request into the next through it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from flask import g, jsonify

import flask_idempotency
from flask_idempotency import current_key_digest, idempotent, release_claim

KEY = {"Idempotency-Key": "key-1"}


def _app(make_app):
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    seen: list[tuple[str | None, bool]] = []

    @app.post("/protected")
    @idempotent
    def protected():
        return jsonify(digest=current_key_digest()), 201

    @app.post("/plain")
    def plain():
        seen.append((current_key_digest(), release_claim()))
        return jsonify(ok=True), 201

    return app, seen


def test_i9_6_c19_no_ownership_leaks_into_the_next_request_on_a_shared_app_context(
    make_app,
) -> None:
    """C19/C1: after a protected request, the next one in its app context owns nothing."""
    app, seen = _app(make_app)
    with app.app_context():
        client = app.test_client()
        first = client.post("/protected", headers=KEY)
        assert first.status_code == 201 and first.json["digest"]
        client.post("/plain", headers={"Idempotency-Key": "other"})
        assert seen == [(None, False)]
        # Nothing of the layer's is left on the shared g once the request is over.
        assert not [name for name in vars(g._get_current_object()) if "idempotency" in name]


def test_i9_6_c19_sub_request_from_a_protected_view_owns_nothing(make_app) -> None:
    """C19: a request made from inside a protected view is a request of its own."""
    app, seen = _app(make_app)

    @app.post("/outer")
    @idempotent
    def outer():
        inner = app.test_client().post("/plain")
        assert inner.status_code == 201
        return jsonify(outer=current_key_digest()), 201

    with app.app_context():
        response = app.test_client().post("/outer", headers=KEY)
        again = app.test_client().post("/outer", headers=KEY)
    assert response.status_code == 201 and response.json["outer"]
    assert seen == [(None, False)]
    # The outer record holds the outer view's answer, not the sub-request's.
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.json == response.json


def test_i9_6_c15_a_second_protected_request_settles_its_own_claim(make_app) -> None:
    """C15: two protected requests in one app context each store their own record."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return jsonify(digest=current_key_digest()), 201

    with app.app_context():
        client = app.test_client()
        a = client.post("/pay", headers={"Idempotency-Key": "a"})
        b = client.post("/pay", headers={"Idempotency-Key": "b"})
        a2 = client.post("/pay", headers={"Idempotency-Key": "a"})
        b2 = client.post("/pay", headers={"Idempotency-Key": "b"})
    assert calls == ["pay", "pay"]
    assert a.json["digest"] != b.json["digest"]
    assert a2.headers.get("Idempotent-Replayed") == "true" and a2.json == a.json
    assert b2.headers.get("Idempotent-Replayed") == "true" and b2.json == b.json


def test_i11_sub_request_to_a_protected_view_leaves_its_parent_pending(make_app) -> None:
    """C15: a protected request made from inside a protected view settles its own claim,
    and its end does not make the parent's after_request skip the parent's claim (the
    hooks' fast exit counts pending requests per context; a flag would be cleared)."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.post("/inner")
    @idempotent
    def inner():
        calls.append("inner")
        return jsonify(inner=current_key_digest()), 201

    @app.post("/outer")
    @idempotent
    def outer():
        calls.append("outer")
        sub = app.test_client().post("/inner", headers={"Idempotency-Key": "inner"})
        return jsonify(outer=current_key_digest(), inner=sub.json["inner"]), 201

    client = app.test_client()
    first = client.post("/outer", headers=KEY)
    again = client.post("/outer", headers=KEY)
    inner_again = client.post("/inner", headers={"Idempotency-Key": "inner"})
    assert first.status_code == 201 and first.json["outer"] != first.json["inner"]
    assert again.headers.get("Idempotent-Replayed") == "true" and again.json == first.json
    assert inner_again.headers.get("Idempotent-Replayed") == "true"
    assert calls == ["outer", "inner"]


def _calls_into_the_package(call: Any) -> list[str]:
    """The functions of ``flask_idempotency`` entered while ``call()`` runs (a profile hook)."""
    package = os.path.dirname(flask_idempotency.__file__)
    entered: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


def test_i11_an_unprotected_request_runs_nothing_of_the_layer(make_app) -> None:
    """Issue 11 (unprotected route ≤ 1.03× bare): once the app has handled its first
    request, a request to an unmarked view, key or not, enters one function of the layer
    and nothing below it (counted with a profile hook, not timed): the hook that puts a
    protected request's body under the cap before the app's own hooks read it (C31,
    issue 34), which for another view is one dictionary look-up. The app keeps no
    before/after/teardown hook of the layer."""
    app, _ = make_app()

    @app.post("/plain")
    def plain():
        return jsonify(ok=True), 201

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(paid=True), 201

    client = app.test_client()
    assert client.post("/plain").status_code == 201  # the first request puts the layer in place
    responses: list[Any] = []
    entered = _calls_into_the_package(
        lambda: responses.append(client.post("/plain", headers={"Idempotency-Key": "ignored"}))
    )
    assert responses[0].status_code == 201
    assert entered == ["guard_bodies"]
    hooks = [
        *app.before_request_funcs.get(None, []),
        *app.after_request_funcs.get(None, []),
        *app.teardown_request_funcs.get(None, []),
    ]
    assert not [hook for hook in hooks if hook.__module__.startswith("flask_idempotency")]
    # The marked view, put in place by that first request to another view, is protected.
    first = client.post("/pay", headers=KEY)
    again = client.post("/pay", headers=KEY)
    assert first.status_code == 201 and again.headers.get("Idempotent-Replayed") == "true"


@pytest.mark.parametrize("outcome", ["stored", "released"])
def test_i11_c15_an_owner_request_is_freed_without_the_cycle_collector(make_app, outcome) -> None:
    """C15: the claim's close hook on the request is taken off once the request closes,
    so an owner's request (its environ, body and ownership) is freed when its context
    ends, not kept until the cycle collector runs (every first execution left one)."""
    import gc
    import weakref

    from flask import request

    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    seen: list[weakref.ref[Any]] = []

    @app.post("/pay")
    @idempotent
    def pay():
        seen.append(weakref.ref(request._get_current_object()))
        return jsonify(paid=True), 201 if outcome == "stored" else 503

    client = app.test_client()
    client.post("/pay", headers={"Idempotency-Key": "warm"}, json={"n": 0})
    gc.collect()
    gc.disable()
    try:
        response = client.post("/pay", headers=KEY, json={"n": 1, "pad": "x" * 1000})
        assert response.status_code == (201 if outcome == "stored" else 503)
        assert seen[-1]() is None
    finally:
        gc.enable()
