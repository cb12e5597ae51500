"""Issue 26, the security review of the fingerprint (C6, C7).

Two requests that a view can tell apart must not share a fingerprint: the second
would get the first one's stored answer instead of 422, and its own view would
never run. Each test names its item of the issue and the rule it checks.
"""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask, jsonify, request

from flask_idempotency import idempotent
from flask_idempotency.fingerprint import request_fingerprint

REPLAYED = "Idempotent-Replayed"


@pytest.fixture(scope="module")
def fp_app() -> Flask:
    app = Flask("fingerprint_security")

    @app.post("/pay")
    def pay():
        return ""

    return app


def fp(app: Flask, path: str = "/pay", method: str = "POST", **kwargs: Any) -> str:
    with app.test_request_context(path, method=method, **kwargs):
        return request_fingerprint(request)


# -- item 1: repeated query values keep their order ----------------------------------------


def test_i26_1_c6_repeated_query_values_keep_their_order(fp_app: Flask) -> None:
    """C6: ``a=1&a=2`` is not ``a=2&a=1`` (``request.args["a"]`` differs); names still sort."""
    assert fp(fp_app, "/pay?amount=1&amount=1000", json={}) != fp(
        fp_app, "/pay?amount=1000&amount=1", json={}
    )
    # The order of names does not matter, and a repeated name interleaved with others
    # keeps its values' order wherever its occurrences stand.
    base = fp(fp_app, "/pay?a=1&b=2&a=3", json={})
    assert fp(fp_app, "/pay?b=2&a=1&a=3", json={}) == base
    assert fp(fp_app, "/pay?a=1&a=3&b=2", json={}) == base
    assert fp(fp_app, "/pay?a=3&b=2&a=1", json={}) != base
    assert fp(fp_app, "/pay?a=1&a=2", json={}) != fp(fp_app, "/pay?a=2&a=1", json={})


@pytest.fixture
def counted(make_app: Any) -> tuple[Flask, list[Any]]:
    """An app whose protected ``/pay`` records what its view read, and answers with it."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[Any] = []

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        seen = {
            "amount": request.args.get("amount"),
            "qty": request.form.get("qty"),
            "files": [f.read().decode() for f in request.files.getlist("doc")],
        }
        calls.append(seen)
        return jsonify(seen), 201

    return app, calls


def test_i26_1_c7_swapped_query_values_are_422_not_a_replay(counted: Any) -> None:
    """C7: the second request reads another amount: it is another request, 422, no replay."""
    app, calls = counted
    client = app.test_client()
    headers = {"Idempotency-Key": "k-query"}
    first = client.post("/pay?amount=1&amount=1000", json={}, headers=headers)
    assert first.status_code == 201 and first.json["amount"] == "1"
    second = client.post("/pay?amount=1000&amount=1", json={}, headers=headers)
    assert second.status_code == 422, second.data
    assert second.json["code"] == "key-reused"
    assert REPLAYED not in second.headers
    again = client.post("/pay?amount=1&amount=1000", json={}, headers=headers)
    assert again.headers.get(REPLAYED) == "true"
    assert len(calls) == 1
