"""What the layer may read of a request body before the view runs (issue 26.10, C31).

The fingerprint (C6) needs the body, so the layer reads it before the view, and
before any authentication decorator on the view could turn an anonymous
request away. Flask's ``MAX_CONTENT_LENGTH`` is unset by default; without a cap
of the layer's own one unauthenticated client could make every worker hold a
body of any size. ``IDEMPOTENCY_MAX_REQUEST_BYTES`` is that cap.
"""

from __future__ import annotations

from typing import Any

from .problems import RequestTooLarge


def cap_body(req: Any, cap: int) -> None:
    """Refuse a body over ``IDEMPOTENCY_MAX_REQUEST_BYTES`` before reading any of it.

    The layer reads and fingerprints the body before the view runs, and so before an
    authentication decorator on the view could turn an anonymous request away: without
    a cap (Flask's ``MAX_CONTENT_LENGTH`` is unset by default) an unauthenticated client
    could make every worker hold a huge body (issue 26.10). A body that announces its
    length is judged by it; one sent without (chunked) is cut off by Werkzeug at the cap
    where Flask lets a request carry its own limit (Flask 3.1+).
    """
    if not cap:
        return
    length = req.content_length
    if length is not None:
        if length > cap:
            raise too_large(cap)
        return
    limit = req.max_content_length
    if limit is None or limit > cap:
        try:
            req.max_content_length = cap
        except AttributeError:  # Flask before 3.1: MAX_CONTENT_LENGTH is the only limit
            pass


def too_large(cap: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"The request body is larger than the {cap} bytes an idempotent request may send"
        " (IDEMPOTENCY_MAX_REQUEST_BYTES)."
    )
