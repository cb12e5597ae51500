"""Issue 26, the security review of the fingerprint (C6, C7).

Two requests that a view can tell apart must not share a fingerprint: the second
would get the first one's stored answer instead of 422, and its own view would
never run. Each test names its item of the issue and the rule it checks.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
from flask import Flask, jsonify, request
from werkzeug.datastructures import MultiDict

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


# -- item 2: repeated form fields and uploads keep their order -----------------------------

FORM = "application/x-www-form-urlencoded"


def uploads(*files: tuple[bytes, str], **fields: str) -> MultiDict[str, Any]:
    """A multipart body: ``fields``, then each ``(content, filename)`` under ``doc``."""
    data: MultiDict[str, Any] = MultiDict(fields)
    for content, filename in files:
        data.add("doc", (io.BytesIO(content), filename, "text/plain"))
    return data


def test_i26_2_c6_repeated_form_fields_keep_their_order(fp_app: Flask) -> None:
    """C6: ``qty=1&qty=50`` is not ``qty=50&qty=1``; the order of names still does not count."""
    assert fp(fp_app, data=b"qty=1&qty=50", content_type=FORM) != fp(
        fp_app, data=b"qty=50&qty=1", content_type=FORM
    )
    base = fp(fp_app, data=b"qty=1&sku=x&qty=50", content_type=FORM)
    assert fp(fp_app, data=b"sku=x&qty=1&qty=50", content_type=FORM) == base
    assert fp(fp_app, data=b"qty=50&sku=x&qty=1", content_type=FORM) != base


def test_i26_2_c6_repeated_uploads_keep_their_order(fp_app: Flask) -> None:
    """C6: two files under one field name, swapped, are another request."""
    one, two = (b"first", "a.txt"), (b"second", "b.txt")
    assert fp(fp_app, data=uploads(one, two, note="n")) != fp(
        fp_app, data=uploads(two, one, note="n")
    )
    assert fp(fp_app, data=uploads(one, two, note="n")) == fp(
        fp_app, data=uploads(one, two, note="n")
    )
    # Fields of a multipart body keep their values' order too.
    assert fp(fp_app, data=MultiDict([("qty", "1"), ("qty", "50"), ("doc", "")])) != fp(
        fp_app, data=MultiDict([("qty", "50"), ("qty", "1"), ("doc", "")])
    )


def test_i26_2_c7_swapped_form_values_are_422_not_a_replay(counted: Any) -> None:
    """C7 (docs/forms.md: another quantity is a 422): the view would read qty=50, not 1."""
    app, calls = counted
    client = app.test_client()
    headers = {"Idempotency-Key": "k-form"}
    first = client.post("/pay", data=b"qty=1&qty=50", content_type=FORM, headers=headers)
    assert first.status_code == 201 and first.json["qty"] == "1"
    second = client.post("/pay", data=b"qty=50&qty=1", content_type=FORM, headers=headers)
    assert second.status_code == 422 and REPLAYED not in second.headers
    assert len(calls) == 1


def test_i26_2_c7_swapped_uploads_are_422_not_a_replay(counted: Any) -> None:
    app, calls = counted
    client = app.test_client()
    headers = {"Idempotency-Key": "k-files"}
    one, two = (b"first", "a.txt"), (b"second", "b.txt")
    first = client.post("/pay", data=uploads(one, two), headers=headers)
    assert first.status_code == 201 and first.json["files"] == ["first", "second"]
    second = client.post("/pay", data=uploads(two, one), headers=headers)
    assert second.status_code == 422 and REPLAYED not in second.headers
    again = client.post("/pay", data=uploads(one, two), headers=headers)
    assert again.headers.get(REPLAYED) == "true"
    assert len(calls) == 1
