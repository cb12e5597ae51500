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


# -- item 3: the endpoint and the rule's subdomain or host ---------------------------------

TENANTS = ("acme", "globex")


def _tenant_view(tenant: str, calls: list[str]) -> Any:
    def orders() -> Any:
        calls.append(tenant)
        return jsonify(tenant=tenant, secret=f"{tenant}-ledger-only"), 201

    orders.__name__ = f"{tenant}_orders"
    return idempotent(orders)


def _subdomain_routes(app: Flask, calls: list[str]) -> None:
    """``/orders`` once per tenant, each on its own subdomain of ``example.com``."""
    app.config["SERVER_NAME"] = "example.com"
    app.subdomain_matching = True
    for tenant in TENANTS:
        app.add_url_rule(
            "/orders", view_func=_tenant_view(tenant, calls), methods=["POST"], subdomain=tenant
        )


def _host_routes(app: Flask, calls: list[str]) -> None:
    """``/orders`` once per tenant, each on its own host (``host_matching``)."""
    app.url_map.host_matching = True
    for tenant in TENANTS:
        app.add_url_rule(
            "/orders",
            view_func=_tenant_view(tenant, calls),
            methods=["POST"],
            host=f"{tenant}.example.com",
        )


@pytest.mark.parametrize("routes", [_subdomain_routes, _host_routes])
def test_i26_3_c6_the_rules_subdomain_or_host_and_endpoint_are_fingerprinted(routes: Any) -> None:
    app = Flask("tenants")
    routes(app, [])
    prints = {}
    for tenant in TENANTS:
        base_url = f"http://{tenant}.example.com"
        with app.test_request_context("/orders", base_url=base_url, method="POST", json={}):
            assert request.url_rule is not None and request.url_rule.rule == "/orders"
            prints[tenant] = request_fingerprint(request)
    assert prints["acme"] != prints["globex"]


def test_i26_3_c6_the_endpoint_is_fingerprinted() -> None:
    """The same method, path and body to two endpoints (two apps, or two versions of
    one, sharing a table) are two requests."""
    prints = []
    for endpoint in ("orders.create", "billing.charge"):
        app = Flask("endpoints")
        app.add_url_rule("/orders", endpoint, lambda: "", methods=["POST"])
        with app.test_request_context("/orders", method="POST", json={"n": 1}):
            prints.append(request_fingerprint(request))
    assert prints[0] != prints[1]


def _login_user_5(app: Flask) -> None:
    """Flask-Login with per-tenant user ids: the token ``t`` is user 5 in every tenant."""
    from flask_login import LoginManager, UserMixin

    class User(UserMixin):
        id = "5"

    login = LoginManager(app)
    login.request_loader(lambda req: User() if req.headers.get("Authorization") == "t" else None)


@pytest.mark.parametrize("routes", [_subdomain_routes, _host_routes])
def test_i26_3_c5_c7_a_tenants_stored_answer_never_reaches_another_tenant(
    make_app: Any, routes: Any
) -> None:
    """The issue's case: user 5 of acme and user 5 of globex send one key to ``/orders``.

    The default scope (``user:5``) carries the host of a host or subdomain route, so
    the tenants' keys are independent (C5): globex's view runs and answers globex's
    data; before, globex got acme's stored answer.
    """
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0, "SECRET_KEY": "test"})
    calls: list[str] = []
    routes(app, calls)
    _login_user_5(app)
    client = app.test_client()
    headers = {"Idempotency-Key": "order-1", "Authorization": "t"}
    answers = {
        tenant: client.post(
            "/orders", base_url=f"http://{tenant}.example.com", json={"n": 1}, headers=headers
        )
        for tenant in TENANTS
    }
    for tenant, answer in answers.items():
        assert answer.status_code == 201, answer.data
        assert answer.json["tenant"] == tenant
        assert REPLAYED not in answer.headers
    assert calls == ["acme", "globex"]
    again = client.post(
        "/orders", base_url="http://globex.example.com", json={"n": 1}, headers=headers
    )
    assert again.headers.get(REPLAYED) == "true" and again.json["tenant"] == "globex"


@pytest.mark.parametrize("routes", [_subdomain_routes, _host_routes])
def test_i26_3_c7_a_scope_shared_across_tenants_is_422_never_the_other_tenants_answer(
    make_app: Any, routes: Any
) -> None:
    """A scope_loader that forgets the tenant (the same scope in both) gets 422 (C7)."""
    app, ext = make_app({"IDEMPOTENCY_WAIT": 0})
    ext.scope_loader(lambda: "user-5")
    calls: list[str] = []
    routes(app, calls)
    client = app.test_client()
    headers = {"Idempotency-Key": "order-1"}
    first = client.post("/orders", base_url="http://acme.example.com", json={}, headers=headers)
    assert first.status_code == 201
    second = client.post("/orders", base_url="http://globex.example.com", json={}, headers=headers)
    assert second.status_code == 422, second.data
    assert b"acme" not in second.data
    assert calls == ["acme"]


# -- item 4: the media type -------------------------------------------------------------------

JSON_PATCH = b'[{"op": "replace", "path": "/amount", "value": 5}]'


@pytest.mark.parametrize(
    ("body", "first", "second"),
    [
        (JSON_PATCH, "application/json-patch+json", "application/merge-patch+json"),
        (b'{"amount": 5}', "application/json", "application/merge-patch+json"),
        (b"a,b\n1,2\n", "text/csv", "application/xml"),
        (b"a,b\n1,2\n", "text/csv", "text/plain"),
        (b"", "application/octet-stream", ""),
    ],
)
def test_i26_4_c6_the_media_type_is_fingerprinted(
    fp_app: Flask, body: bytes, first: str, second: str
) -> None:
    assert fp(fp_app, data=body, content_type=first) != fp(fp_app, data=body, content_type=second)


@pytest.mark.parametrize(
    "variant",
    ["application/json; charset=utf-8", "Application/JSON", " application/json ;x=y"],
)
def test_i26_4_c6_media_type_parameters_and_case_do_not_count(fp_app: Flask, variant: str) -> None:
    """As before: the media type without its parameters, in lower case."""
    body = b'{"amount": 5}'
    assert fp(fp_app, data=body, content_type=variant) == fp(
        fp_app, data=body, content_type="application/json"
    )


@pytest.mark.parametrize(
    ("body", "first", "second"),
    [
        (JSON_PATCH, "application/json-patch+json", "application/merge-patch+json"),
        (b"a,b\n1,2\n", "text/csv", "application/xml"),
    ],
)
def test_i26_4_c7_the_same_bytes_as_another_media_type_are_422(
    make_app: Any, body: bytes, first: str, second: str
) -> None:
    """C7: a JSON Patch and a merge patch of the same bytes do different things."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.route("/doc", methods=["PATCH"])
    @idempotent
    def patch() -> Any:
        calls.append(request.mimetype)
        return jsonify(applied_as=request.mimetype), 200

    client = app.test_client()
    headers = {"Idempotency-Key": "k-media"}
    assert client.patch("/doc", data=body, content_type=first, headers=headers).status_code == 200
    second_answer = client.patch("/doc", data=body, content_type=second, headers=headers)
    assert second_answer.status_code == 422, second_answer.data
    assert REPLAYED not in second_answer.headers
    assert calls == [first]
