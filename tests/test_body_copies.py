"""A large form body is held once (issue 9 item 9; CONTRACT C31).

Each measurement runs in a fresh interpreter (``tests/support/body_copies.py``):
the body streams from a file, so the growth of the peak RSS (``ru_maxrss``) is
the server's alone, and the view lists the temporary files open while it runs.
The baseline is the same view without the layer, i.e. what Flask itself costs:
the layer may add nothing that scales with the body. The bounds are ratios of
the body size, not timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MIB = 40
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(kind: str, mode: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.body_copies", kind, str(MIB), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"{kind} {mode} exited {result.returncode}: {result.stderr[-3000:]}"
    )
    figures: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["status"] == 201, figures
    return figures


def test_i9_9_c31_urlencoded_form_costs_what_flask_costs() -> None:
    """C31: an urlencoded form is parsed once; the layer adds no body-sized copy."""
    plain = measure("urlencoded", "plain")
    layer = measure("urlencoded", "layer")
    body = layer["body_bytes"]
    extra = layer["rss_growth"] - plain["rss_growth"]
    print(f"urlencoded {MIB} MiB: plain +{plain['rss_growth']} B, layer +{layer['rss_growth']} B")
    assert extra < 0.5 * body, (plain, layer)
    assert layer["spooled_files"] == 0


def test_i9_9_c31_multipart_upload_is_spooled_once() -> None:
    """C31: a multipart upload leaves one spooled copy on disk and none in memory."""
    plain = measure("multipart", "plain")
    layer = measure("multipart", "layer")
    body = layer["body_bytes"]
    print(f"multipart {MIB} MiB: plain {plain['spooled_files']} file(s), layer {layer}")
    assert layer["spooled_files"] == plain["spooled_files"] == 1, (plain, layer)
    assert layer["spooled_bytes"] < 1.5 * body, layer
    assert layer["rss_growth"] < 0.5 * body, layer
    assert layer["files_left_in_tmpdir"] == 0


@pytest.mark.parametrize("kind", ["urlencoded", "multipart"])
def test_i9_9_c6_the_form_fingerprint_did_not_change(kind: str) -> None:
    """C6: hashing the fields piece by piece gives the fingerprint the whole JSON gives
    (fields, then uploads, each sorted by name only, stably: issue 26 item 2)."""
    import hashlib

    from flask import Flask, request

    from flask_idempotency import fingerprint

    app = Flask(__name__)
    fields = {"b": "x" * 200_000 + 'ü"\\\n\u2028', "a": "1", "é": "", "c": "\x00"}
    kwargs = {"data": dict(fields)}
    if kind == "multipart":
        import io

        kwargs["data"]["up"] = (io.BytesIO(b"file-bytes" * 10_000), "f.bin", "x/y")
    with app.test_request_context("/", method="POST", **kwargs):
        digest = hashlib.sha256()
        fingerprint._hash_body(request, request.mimetype, digest)
        rows = [["f", k, v] for k, v in request.form.items(multi=True)]
        if kind == "multipart":
            upload = request.files["up"]
            content = hashlib.sha256(upload.read()).hexdigest()
            upload.seek(0)
            rows.append(["file", "up", "f.bin", "x/y", content])
        rows.sort(key=lambda row: (row[0], row[1]))  # by kind and name only, stably (C6)
        expected = hashlib.sha256(
            (b"form:" if kind == "urlencoded" else b"multipart:")
            + json.dumps(rows, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        )
    assert digest.hexdigest() == expected.hexdigest()
