"""The fingerprint still covers the body when an earlier hook touched the request (C6, C7).

CSRF middleware and the like read ``request.form`` on every POST, before this
layer's hook. For a non-form body that parses nothing and leaves the stream
unread; the body must still count, or two different bodies under one key would
replay each other instead of answering 422.
"""

from __future__ import annotations

from flask import request

from flask_idempotency import Idempotency, idempotent


def test_c7_raw_body_counts_after_an_earlier_hook_read_the_form(tmp_path) -> None:
    from flask import Flask

    app = Flask("hooks_first", instance_path=str(tmp_path))
    app.config.update(
        TESTING=True,
        IDEMPOTENCY_DATABASE_URI=f"sqlite:///{tmp_path}/hooks.sqlite3",
        IDEMPOTENCY_CREATE_TABLE=True,
    )

    @app.before_request
    def csrf_like():  # registered before the extension's hook, so it runs first
        request.form.get("csrf_token")

    Idempotency(app)
    received: list[bytes] = []

    @app.post("/upload")
    @idempotent
    def upload():
        received.append(request.get_data())
        return "stored", 201

    client = app.test_client()
    headers = {"Idempotency-Key": "upload-1", "Content-Type": "application/octet-stream"}
    assert client.post("/upload", data=b"first body", headers=headers).status_code == 201
    other = client.post("/upload", data=b"another body", headers=headers)
    assert other.status_code == 422, "a different body under the same key must not replay"
    same = client.post("/upload", data=b"first body", headers=headers)
    assert same.headers.get("Idempotent-Replayed") == "true"
    assert received == [b"first body"]  # and the view saw the exact bytes


def test_c7_multipart_fields_and_files_count_after_an_earlier_hook_parsed_them(tmp_path) -> None:
    import io

    from flask import Flask

    app = Flask("hooks_multipart", instance_path=str(tmp_path))
    app.config.update(
        TESTING=True,
        IDEMPOTENCY_DATABASE_URI=f"sqlite:///{tmp_path}/mp.sqlite3",
        IDEMPOTENCY_CREATE_TABLE=True,
    )

    @app.before_request
    def csrf_like():  # parses the multipart body (and consumes the stream) first
        request.form.get("csrf_token")

    Idempotency(app)
    received: list[bytes] = []

    @app.post("/upload")
    @idempotent
    def upload():
        received.append(request.files["doc"].read())
        return "stored", 201

    def send(content: bytes):  # type: ignore[no-untyped-def]
        return app.test_client().post(
            "/upload",
            data={"title": "t", "doc": (io.BytesIO(content), "doc.txt")},
            headers={"Idempotency-Key": "mp-1"},
            content_type="multipart/form-data",
        )

    assert send(b"version one").status_code == 201
    assert send(b"version two").status_code == 422
    assert send(b"version one").headers.get("Idempotent-Replayed") == "true"
    assert received == [b"version one"]
