"""What makes two requests the same (C5, C6, C31) and what the view still sees (X18).

Fingerprints are computed on real Flask requests (``app.test_request_context``),
so content-type handling, form parsing and URL matching are Flask's own.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
from flask import Flask, jsonify, request
from sqlalchemy import func, select
from werkzeug.test import EnvironBuilder

from flask_idempotency import idempotent
from flask_idempotency.fingerprint import (
    ANONYMOUS_SCOPE,
    default_scope,
    key_digest,
    request_fingerprint,
)


@pytest.fixture(scope="module")
def fp_app() -> Flask:
    app = Flask("fingerprint_test")
    app.config["SECRET_KEY"] = "fingerprint-tests"  # keys the Authorization scope

    @app.route("/pay", methods=["POST", "PATCH", "PUT"])
    def pay():
        return ""

    @app.post("/refund")
    def refund():
        return ""

    @app.post("/items/<int:item_id>")
    def item(item_id: int):
        return ""

    @app.post("/files/<path:name>")
    def files(name: str):
        return ""

    return app


def fp(app: Flask, path: str = "/pay", method: str = "POST", **kwargs) -> str:
    with app.test_request_context(path, method=method, **kwargs):
        return request_fingerprint(request)


def row_count(app: Flask) -> int:
    store = app.extensions["idempotency"].store
    with store.autocommit.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(store.table)).scalar_one())


# -- JSON -----------------------------------------------------------------------------------


def test_c6_json_key_order_and_whitespace_do_not_matter(fp_app) -> None:
    base = fp(fp_app, data=b'{"a":1,"b":{"x":[1,2],"y":null}}', content_type="application/json")
    variants = [
        b'{"b":{"y":null,"x":[1,2]},"a":1}',
        b'{\n  "a": 1,\n  "b": {\n    "x": [ 1, 2 ],\n    "y": null\n  }\n}\n',
        b' \t{"b" : {"x":[1 ,2] , "y" :null} , "a":1}  ',
    ]
    for body in variants:
        assert fp(fp_app, data=body, content_type="application/json") == base
    assert fp(fp_app, json={"b": {"y": None, "x": [1, 2]}, "a": 1}) == base


@pytest.mark.parametrize(
    "other",
    [
        b'{"a":2,"b":{"x":[1,2],"y":null}}',  # a value
        b'{"a":1,"b":{"x":[2,1],"y":null}}',  # array order matters
        b'{"a":1,"b":{"x":[1,2],"y":false}}',
        b'{"a":"1","b":{"x":[1,2],"y":null}}',  # type of a value
        b'{"a":1,"b":{"x":[1,2]}}',  # a missing key
        b'{"a":1,"b":{"x":[1,2],"y":null},"c":0}',  # an extra key
        b'{"A":1,"b":{"x":[1,2],"y":null}}',  # key case
    ],
)
def test_c6_any_json_value_change_changes_the_fingerprint(fp_app, other: bytes) -> None:
    base = fp(fp_app, data=b'{"a":1,"b":{"x":[1,2],"y":null}}', content_type="application/json")
    assert fp(fp_app, data=other, content_type="application/json") != base


@pytest.mark.parametrize(
    "content_type",
    [
        "application/json; charset=utf-8",
        "application/vnd.api+json",
        "application/merge-patch+json",
        "application/problem+json",
    ],
)
def test_c6_json_variants_are_canonicalised(fp_app, content_type: str) -> None:
    a = fp(fp_app, data=b'{"a": 1, "b": 2}', content_type=content_type)
    b = fp(fp_app, data=b'{"b":2,"a":1}', content_type=content_type)
    c = fp(fp_app, data=b'{"b":2,"a":3}', content_type=content_type)
    assert a == b != c


def test_c6_json_string_escapes_are_canonical(fp_app) -> None:
    """``"\\u00e9"`` and ``"é"`` are the same JSON value."""
    a = fp(fp_app, data=b'{"n":"\\u00e9"}', content_type="application/json")
    b = fp(fp_app, data='{"n":"é"}'.encode(), content_type="application/json")
    assert a == b


def test_c6_malformed_json_falls_back_to_raw_bytes(fp_app) -> None:
    broken = b'{"a": 1,'
    a = fp(fp_app, data=broken, content_type="application/json")
    assert a == fp(fp_app, data=broken, content_type="application/json")
    assert a != fp(fp_app, data=b'{"a":1,', content_type="application/json")
    assert a != fp(fp_app, data=b'{"a": 2,', content_type="application/json")


@pytest.mark.parametrize("body", [b"", b"\xff\xfe\x00", b"[1, 2", b"nul", b"NaN", b'"\\ud800"'])
def test_c6_odd_json_bodies_fingerprint_without_error(fp_app, body: bytes) -> None:
    assert fp(fp_app, data=body, content_type="application/json") == fp(
        fp_app, data=body, content_type="application/json"
    )


# -- query, method, route ---------------------------------------------------------------------


def test_c6_query_string_is_sorted_by_name(fp_app) -> None:
    a = fp(fp_app, "/pay?a=1&b=2&c=3", json={})
    assert fp(fp_app, "/pay?c=3&b=2&a=1", json={}) == a
    assert fp(fp_app, "/pay?a=1&b=2&c=4", json={}) != a
    assert fp(fp_app, "/pay?a=1&b=2", json={}) != a
    assert fp(fp_app, "/pay?a=1&b=2&c=3&d=", json={}) != a
    assert fp(fp_app, "/pay", json={}) != fp(fp_app, "/pay?x=", json={})
    # A repeated name keeps the order of its values (issue 26 item 1).
    assert fp(fp_app, "/pay?a=1&a=2", json={}) != fp(fp_app, "/pay?a=2&a=1", json={})
    assert fp(fp_app, "/pay?a=1&b=0&a=2", json={}) == fp(fp_app, "/pay?b=0&a=1&a=2", json={})


def test_c6_method_route_and_path_values_matter(fp_app) -> None:
    body = {"amount": 1}
    post = fp(fp_app, "/pay", "POST", json=body)
    assert fp(fp_app, "/pay", "PATCH", json=body) != post
    assert fp(fp_app, "/pay", "PUT", json=body) != post
    assert fp(fp_app, "/refund", "POST", json=body) != post
    assert fp(fp_app, "/items/1", json=body) != fp(fp_app, "/items/2", json=body)
    assert fp(fp_app, "/items/1", json=body) == fp(fp_app, "/items/01", json=body)
    assert fp(fp_app, "/files/a/b", json=body) != fp(fp_app, "/files/a", json=body)


def test_c6_parts_cannot_run_together(fp_app) -> None:
    """Length-prefixed parts: moving bytes between path value and query changes the hash."""
    assert fp(fp_app, "/files/ab?c=d", json={}) != fp(fp_app, "/files/a?bc=d", json={})


# -- forms, multipart, raw ---------------------------------------------------------------------


def test_c6_form_field_order_does_not_matter(fp_app) -> None:
    ct = "application/x-www-form-urlencoded"
    a = fp(fp_app, data=b"a=1&b=2&c=3", content_type=ct)
    assert fp(fp_app, data=b"c=3&a=1&b=2", content_type=ct) == a
    assert fp(fp_app, data={"b": "2", "c": "3", "a": "1"}) == a
    assert fp(fp_app, data=b"a=1&b=2&c=4", content_type=ct) != a
    assert fp(fp_app, data=b"a=1&b=2", content_type=ct) != a
    assert fp(fp_app, data=b"a=1&b=2&c=3&c=3", content_type=ct) != a


def multipart(content: bytes, filename: str = "doc.bin", **fields: str) -> dict:
    data: dict = dict(fields)
    data["upload"] = (io.BytesIO(content), filename, "application/octet-stream")
    return data


def test_c6_multipart_hashes_file_content(fp_app) -> None:
    a = fp(fp_app, data=multipart(b"hello", note="x"))
    assert fp(fp_app, data=multipart(b"hello", note="x")) == a
    assert fp(fp_app, data=multipart(b"hellO", note="x")) != a
    assert fp(fp_app, data=multipart(b"hello", note="y")) != a
    assert fp(fp_app, data=multipart(b"hello", filename="other.bin", note="x")) != a


def test_c6_raw_bytes_are_hashed_exactly(fp_app) -> None:
    body = bytes(range(256))
    a = fp(fp_app, data=body, content_type="application/octet-stream")
    assert fp(fp_app, data=body, content_type="application/octet-stream") == a
    assert fp(fp_app, data=body[:-1] + b"\x00", content_type="application/octet-stream") != a
    assert fp(fp_app, data=body + b"\x00", content_type="application/octet-stream") != a
    assert fp(fp_app, data=b"a b", content_type="text/plain") != fp(
        fp_app, data=b"a  b", content_type="text/plain"
    )


def test_c6_content_type_class_is_part_of_the_fingerprint(fp_app) -> None:
    """The same bytes as JSON and as plain text are not the same request."""
    body = b'{"a":1}'
    assert fp(fp_app, data=body, content_type="application/json") != fp(
        fp_app, data=body, content_type="text/plain"
    )


# -- key digest and scope -----------------------------------------------------------------------


def test_c5_key_digest_differs_by_scope() -> None:
    assert key_digest("tenant-a", "k") != key_digest("tenant-b", "k")
    assert key_digest("tenant-a", "k") == key_digest("tenant-a", "k")
    assert key_digest("ab", "c") != key_digest("a", "bc")
    assert len(key_digest("s", "k")) == 64
    assert "k" * 20 not in key_digest("s", "k" * 20)


def test_c5_default_scope_is_a_digest_of_authorization(fp_app) -> None:
    with fp_app.test_request_context("/pay", method="POST"):
        assert default_scope(request) == ANONYMOUS_SCOPE
    scopes = set()
    for token in ("Bearer alice", "Bearer bob"):
        with fp_app.test_request_context("/pay", method="POST", headers={"Authorization": token}):
            scope = default_scope(request)
            assert token not in scope
            assert scope != "auth:" + hashlib.sha256(token.encode()).hexdigest()  # keyed
            scopes.add(scope)
    assert len(scopes) == 2


# -- through the app: the view sees the exact body (X18, C31) ----------------------------------


@pytest.fixture
def echo_app(make_app):
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @app.post("/echo")
    @idempotent
    def echo():
        calls.append(request.mimetype)
        files = {
            name: hashlib.sha256(upload.read()).hexdigest()
            for name, upload in request.files.items()
        }
        raw = request.get_data()
        return jsonify(
            sha=hashlib.sha256(raw).hexdigest(),
            length=len(raw),
            form=sorted(request.form.items(multi=True)),
            files=files,
            json=request.get_json(silent=True),
        )

    @app.post("/stream")
    @idempotent
    def stream():
        calls.append("stream")
        digest, total = hashlib.sha256(), 0
        while chunk := request.stream.read(65536):
            digest.update(chunk)
            total += len(chunk)
        return jsonify(sha=digest.hexdigest(), length=total)

    return app, calls


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"b": 2,  "a": [1, 2, 3]}', "application/json"),
        (b'{"b": 2}', "application/merge-patch+json"),
        (b"{not json", "application/json"),
        (bytes(range(256)), "application/octet-stream"),
        ("plain text ü".encode(), "text/plain; charset=utf-8"),
        (b"<a>xml</a>", "application/xml"),
        (b"", "application/octet-stream"),
        (b"no content type", None),
    ],
)
def test_x18_view_sees_exact_raw_body(echo_app, body: bytes, content_type: str | None) -> None:
    app, calls = echo_app
    kwargs = {"data": body}
    if content_type:
        kwargs["content_type"] = content_type
    response = app.test_client().post("/echo", headers={"Idempotency-Key": "k"}, **kwargs)
    assert response.status_code == 200
    assert response.json["sha"] == hashlib.sha256(body).hexdigest()
    assert response.json["length"] == len(body)
    if content_type and "json" in content_type and body.startswith(b'{"'):
        assert response.json["json"] == json.loads(body)
    assert len(calls) == 1


def test_x18_view_sees_form_fields(echo_app) -> None:
    app, _ = echo_app
    response = app.test_client().post(
        "/echo", data={"b": "2", "a": "1"}, headers={"Idempotency-Key": "k"}
    )
    assert response.json["form"] == [["a", "1"], ["b", "2"]]


def multipart_body(boundary: str, content: bytes) -> bytes:
    return (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="note"\r\n\r\nhi\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="upload"; filename="a.bin"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )


@pytest.mark.parametrize("size", [10, 3 * 1024 * 1024])
def test_x18_i9_9_raw_bytes_of_forms_via_a_hook_before_the_layer(tmp_path, size: int) -> None:
    """X18/C31: a form is parsed once and its raw bytes are not kept on top (issue 9.9).

    A webhook that verifies a signature over the raw form body caches it in a
    ``before_request`` hook registered before ``init_app``, as it would without
    the layer; it then sees the exact bytes and the fields, and a retry replays.
    """
    from flask import Flask

    from flask_idempotency import Idempotency

    app = Flask("raw_forms", instance_path=str(tmp_path))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/idem.sqlite3"

    @app.before_request
    def keep_raw_body():
        request.get_data(cache=True)

    Idempotency(app)
    with app.app_context():
        app.extensions["idempotency"].store.create_table()
    seen: list[tuple] = []

    @app.post("/hook")
    @idempotent
    def hook():
        raw = request.get_data()  # what a signature check does
        seen.append((hashlib.sha256(raw).hexdigest(), dict(request.form), list(request.files)))
        return "ok"

    client = app.test_client()
    form = b"a=1&b=" + b"x" * size + b"&c=%C3%BC"
    for _ in range(2):
        answer = client.post(
            "/hook",
            data=form,
            content_type="application/x-www-form-urlencoded",
            headers={"Idempotency-Key": "form"},
        )
    assert answer.headers.get("Idempotent-Replayed") == "true"
    assert len(seen) == 1
    assert seen[-1][0] == hashlib.sha256(form).hexdigest()
    assert seen[-1][1] == {"a": "1", "b": "x" * size, "c": "ü"}
    body = multipart_body("b0undary", os.urandom(size))
    client.post(
        "/hook",
        data=body,
        content_type="multipart/form-data; boundary=b0undary",
        headers={"Idempotency-Key": "multipart"},
    )
    assert seen[-1][0] == hashlib.sha256(body).hexdigest()
    assert seen[-1][1] == {"note": "hi"} and seen[-1][2] == ["upload"]


def test_x18_i9_9_without_such_a_hook_the_view_gets_the_parsed_form(make_app) -> None:
    """C31: the layer parsed the form as Flask would; the view reads fields and files."""
    app, _ = make_app()
    seen: list[tuple] = []

    @app.post("/form")
    @idempotent
    def form_view():
        files = {k: f.read() for k, f in request.files.items()}
        seen.append((dict(request.form), files))
        return "ok"

    content = os.urandom(3 * 1024 * 1024)
    app.test_client().post(
        "/form",
        data=multipart_body("b0undary", content),
        content_type="multipart/form-data; boundary=b0undary",
        headers={"Idempotency-Key": "k"},
    )
    assert seen == [({"note": "hi"}, {"upload": content})]


def test_c6_multipart_boundary_does_not_matter(make_app) -> None:
    """A retry's client picks a new boundary; it is the same request (replay, not 422)."""
    app, _ = make_app()
    calls: list[int] = []

    @app.post("/upload")
    @idempotent
    def upload():
        calls.append(1)
        return jsonify(size=len(request.files["upload"].read()))

    client = app.test_client()
    content = os.urandom(1000)
    for boundary in ("first-boundary", "second-boundary"):
        response = client.post(
            "/upload",
            data=multipart_body(boundary, content),
            content_type=f"multipart/form-data; boundary={boundary}",
            headers={"Idempotency-Key": "k"},
        )
        assert response.status_code == 200 and response.json == {"size": 1000}
    assert response.headers.get("Idempotent-Replayed") == "true"
    assert calls == [1]


