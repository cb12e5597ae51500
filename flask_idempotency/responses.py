"""Turning a view's response into a stored record, and a stored record back into a response.

Only an allow-list of representation headers is stored (never ``Set-Cookie``,
hop-by-hop headers or ``Date``, race X19). Bodies are kept byte for byte up to
``IDEMPOTENCY_MAX_BODY_BYTES``; a larger body is not stored, but the record still
completes, flagged "body omitted", so a retry never runs the view again (C33).
A streamed response is buffered up to that limit and then streams on (C32).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from flask import Response

from .config import Settings
from .records import Completed, StoredResponse

#: Sent on a replay whose body was too large to store (C33).
BODY_OMITTED_HEADER = "Idempotency-Replay"
BODY_OMITTED_VALUE = "omitted"


#: Headers without which the stored bytes cannot be read: kept whatever the allow-list
#: says (a gzip ``after_request`` that ran before this layer compressed the body).
BODY_HEADERS = frozenset({"content-encoding"})


def capture(response: Response, settings: Settings) -> StoredResponse:
    """What to store of ``response``; buffers a streamed body up to the limit."""
    headers = tuple(
        (name, value)
        for name, value in response.headers.items()
        if name.lower() in settings.replay_headers or name.lower() in BODY_HEADERS
    )
    limit = settings.max_body_bytes
    if response.is_sequence:
        body = response.get_data()
        if len(body) > limit:
            return StoredResponse(response.status_code, headers, b"", body_omitted=True)
        return StoredResponse(response.status_code, headers, body)
    source = response.response
    chunks, complete = _buffer(response, limit)
    if complete:
        body = b"".join(chunks)
        response.set_data(body)
        _close(source)  # the buffered copy replaces it; nobody else will close a file now
        return StoredResponse(response.status_code, headers, body)
    return StoredResponse(response.status_code, headers, b"", body_omitted=True)


def _buffer(response: Response, limit: int) -> tuple[list[bytes], bool]:
    """Read a streamed body until it ends or passes ``limit``.

    When it passes the limit the response goes on streaming: what was read is
    sent first, then the rest of the original iterator.
    """
    source = response.response
    iterator = iter(response.iter_encoded())
    chunks: list[bytes] = []
    size = 0
    try:
        for chunk in iterator:
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                response.response = _Resumed(chunks, iterator, source)
                response.direct_passthrough = False
                return chunks, False
    except BaseException:
        _close(source)  # the stream failed: the error response replaces this one
        raise
    return chunks, True


def _close(source: Any) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()


class _Resumed:
    """A body that replays already-read chunks, then continues the original stream."""

    def __init__(self, head: list[bytes], rest: Iterator[bytes], source: Any) -> None:
        self._head = head
        self._rest = rest
        self._source = source

    def __iter__(self) -> Iterator[bytes]:
        yield from self._head
        yield from self._rest

    def close(self) -> None:
        _close(self._source)


def replay(completed: Completed, settings: Settings) -> Response:
    """The stored response again: same status, same bytes, the stored headers (C9)."""
    stored = completed.response
    response = Response(stored.body, status=stored.status, headers=list(stored.headers))
    if not any(name.lower() == "content-type" for name, _ in stored.headers):
        del response.headers["Content-Type"]
    response.headers[settings.replay_header] = "true"
    if stored.body_omitted:
        response.headers[BODY_OMITTED_HEADER] = BODY_OMITTED_VALUE
    return response
