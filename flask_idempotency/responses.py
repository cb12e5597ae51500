"""Turning a view's response into a stored record, and a stored record back into a response.

Only an allow-list of representation headers is stored (never ``Set-Cookie``,
hop-by-hop headers or ``Date``, race X19). Bodies are kept byte for byte up to
``IDEMPOTENCY_MAX_BODY_BYTES``; a larger body is not stored, but the record still
completes, flagged "body omitted", so a retry never runs the view again (C33).
A streamed response is buffered up to that limit and then streams on (C32).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from flask import Response
from werkzeug.datastructures import Headers

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
    kept = settings.replay_headers
    headers = tuple(
        (name, value)
        for name, value in response.headers  # the pairs themselves: items() is a generator
        if (lower := name.lower()) in kept or lower in BODY_HEADERS
    )
    limit = settings.max_body_bytes
    if response.is_sequence:
        sequence = response.response
        if len(sequence) == 1 and type(sequence[0]) is bytes:  # type: ignore[arg-type,index]
            body = sequence[0]  # type: ignore[index]  # what get_data() gives, without the join
        else:
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


class ReplayedResponse(Response):
    """A replayed response: it carries the stored ``Content-Type`` or none, never a default."""

    default_mimetype = None


def replay(completed: Completed, settings: Settings) -> Response:
    """The stored response again: same status, same bytes, the stored headers (C9).

    Built in one pass, as every replay pays for it (issue 11): the stored headers
    and the ones added here set on a ``Headers`` in one assignment (which still
    refuses a value with a newline), the body as the response's one chunk, as
    ``set_data`` would set it.
    """
    stored = completed.response
    body = stored.body
    added = [("Content-Length", str(len(body))), (settings.replay_header, "true")]
    if stored.body_omitted:
        added.append((BODY_OMITTED_HEADER, BODY_OMITTED_VALUE))
    headers = Headers()
    added_names = _added_names(settings.replay_header)
    for name, _ in stored.headers:
        if name.lower() in added_names:  # an allow-list naming Idempotent-Replayed, say
            headers[:] = stored.headers
            for added_name, value in added:
                headers[added_name] = value  # replaces the stored header of that name
            break
    else:
        headers[:] = [*stored.headers, *added]
    response = ReplayedResponse(status=stored.status, headers=headers)
    response.response = [body]
    return response


@functools.lru_cache(maxsize=8)
def _added_names(replay_header: str) -> frozenset[str]:
    """The names of the headers a replay adds, lower-cased."""
    return frozenset({"content-length", replay_header.lower(), BODY_OMITTED_HEADER.lower()})
