"""What fingerprinting a JSON body costs in memory and CPU (C31, issue 34 item 4).

C31: fingerprinting holds the body at most once plus a bounded working set; the peak
stays within the body and 1 MiB. Parsing a body into Python objects to canonicalise it
costs up to about 40 times its size for the worst shapes (an anonymous 10 MiB body of
``[[],[],…]`` to a view that answers 401 took +274–280 MiB and about a second of CPU
before the fix), so JSON is canonicalised only up to
:data:`~flask_idempotency.fingerprint.CANONICAL_JSON_MAX_BYTES` and hashed byte for byte
above it. Measured with ``tracemalloc`` over a whole protected request, in process.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from flask import jsonify

from flask_idempotency import fingerprint, idempotent

MIB = 1024 * 1024
#: The largest JSON body fingerprinted as canonical JSON (the worst case for memory).
CANONICAL_JSON_MAX_BYTES = getattr(fingerprint, "CANONICAL_JSON_MAX_BYTES", 16 * 1024)


def _fill(open_: bytes, item: bytes, close: bytes, size: int) -> bytes:
    """``open_ item,item,… close`` of at most ``size`` bytes."""
    count = (size - len(open_) - len(close) + 1) // (len(item) + 1)
    return open_ + b",".join([item] * count) + close


SHAPES: dict[str, Callable[[int], bytes]] = {
    "small containers": lambda size: _fill(b"[", b"[]", b"]", size),
    "small objects": lambda size: _fill(b"[", b"{}", b"]", size),
    "small numbers": lambda size: _fill(b"[", b"0", b"]", size),
    "floats": lambda size: _fill(b"[", b"1.5", b"]", size),
    "many keys": lambda size: (
        b"{"
        + b",".join(b'"%d":0' % n for n in range(size // 12))[: size - 2].rsplit(b",", 1)[0]
        + b"}"
    ),
    "deep nesting": lambda size: b"[" * (size // 2) + b"]" * (size // 2),
    "nesting within the recursion limit": lambda size: (
        (b'{"a":' * 400 + b"[]" + b"}" * 400) + b" " * (size - 2402)
    ),
    "long string": lambda size: b'["' + b"x" * (size - 4) + b'"]',
    "non-ASCII string": lambda size: b'["' + "\U0001f600".encode() * ((size - 4) // 4) + b'"]',
    "big numbers": lambda size: _fill(b"[", b"9" * 4000, b"]", size),
}


def _request_peak(make_app: Any, body: bytes) -> tuple[int, float, int]:
    """The peak traced memory, the CPU seconds and the status of one protected request
    with ``body`` to a view that answers 401 without reading it (the attack: anonymous,
    before any authentication decorator)."""
    app, _ = make_app({"IDEMPOTENCY_MAX_REQUEST_BYTES": 16 * MIB})

    @app.post("/orders")
    @idempotent
    def orders() -> Any:
        return jsonify(error="who are you?"), 401

    client = app.test_client()
    headers = {"Idempotency-Key": "warm-up", "Content-Type": "application/json"}
    assert client.post("/orders", data=b"{}", headers=headers).status_code == 401
    headers["Idempotency-Key"] = "measured"
    gc.collect()
    tracemalloc.start()
    try:
        started = time.process_time()
        status = client.post("/orders", data=body, headers=headers).status_code
        cpu = time.process_time() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, cpu, status


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("size", [CANONICAL_JSON_MAX_BYTES, 10 * MIB], ids=["16KiB", "10MiB"])
def test_c31_fingerprinting_json_holds_at_most_the_body_and_1_mib(
    make_app: Any, shape: str, size: int
) -> None:
    """C31: the peak memory of a protected request with a JSON body of the worst shapes
    stays within the body and 1 MiB (the test client's copy of the body is made before
    the measurement): at the largest canonicalised size and at 10 MiB. CPU per MiB is
    printed (``-s``)."""
    body = SHAPES[shape](size)
    assert len(body) <= size
    peak, cpu, status = _request_peak(make_app, body)
    mib = len(body) / MIB
    print(
        f"{shape:36} {len(body):>9} B: peak {peak / MIB:6.2f} MiB, {cpu / mib * 1000:7.1f} ms/MiB"
    )
    assert status == 401
    assert peak <= len(body) + MIB, f"{shape}: peak {peak / MIB:.2f} MiB for {mib:.2f} MiB"


@pytest.mark.parametrize("size", [CANONICAL_JSON_MAX_BYTES, 10 * MIB], ids=["16KiB", "10MiB"])
def test_c31_fingerprint_cpu_per_mib(size: int) -> None:
    """The CPU one fingerprint costs per MiB of JSON, printed per shape (``-s``), not
    traced. Above the canonical limit it is hashing (a few ms/MiB, where parsing took
    0.5–1.9 s/MiB before: a CPU cost an anonymous client chose); the bound only catches
    a return to parsing large bodies."""
    from flask import Flask, request

    app = Flask(__name__)
    worst = 0.0
    for shape, make in SHAPES.items():
        body = make(size)
        runs = max(1, MIB // len(body))  # about 1 MiB of small bodies, one large one
        started = time.process_time()
        for _ in range(runs):
            with app.test_request_context(
                "/orders", method="POST", data=body, content_type="application/json"
            ):
                fingerprint.request_fingerprint(request)
        per_mib = (time.process_time() - started) / (runs * len(body) / MIB)
        worst = max(worst, per_mib)
        print(f"{shape:36} {len(body):>9} B: {per_mib * 1000:7.1f} ms of CPU per MiB")
    if size > CANONICAL_JSON_MAX_BYTES:
        assert worst < 0.1, f"{worst * 1000:.0f} ms/MiB"


def test_c6_json_over_the_canonical_limit_is_compared_byte_for_byte() -> None:
    """C6 as revised by issue 34: JSON bodies up to ``CANONICAL_JSON_MAX_BYTES`` (as sent)
    are the same request whatever their key order and whitespace; longer ones are the
    same request when they are the same bytes (every client library resends the bytes
    it sent). Documented in docs/guarantees.md."""
    import json

    from flask import Flask, request

    app = Flask(__name__)

    def fp(body: bytes) -> str:
        with app.test_request_context(
            "/orders", method="POST", data=body, content_type="application/json"
        ):
            return fingerprint.request_fingerprint(request)

    for items in (10, 1000):
        document = {"b": ["x" * 20] * items, "a": 1}
        compact = json.dumps(document, separators=(",", ":")).encode()
        reordered = json.dumps(dict(reversed(document.items())), indent=2).encode()
        if len(compact) <= CANONICAL_JSON_MAX_BYTES and len(reordered) <= CANONICAL_JSON_MAX_BYTES:
            assert fp(compact) == fp(reordered)
        else:
            assert len(compact) > CANONICAL_JSON_MAX_BYTES
            assert fp(compact) != fp(reordered)
            assert fp(compact) == fp(bytes(compact))
