"""Hostile and broken input never yields a 500 (C3, C27; house rule).

Each request gets either a clear 4xx ``application/problem+json`` from the layer,
with nothing stored, or a normal run of the view. Apps run with TESTING off so a
500 shows up as a status, not as a re-raised exception hiding the answer.
"""

from __future__ import annotations

import io
import json
import os
import random
from importlib import metadata

import pytest
from flask import jsonify, request
from sqlalchemy import func, select

from flask_idempotency import idempotent
from flask_idempotency.keys import InvalidKey, parse_key

from .test_keys import SPEC_VECTORS


@pytest.fixture
def app_calls(make_app):
    app, _ = make_app({"TESTING": False, "IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        raw = request.get_data()
        try:
            parsed = request.get_json(silent=True) is not None
        except RecursionError:  # Flask's own parser; not the layer's concern
            parsed = False
        return jsonify(
            length=len(raw),
            json=parsed,
            form=len(request.form),
            files=len(request.files),
        ), 201

    @app.post("/required")
    @idempotent(required=True)
    def required():
        calls.append("required")
        return jsonify(ok=True), 201

    return app, calls


def row_count(app) -> int:
    store = app.extensions["idempotency"].store
    with store.autocommit.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(store.table)).scalar_one())


def assert_layer_rejected(app, response, code: str) -> None:
    assert response.status_code == 400, response.data
    assert response.mimetype == "application/problem+json"
    assert json.loads(response.data)["code"] == code
    assert row_count(app) == 0


#: Werkzeug 2.3 answers 413 itself to an urlencoded body it cannot decode (its ``ValueError``
#: becomes ``RequestEntityTooLarge`` before any view runs); Werkzeug 3 decodes with replacement.
WERKZEUG_REFUSES_UNDECODABLE_FORMS = int(metadata.version("werkzeug").split(".")[0]) < 3


def refused_by_werkzeug_2(first, again, calls) -> bool:
    """C31 on Werkzeug 2.3: Flask's own clear 413, the same each time; the view never ran."""
    if not (WERKZEUG_REFUSES_UNDECODABLE_FORMS and first.status_code == 413):
        return False
    assert again.status_code == 413 and calls == []
    return True


def assert_handled(response) -> None:
    """Either the layer's clear 4xx problem or a normal answer; never a server error."""
    assert response.status_code < 500, response.data[:300]
    if 400 <= response.status_code < 500 and response.mimetype == "application/problem+json":
        body = json.loads(response.data)
        assert body["status"] == response.status_code and body["code"]


# -- the header ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("field", "lenient_result", "strict_result"), SPEC_VECTORS)
def test_c3_spec_vectors_on_a_required_endpoint(
    make_app, field: str, lenient_result: object, strict_result: object, strict: bool
) -> None:
    app, _ = make_app({"TESTING": False, "IDEMPOTENCY_STRICT_HEADER": strict})
    calls: list[str] = []

    @app.post("/required")
    @idempotent(required=True)
    def required():
        calls.append("run")
        return "ok", 201

    expected = strict_result if strict else lenient_result
    response = app.test_client().post("/required", headers={"Idempotency-Key": field})
    if isinstance(expected, str):
        assert response.status_code == 201
        assert calls == ["run"]
        assert row_count(app) == 1
    else:
        assert_layer_rejected(app, response, "missing-key" if expected is None else "invalid-key")
        assert calls == []


@pytest.mark.parametrize("size", [10_000, 1_000_000])
@pytest.mark.parametrize("quoted", [False, True])
def test_c3_huge_keys_are_400(app_calls, size: int, quoted: bool) -> None:
    app, calls = app_calls
    key = "k" * size
    value = f'"{key}"' if quoted else key
    response = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": value})
    assert_layer_rejected(app, response, "invalid-key")
    assert calls == []


@pytest.mark.parametrize(
    "value",
    [
        "",
        " ",
        '""',
        '"',
        "f\u00fc\u00fc",  # UTF-8 on the wire, latin-1 in WSGI: non-ASCII either way
        '"\u00e9"',
        "\u00ff" * 10,
        "a b",
        "a\tb",
        "a,b",
        '"a","b"',
        "a;b=1",
        '"abc";=1',
        '"abc";A=1',
        "\\",
        '"\\x"',
        "\x7f",
        '"\x01"',
    ],
)
def test_c3_bad_header_values_are_400_and_store_nothing(app_calls, value: str) -> None:
    app, calls = app_calls
    response = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": value})
    assert_layer_rejected(app, response, "invalid-key")
    assert calls == []


