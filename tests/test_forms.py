"""HTML forms: the key travels in a hidden form field (C49).

With no ``Idempotency-Key`` header the layer reads the key from the form field
``IDEMPOTENCY_FORM_FIELD``; the field (and Flask-WTF's CSRF token) are left out
of the fingerprint; a resubmitted form gets the original response, so
Post/Redirect/Get lands on the same confirmation page. The real-browser proof is
``tests/test_browser.py``.
"""

from __future__ import annotations

import io
import re
import time
from typing import Any

import pytest
from flask import Flask, redirect, render_template_string, request, url_for

from flask_idempotency import idempotent, signals
from flask_idempotency.fingerprint import request_fingerprint

FORM = """<form method="post" action="{{ url_for('checkout') }}">
{{ idempotency_key_field(**kwargs) }}{{ csrf }}
<input name="item" value="book"><button>Pay</button></form>"""


def _field_value(html: str, name: str = "_idempotency_key") -> str:
    match = re.search(rf'name="{name}"(?: type="hidden")? value="([^"]+)"', html)
    assert match is not None, html
    return match.group(1)


def _checkout_app(make_app: Any, config: dict[str, Any] | None = None) -> tuple[Flask, list[str]]:
    app, _ = make_app(config)
    orders: list[str] = []

    @app.get("/checkout")
    def form() -> str:
        kwargs = {"key": request.args["key"]} if "key" in request.args else {}
        return render_template_string(FORM, kwargs=kwargs, csrf="")

    @app.post("/checkout")
    @idempotent
    def checkout() -> Any:
        orders.append(request.form["item"])
        return redirect(url_for("order", number=len(orders)), code=303)

    @app.get("/orders/<int:number>")
    def order(number: int) -> str:
        return f"order {number}"

    return app, orders


def test_c49_idempotency_key_field_renders_a_fresh_hidden_key_each_time(make_app) -> None:
    app, _ = _checkout_app(make_app)
    client = app.test_client()
    first = client.get("/checkout").get_data(as_text=True)
    second = client.get("/checkout").get_data(as_text=True)
    assert '<input type="hidden" name="_idempotency_key" value="' in first
    assert _field_value(first) != _field_value(second)
    assert len(_field_value(first)) >= 32


def test_c49_a_key_of_the_apps_own_is_escaped(make_app) -> None:
    app, _ = _checkout_app(make_app)
    html = app.test_client().get("/checkout", query_string={"key": 'a"><b>'}).get_data(True)
    assert "<b>" not in html and "&#34;&gt;&lt;b&gt;" in html


def test_c49_resubmitted_form_replays_the_same_redirect(make_app) -> None:
    """Double submit of one rendered form: one order, the same 303 to the same page."""
    app, orders = _checkout_app(make_app)
    client = app.test_client()
    key = _field_value(client.get("/checkout").get_data(as_text=True))
    form = {"_idempotency_key": key, "item": "book"}
    first = client.post("/checkout", data=form)
    again = client.post("/checkout", data=form)
    assert first.status_code == again.status_code == 303
    assert first.headers["Location"] == again.headers["Location"] == "/orders/1"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert orders == ["book"]


def test_c49_a_new_rendering_is_a_new_submission(make_app) -> None:
    app, orders = _checkout_app(make_app)
    client = app.test_client()
    for _ in range(2):
        key = _field_value(client.get("/checkout").get_data(as_text=True))
        client.post("/checkout", data={"_idempotency_key": key, "item": "book"})
    assert orders == ["book", "book"]


def test_c49_same_form_key_with_other_fields_is_422(make_app) -> None:
    app, orders = _checkout_app(make_app)
    client = app.test_client()
    client.post("/checkout", data={"_idempotency_key": "k-1", "item": "book"})
    other = client.post("/checkout", data={"_idempotency_key": "k-1", "item": "lamp"})
    assert other.status_code == 422
    assert other.json["code"] == "key-reused"  # type: ignore[index]
    assert orders == ["book"]


