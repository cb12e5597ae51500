"""Measure what one large request body costs a worker: peak RSS growth and spooled files.

Run in a fresh process (``python -m tests.support.body_copies KIND MIB MODE``) so the
peak (``ru_maxrss``) belongs to this one request. The body is read from a file on
disk, never held by the "client", so every byte of growth is the server's. The
view reads the form the way an application does and records, while it runs, the
temporary files open in this process and their sizes: the copies kept on disk.

KIND is ``urlencoded`` or ``multipart``; MODE is ``layer`` (an ``@idempotent``
view with a key) or ``plain`` (the same view without the layer: the baseline,
what Flask itself costs). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile

BOUNDARY = "b0undary"


def _write_body(path: str, kind: str, size: int) -> str:
    """Write a body of about ``size`` bytes to ``path``; return its content type."""
    chunk = b"x" * (1 << 20)
    with open(path, "wb") as out:
        if kind == "urlencoded":
            out.write(b"note=hi&data=")
            for _ in range(size // len(chunk)):
                out.write(chunk)
            return "application/x-www-form-urlencoded"
        out.write(
            (
                f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="note"\r\n\r\nhi\r\n'
                f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="upload";'
                ' filename="a.bin"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
        )
        for _ in range(size // len(chunk)):
            out.write(chunk)
        out.write(f"\r\n--{BOUNDARY}--\r\n".encode())
    return f"multipart/form-data; boundary={BOUNDARY}"


def _spooled_files(tmpdir: str) -> tuple[int, int]:
    """Temporary files this process holds open under ``tmpdir``: (count, bytes)."""
    count = size = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(tmpdir):
            count += 1
            size += os.fstat(int(fd)).st_size
    return count, size


def measure(kind: str, mib: int, mode: str, work: str) -> dict[str, int]:
    from flask import Flask, jsonify, request
    from werkzeug.test import EnvironBuilder

    from flask_idempotency import Idempotency, idempotent

    spool_dir = os.path.join(work, "spool")
    os.mkdir(spool_dir)
    app = Flask("body_copies", instance_path=work)
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{work}/idem.sqlite3"
    app.config["MAX_FORM_MEMORY_SIZE"] = None  # Werkzeug 3.1 caps form fields at 500 kB
    app.config["IDEMPOTENCY_MAX_REQUEST_BYTES"] = 0  # measured bodies are over its 10 MiB
    Idempotency(app)
    with app.app_context():
        app.extensions["idempotency"].store.create_table()
    seen: dict[str, int] = {}

    def view():  # reads the form as an app does, without copying the upload into memory
        form_chars = sum(len(v) for v in request.form.values())
        file_bytes = sum(
            sum(map(len, iter(lambda f=f: f.read(1 << 16), b""))) for f in request.files.values()
        )
        seen["spooled_files"], seen["spooled_bytes"] = _spooled_files(spool_dir)
        return jsonify(form=form_chars, files=file_bytes), 201

    app.add_url_rule("/plain", "plain", view, methods=["POST"])
    app.add_url_rule("/layer", "layer", idempotent(lambda: view()), methods=["POST"])

    body_path = os.path.join(work, "body")
    content_type = _write_body(body_path, kind, mib << 20)
    body_size = os.path.getsize(body_path)

    def post(path: str, stream, length: int, key: str) -> int:
        builder = EnvironBuilder(
            path=path,
            method="POST",
            input_stream=stream,
            content_length=length,
            content_type=content_type,
            headers={"Idempotency-Key": key},
        )
        status: list[str] = []
        body = app.wsgi_app(builder.get_environ(), lambda s, h, e=None: status.append(s))
        b"".join(body)
        getattr(body, "close", lambda: None)()
        return int(status[0].split()[0])

    # Warm up every code path with a small body, so imports and pools are not counted.
    small_path = os.path.join(work, "small")
    _write_body(small_path, kind, 0)
    with open(small_path, "rb") as small:
        assert post("/" + mode, small, os.path.getsize(small_path), "warm-up") == 201
    tempfile.tempdir = spool_dir
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(body_path, "rb") as stream:
        status = post("/" + mode, stream, body_size, "measured")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    leftover = len(os.listdir(spool_dir))
    return {
        "status": status,
        "body_bytes": body_size,
        "rss_before": before,
        "rss_peak": peak,
        "rss_growth": peak - before,
        "spooled_files": seen.get("spooled_files", -1),
        "spooled_bytes": seen.get("spooled_bytes", -1),
        "files_left_in_tmpdir": leftover,
    }


def main() -> None:
    # This run's own directory, removed by this run alone: measurements run side by side
    # in a parallel suite, and one that swept every body_copies_* it had not seen before
    # removed another's spool while it ran.
    work = tempfile.mkdtemp(prefix="body_copies_")
    try:
        print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), sys.argv[3], work)))
    finally:
        tempfile.tempdir = None
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
