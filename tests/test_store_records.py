"""Records as the store reads and writes them (issue 11: built cheaply, still exact).

C9: a replay carries the stored headers exactly; the stored header text and the
decoded headers are kept in small memos, which must never answer with another
response's headers, and never grow without end.
"""

from __future__ import annotations

import dataclasses

import pytest

from flask_idempotency import records
from flask_idempotency.records import (
    COMPLETED,
    IN_PROGRESS,
    RECORD_COLUMNS,
    Record,
    StoredResponse,
    record_from_values,
)


def test_i11_c9_headers_round_trip_exactly_past_the_memo_size() -> None:
    count = records._MEMO_SIZE * 2 + 7
    for i in range(count):
        headers = (("Content-Type", "application/json"), ("Location", f"/payments/{i}"))
        text = StoredResponse(201, headers, b"").headers_json()
        assert text == f'[["Content-Type","application/json"],["Location","/payments/{i}"]]'
        assert StoredResponse.headers_from_json(text) == headers
        assert len(records._HEADERS_TEXT) <= records._MEMO_SIZE
        assert len(records._HEADERS_READ) <= records._MEMO_SIZE
    again = (("Location", "/payments/3"),)
    assert StoredResponse.headers_from_json(StoredResponse(201, again, b"").headers_json()) == again


def test_i11_c9_record_from_values_is_the_dataclass_it_names() -> None:
    row = {
        "id": 7,
        "key_digest": "d" * 64,
        "scope": "anonymous",
        "fingerprint": "f" * 64,
        "method": "POST",
        "path": "/pay",
        "state": COMPLETED,
        "lock_token": "a" * 32,
        "created_at_ms": 1000,
        "expires_at_ms": 2000,
        "lease_expires_at_ms": None,
        "completed_at_ms": 1500,
        "response_status": 201,
        "response_headers": '[["Content-Type","application/json"]]',
        "response_body": memoryview(b'{"ok":true}'),
        "body_omitted": False,
        "now_ms": 1600,
    }
    record = record_from_values([row[column] for column in RECORD_COLUMNS])
    expected = Record(
        id=7,
        key_digest="d" * 64,
        scope="anonymous",
        fingerprint="f" * 64,
        method="POST",
        path="/pay",
        state=COMPLETED,
        lock_token="a" * 32,
        created_at_ms=1000,
        expires_at_ms=2000,
        lease_expires_at_ms=None,
        completed_at_ms=1500,
        response=StoredResponse(201, (("Content-Type", "application/json"),), b'{"ok":true}'),
        now_ms=1600,
    )
    assert record == expected and hash(record.response) == hash(expected.response)
    assert type(record.response.body) is bytes  # type: ignore[union-attr]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.state = IN_PROGRESS  # type: ignore[misc]
    in_progress = record_from_values(
        [{**row, "state": IN_PROGRESS, "response_status": None}[c] for c in RECORD_COLUMNS]
    )
    assert in_progress.response is None and in_progress.state == IN_PROGRESS