def test_c3_random_header_values_never_500(app_calls) -> None:
    """Random latin-1 junk: exactly the values the parser accepts run, the rest are 400."""
    app, calls = app_calls
    rng = random.Random(1234)
    alphabet = [chr(c) for c in range(0x20, 0x100) if c != 0x7F]
    client = app.test_client()
    seen: set[str] = set()
    for i in range(150):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        try:
            key = parse_key([value])
        except InvalidKey:
            key = None
        response = client.post("/pay", json={"i": i}, headers={"Idempotency-Key": value})
        if key is None:
            assert response.status_code == 400, value
            assert json.loads(response.data)["code"] == "invalid-key"
        elif key in seen:
            assert response.status_code == 422, value  # same key, different body
        else:
            assert response.status_code == 201, value
            seen.add(key)
    assert len(calls) == len(seen) > 0


# -- bodies -------------------------------------------------------------------------------------


BODY_CONTENT_TYPES = [
    "application/json",
    "application/json; charset=latin-1",
    "application/vnd.api+json",
    "application/x-www-form-urlencoded",
    "application/x-www-form-urlencoded; charset=bogus",
    "multipart/form-data",
    "multipart/form-data; boundary=",
    "multipart/form-data; boundary=xyz",
    "text/plain",
    "application/octet-stream",
    "image/png",
    "text/",
    ";;;",
    "application/json+json",
    "x" * 1000,
    "",
]


@pytest.mark.parametrize("content_type", BODY_CONTENT_TYPES)
def test_binary_bodies_with_any_content_type_never_500(app_calls, content_type: str) -> None:
    app, calls = app_calls
    body = random.Random(content_type).randbytes(4096)
    client = app.test_client()
    headers = {"Idempotency-Key": "bin", "Content-Type": content_type}
    first = client.post("/pay", data=body, headers=headers)
    again = client.post("/pay", data=body, headers=headers)
    assert_handled(first)
    if "urlencoded" in content_type and refused_by_werkzeug_2(first, again, calls):
        return
    assert first.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true", "fingerprint is deterministic"
    assert calls == ["pay"]


@pytest.mark.parametrize("content_type", BODY_CONTENT_TYPES)
def test_empty_body_with_any_content_type_runs_normally(app_calls, content_type: str) -> None:
    app, calls = app_calls
    response = app.test_client().post(
        "/pay",
        input_stream=io.BytesIO(b""),  # raw: the test client would encode an empty multipart
        headers={"Idempotency-Key": "empty", "Content-Type": content_type, "Content-Length": "0"},
    )
    assert response.status_code == 201
    assert response.json["length"] == 0
    assert calls == ["pay"]


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b'{"a": }',
        b"[1, 2,, 3]",
        b"\xff\xfe\xfd",
        b'{"a": "\xff"}',
        b"NaN",
        b'{"a": 1e999999}',
        b"1" * 5000,  # beyond Python's int string limit
        b"[" * 100_000,  # recursion
        b'"\\ud800"',  # a lone surrogate
        b"\x00",
    ],
)
def test_malformed_json_with_a_key_never_500(app_calls, body: bytes) -> None:
    app, calls = app_calls
    client = app.test_client()
    kwargs = {"data": body, "content_type": "application/json", "headers": {"Idempotency-Key": "j"}}
    first = client.post("/pay", **kwargs)
    again = client.post("/pay", **kwargs)
    assert_handled(first)
    assert first.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert calls == ["pay"]


def test_view_that_parses_malformed_json_strictly_gets_flasks_400(make_app) -> None:
    """A view using ``request.json`` answers Flask's own 400; it is the view's answer and kept."""
    app, _ = make_app({"TESTING": False})
    calls: list[str] = []

    @app.post("/strict")
    @idempotent
    def strict():
        calls.append("strict")
        return jsonify(request.json)

    client = app.test_client()
    kwargs = {
        "data": b"{oops",
        "content_type": "application/json",
        "headers": {"Idempotency-Key": "s"},
    }
    first = client.post("/strict", **kwargs)
    again = client.post("/strict", **kwargs)
    assert first.status_code == again.status_code == 400
    assert calls == ["strict"]