def test_c49_form_field_is_left_out_of_the_fingerprint(make_app) -> None:
    """The header and the form field name the same record when their keys agree."""
    app, orders = _checkout_app(make_app)
    client = app.test_client()
    client.post("/checkout", data={"_idempotency_key": "k-2", "item": "book"})
    by_header = client.post(
        "/checkout",
        data={"item": "book", "_idempotency_key": "something-else"},
        headers={"Idempotency-Key": "k-2"},
    )
    assert by_header.status_code == 303 and by_header.headers["Idempotent-Replayed"] == "true"
    assert orders == ["book"]
    with app.test_request_context(
        "/checkout", method="POST", data={"item": "book", "_idempotency_key": "x"}
    ):
        with_field = request_fingerprint(request, frozenset({"_idempotency_key"}))
    with app.test_request_context("/checkout", method="POST", data={"item": "book"}):
        without = request_fingerprint(request, frozenset({"_idempotency_key"}))
    assert with_field == without


def test_c49_header_wins_over_the_form_field(make_app) -> None:
    app, orders = _checkout_app(make_app)
    client = app.test_client()
    for form_key in ("a", "b"):
        client.post(
            "/checkout",
            data={"_idempotency_key": form_key, "item": "book"},
            headers={"Idempotency-Key": "hdr"},
        )
    assert orders == ["book"]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"_idempotency_key": ["a", "b"], "item": "book"}, "more than once"),
        ({"_idempotency_key": "", "item": "book"}, "empty"),
        ({"_idempotency_key": "é", "item": "book"}, ""),
        ({"_idempotency_key": "x" * 300, "item": "book"}, "longer"),
    ],
)
def test_c49_c3_bad_form_keys_are_400_and_run_nothing(make_app, data, why) -> None:
    app, orders = _checkout_app(make_app)
    response = app.test_client().post("/checkout", data=data)
    assert response.status_code == 400
    assert response.json["code"] == "invalid-key"  # type: ignore[index]
    assert "_idempotency_key" in response.json["detail"] and why in response.json["detail"]  # type: ignore[index]
    assert orders == []


def test_c49_c4_required_route_accepts_the_form_field(make_app) -> None:
    app, _ = make_app()
    runs: list[int] = []

    @app.post("/pay")
    @idempotent(required=True)
    def pay() -> tuple[str, int]:
        runs.append(1)
        return "paid", 201

    client = app.test_client()
    assert client.post("/pay", data={"amount": "1"}).status_code == 400
    for _ in range(2):
        assert client.post("/pay", data={"_idempotency_key": "f", "amount": "1"}).status_code == 201
    assert runs == [1]


def test_c49_json_body_field_is_not_a_key(make_app) -> None:
    """Only form bodies carry the form key: a JSON member of that name is data."""
    app, _ = make_app()
    runs: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay() -> tuple[str, int]:
        runs.append(1)
        return "paid", 201

    client = app.test_client()
    for _ in range(2):
        client.post("/pay", json={"_idempotency_key": "j"})
    assert runs == [1, 1]


def test_c49_custom_form_field_name(make_app) -> None:
    app, orders = _checkout_app(make_app, {"IDEMPOTENCY_FORM_FIELD": "submission"})
    client = app.test_client()
    html = client.get("/checkout").get_data(as_text=True)
    key = _field_value(html, "submission")
    for _ in range(2):
        client.post("/checkout", data={"submission": key, "item": "book"})
    assert orders == ["book"]


@pytest.mark.parametrize("value", ["", None, 3])
def test_c49_bad_form_field_setting_fails_at_start(make_app, value) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_FORM_FIELD"):
        make_app({"IDEMPOTENCY_FORM_FIELD": value})


def test_c49_multipart_form_key_and_the_view_still_reads_its_upload(make_app) -> None:
    """Reading the key from a multipart form parses it once; the view reads the upload (C31)."""
    app, _ = make_app()
    seen: list[bytes] = []

    @app.post("/upload")
    @idempotent
    def upload() -> tuple[str, int]:
        seen.append(request.files["doc"].read())
        return "stored", 201

    def send() -> Any:
        return app.test_client().post(
            "/upload",
            data={"_idempotency_key": "mp", "doc": (io.BytesIO(b"content"), "d.txt")},
            content_type="multipart/form-data",
        )

    assert send().status_code == 201
    replayed = send()
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert seen == [b"content"]