def test_x18_form_parsed_before_the_layer_still_fingerprints(make_app) -> None:
    app, _ = make_app()
    app.before_request_funcs.setdefault(None, []).insert(0, lambda: request.form and None)
    calls: list[dict] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(dict(request.form))
        return "ok"

    client = app.test_client()
    client.post("/pay", data={"a": "1"}, headers={"Idempotency-Key": "k"})
    assert (
        client.post("/pay", data={"a": "1"}, headers={"Idempotency-Key": "k"}).headers.get(
            "Idempotent-Replayed"
        )
        == "true"
    )
    assert client.post("/pay", data={"a": "2"}, headers={"Idempotency-Key": "k"}).status_code == 422
    assert calls == [{"a": "1"}]


def test_x18_view_can_read_uploaded_files_after_fingerprinting(echo_app) -> None:
    app, calls = echo_app
    content = os.urandom(4096)
    client = app.test_client()
    first = client.post(
        "/echo", data=multipart(content, note="n"), headers={"Idempotency-Key": "k"}
    )
    assert first.status_code == 200
    assert first.json["files"] == {"upload": hashlib.sha256(content).hexdigest()}
    assert first.json["form"] == [["note", "n"]]
    again = client.post(
        "/echo", data=multipart(content, note="n"), headers={"Idempotency-Key": "k"}
    )
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.data == first.data
    changed = client.post(
        "/echo", data=multipart(content + b"!", note="n"), headers={"Idempotency-Key": "k"}
    )
    assert changed.status_code == 422
    assert len(calls) == 1