@pytest.mark.parametrize(
    "body",
    [
        b"a=\xff\xfe&b=%ff%fe",
        b"%%%%=%%",
        b"=&=&&",
        b"a" * 100_000,
        b"\x00=\x00",
        "é=ü".encode("latin-1"),
    ],
)
def test_non_utf8_form_data_never_500(app_calls, body: bytes) -> None:
    app, calls = app_calls
    client = app.test_client()
    kwargs = {
        "data": body,
        "content_type": "application/x-www-form-urlencoded",
        "headers": {"Idempotency-Key": "f"},
    }
    first = client.post("/pay", **kwargs)
    again = client.post("/pay", **kwargs)
    assert_handled(first)
    if refused_by_werkzeug_2(first, again, calls):
        return
    assert first.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert calls == ["pay"]


@pytest.mark.parametrize(
    "body",
    [
        b'--xyz\r\nContent-Disposition: form-data; name="a"\r\n\r\nvalue',  # no end boundary
        b"--xyz--\r\n",
        b"garbage without any boundary",
        b'--xyz\r\nContent-Disposition: form-data; name="f"; filename="\xff.bin"\r\n'
        b"\r\n\xff\xfe\r\n--xyz--\r\n",
        b"--xyz\r\n\r\n\r\n--xyz--\r\n",
    ],
)
def test_malformed_multipart_never_500(app_calls, body: bytes) -> None:
    app, calls = app_calls
    client = app.test_client()
    kwargs = {
        "data": body,
        "content_type": "multipart/form-data; boundary=xyz",
        "headers": {"Idempotency-Key": "m"},
    }
    first = client.post("/pay", **kwargs)
    again = client.post("/pay", **kwargs)
    assert_handled(first)
    assert first.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert calls == ["pay"]


@pytest.mark.parametrize("query", ["?%ff=%fe", "?a=%00", "?" + "x=1&" * 2000, "?=&=", "?a[b]=c"])
def test_odd_query_strings_never_500(app_calls, query: str) -> None:
    app, calls = app_calls
    client = app.test_client()
    first = client.post("/pay" + query, json={}, headers={"Idempotency-Key": "q"})
    again = client.post("/pay" + query, json={}, headers={"Idempotency-Key": "q"})
    assert first.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert calls == ["pay"]


@pytest.mark.parametrize(
    "path", ["/files/a%00b", "/files/%ff%fe", "/files/%ed%a0%80", "/files/" + "x" * 100_000]
)
def test_hostile_paths_never_500(make_app, path: str) -> None:
    app, _ = make_app({"TESTING": False})
    calls: list[str] = []

    @app.post("/files/<path:name>")
    @idempotent
    def files(name: str):
        calls.append(name)
        return "ok", 201

    client = app.test_client()
    first = client.post(path, headers={"Idempotency-Key": "p"})
    again = client.post(path, headers={"Idempotency-Key": "p"})
    assert first.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert len(calls) == 1


def test_random_bodies_and_keys_fuzz(app_calls) -> None:
    """A seeded mix of everything above: every answer is < 500, layer errors store nothing."""
    app, _ = app_calls
    rng = random.Random(99)
    client = app.test_client()
    content_types = [*BODY_CONTENT_TYPES, "application/json"]
    for i in range(120):
        body = rng.randbytes(rng.randint(0, 2048))
        key = rng.choice([f"k{i}", f'"k{i}"', "", "a b", '"\x01"', "k" * 300])
        response = client.post(
            "/pay",
            data=body,
            headers={"Idempotency-Key": key, "Content-Type": rng.choice(content_types)},
        )
        assert_handled(response)


def test_required_endpoint_with_garbage_stores_nothing(app_calls) -> None:
    app, calls = app_calls
    client = app.test_client()
    assert_layer_rejected(app, client.post("/required", data=os.urandom(100)), "missing-key")
    assert_layer_rejected(
        app, client.post("/required", headers={"Idempotency-Key": "\u00ff"}), "invalid-key"
    )
    assert calls == []


@pytest.mark.parametrize("value", ['"broken', "a b", "k" * 10_000, ""])
def test_c1_invalid_key_on_an_ignored_method_or_view_is_ignored(make_app, value: str) -> None:
    """C1 before C3: a key the layer does not apply to is not even parsed."""
    app, _ = make_app({"TESTING": False})
    calls: list[str] = []

    @app.route("/thing", methods=["GET", "POST"])
    @idempotent
    def thing():
        calls.append(request.method)
        return "ok"

    @app.post("/plain")
    def plain():
        calls.append("plain")
        return "ok"

    client = app.test_client()
    assert client.get("/thing", headers={"Idempotency-Key": value}).status_code == 200
    assert client.post("/plain", headers={"Idempotency-Key": value}).status_code == 200
    assert calls == ["GET", "plain"]
    assert row_count(app) == 0