def test_c49_concurrent_form_submits_run_once(make_pg_app) -> None:
    """A double click: two POSTs of one form at once; the second waits and replays."""
    import threading

    app, _ = make_pg_app()
    orders: list[int] = []
    gate = threading.Event()

    @app.post("/checkout")
    @idempotent
    def checkout() -> Any:
        orders.append(1)
        gate.wait(1.0)
        return redirect("/orders/1", code=303)

    results: list[Any] = []

    def submit() -> None:
        results.append(app.test_client().post("/checkout", data={"_idempotency_key": "dbl"}))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    gate.set()
    for thread in threads:
        thread.join()
    assert len(orders) == 1
    assert {r.status_code for r in results} == {303}
    assert {r.headers["Location"] for r in results} == {"/orders/1"}
    assert sum(r.headers.get("Idempotent-Replayed") == "true" for r in results) == 7


# -- Flask-WTF ----------------------------------------------------------------------


def _wtf_app(make_app: Any) -> tuple[Flask, list[str], list[str]]:
    from flask_wtf import CSRFProtect, FlaskForm
    from wtforms import StringField

    class Checkout(FlaskForm):  # type: ignore[misc]
        item = StringField()

    app, _ = make_app({"SECRET_KEY": "test-secret", "WTF_CSRF_ENABLED": True})
    app.config["TESTING"] = False  # Flask-WTF skips CSRF checks under TESTING
    CSRFProtect(app)
    orders: list[str] = []
    executed: list[str] = []
    signals.request_executed.connect(lambda sender, **extra: executed.append("x"), app, weak=False)

    @app.route("/checkout", methods=["GET", "POST"])
    @idempotent
    def checkout() -> Any:
        form = Checkout()
        if form.validate_on_submit():
            orders.append(form.item.data)
            return redirect(f"/orders/{len(orders)}", code=303)
        key = request.args.get("key")
        return render_template_string(
            "<form method=post>{{ form.csrf_token }}{{ idempotency_key_field(**kw) }}"
            "{{ form.item }}</form>",
            form=form,
            kw={"key": key} if key else {},
        )

    return app, orders, executed


def _form_fields(html: str) -> dict[str, str]:
    return {
        "csrf_token": _field_value(html, "csrf_token"),
        "_idempotency_key": _field_value(html),
        "item": "book",
    }


def test_c49_flask_wtf_csrf_double_submit_replays(make_app) -> None:
    app, orders, _ = _wtf_app(make_app)
    client = app.test_client()
    fields = _form_fields(client.get("/checkout").get_data(as_text=True))
    first = client.post("/checkout", data=fields)
    again = client.post("/checkout", data=fields)
    assert first.status_code == again.status_code == 303, first.get_data(as_text=True)
    assert first.headers["Location"] == again.headers["Location"]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert orders == ["book"]


def test_c49_flask_wtf_rerendered_csrf_token_still_matches(make_app) -> None:
    """A key of the app's own across two renderings: the CSRF token differs (it is
    re-signed with the time), the fingerprint does not, so the second submit replays."""
    app, orders, _ = _wtf_app(make_app)
    client = app.test_client()
    first_page = _form_fields(client.get("/checkout?key=cart-7").get_data(as_text=True))
    time.sleep(1.1)  # the token's signature carries a timestamp in whole seconds
    second_page = _form_fields(client.get("/checkout?key=cart-7").get_data(as_text=True))
    assert first_page["csrf_token"] != second_page["csrf_token"]
    assert client.post("/checkout", data=first_page).status_code == 303
    again = client.post("/checkout", data=second_page)
    assert again.status_code == 303 and again.headers["Idempotent-Replayed"] == "true"
    assert orders == ["book"]


def test_c49_r48_flask_wtf_rejected_token_is_not_stored(make_app) -> None:
    """A bad CSRF token is the form's own 400; a fixed resubmit under the key runs."""
    app, orders, _ = _wtf_app(make_app)
    client = app.test_client()
    fields = _form_fields(client.get("/checkout").get_data(as_text=True))
    assert client.post("/checkout", data={**fields, "csrf_token": "forged"}).status_code == 400
    fixed = client.post("/checkout", data=fields)
    assert fixed.status_code == 303 and "Idempotent-Replayed" not in fixed.headers
    assert orders == ["book"]