def test_c31_large_body_is_spooled_and_read_completely(echo_app) -> None:
    """A body over 1 MiB is spooled to disk; the view still reads every byte of it."""
    app, calls = echo_app
    body = os.urandom(3 * 1024 * 1024 + 17)
    client = app.test_client()
    for path in ("/stream", "/echo"):
        response = client.post(
            path,
            data=body,
            content_type="application/octet-stream",
            headers={"Idempotency-Key": f"big-{path}"},
        )
        assert response.status_code == 200
        assert response.json["length"] == len(body)
        assert response.json["sha"] == hashlib.sha256(body).hexdigest()
    again = client.post(
        "/stream",
        data=body,
        content_type="application/octet-stream",
        headers={"Idempotency-Key": "big-/stream"},
    )
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert len(calls) == 2


def post_large_multipart(client, path: str, data: dict, headers: dict):
    """POST a big multipart body and close the temp file Werkzeug's test builder spools it to.

    (The test client leaves that file open; with warnings as errors it would fail
    whichever test runs next.)
    """
    builder = EnvironBuilder(path=path, method="POST", data=data, headers=headers)
    environ = builder.get_environ()
    try:
        return client.open(environ)
    finally:
        environ["wsgi.input"].close()
        builder.close()


def test_c31_large_multipart_upload(echo_app) -> None:
    app, _ = echo_app
    content = os.urandom(2 * 1024 * 1024)
    response = post_large_multipart(
        app.test_client(), "/echo", multipart(content), {"Idempotency-Key": "big-upload"}
    )
    assert response.status_code == 200
    assert response.json["files"] == {"upload": hashlib.sha256(content).hexdigest()}


def test_c6_malformed_json_still_deduplicates(echo_app) -> None:
    app, calls = echo_app
    client = app.test_client()
    kwargs = {"data": b'{"a": ', "content_type": "application/json"}
    first = client.post("/echo", headers={"Idempotency-Key": "bad"}, **kwargs)
    again = client.post("/echo", headers={"Idempotency-Key": "bad"}, **kwargs)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("Idempotent-Replayed") == "true"
    other = client.post(
        "/echo", headers={"Idempotency-Key": "bad"}, data=b'{"a":', content_type="application/json"
    )
    assert other.status_code == 422
    assert len(calls) == 1


def test_c6_reordered_json_replays_through_the_app(echo_app) -> None:
    app, calls = echo_app
    client = app.test_client()
    first = client.post(
        "/echo",
        data=b'{"a":1,"b":2}',
        content_type="application/json",
        headers={"Idempotency-Key": "k"},
    )
    again = client.post(
        "/echo",
        data=b'{ "b": 2, "a": 1 }',
        content_type="application/json",
        headers={"Idempotency-Key": "k"},
    )
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.data == first.data  # the original's echo, not the retry's bytes
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("data", "content_type"),
    [
        (b"x" * 2048, "application/octet-stream"),
        (b'{"a":"' + b"x" * 2048 + b'"}', "application/json"),
        (b"a=" + b"x" * 2048, "application/x-www-form-urlencoded"),
    ],
)
def test_c31_max_content_length_answers_413_and_stores_nothing(
    make_app, data: bytes, content_type: str
) -> None:
    app, _ = make_app({"MAX_CONTENT_LENGTH": 1024})
    calls: list[int] = []

    @app.post("/upload")
    @idempotent
    def upload():
        calls.append(1)
        return jsonify(n=len(request.get_data()))

    response = app.test_client().post(
        "/upload", data=data, content_type=content_type, headers={"Idempotency-Key": "k"}
    )
    assert response.status_code == 413
    assert calls == []
    assert row_count(app) == 0
    small = app.test_client().post(
        "/upload", data=b"ok", content_type=content_type, headers={"Idempotency-Key": "k"}
    )
    assert small.status_code == 200
    assert calls == [1]


def test_c31_max_content_length_multipart(make_app) -> None:
    app, _ = make_app({"MAX_CONTENT_LENGTH": 1024})
    calls: list[int] = []

    @app.post("/upload")
    @idempotent
    def upload():
        calls.append(1)
        return "ok"

    response = app.test_client().post(
        "/upload", data=multipart(os.urandom(4096)), headers={"Idempotency-Key": "k"}
    )
    assert response.status_code == 413
    assert calls == []
    assert row_count(app) == 0
