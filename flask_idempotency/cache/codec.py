"""What the Redis tier writes: the names of its keys and channels, and a cached record's value.

Names: every key and channel is ``{prefix}:{origin}:...``, the origin being a digest
of the durable store (:func:`~flask_idempotency.tier.store_origin`), so two services
sharing one Redis and prefix never see each other's records or wake-ups (C41). The
record's own key holds only the digest of (scope, key), never the raw key or the
scope (C30, R69). The cache and the notifier both name things through here.

Values: one completed record in a compact line format, about a quarter of the JSON
form's decoding CPU (issue 11); the JSON form of earlier releases still reads.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

from ..records import Completed, StoredResponse


class Origin:
    """The store's name, resolved on first need (``db=``/``engine=`` resolve lazily)."""

    def __init__(self, origin: str | Callable[[], str]) -> None:
        self._fixed = origin if isinstance(origin, str) else None
        self._resolve = None if isinstance(origin, str) else origin

    def get(self) -> str:
        if self._fixed is None:
            assert self._resolve is not None
            self._fixed = self._resolve()
        return self._fixed


def names_prefix(prefix: str, origin: str) -> str:
    return f"{prefix}:{origin}" if origin else prefix


# -- the cached value ----------------------------------------------------------------------
#
# ``{origin}\n2\n{fingerprint}\n{expires_at_ms}\n{status}\n{0|1 body omitted}\n{headers as
# compact JSON}\n{body in base64}``: one split, no per-field objects, about a quarter of the
# JSON form's decoding CPU (issue 11). All ASCII, so a client that decodes responses
# reads it too. A value in the JSON form (``{"v":1,…}``) of earlier releases still reads.

_VALUE_V2 = b"2"
#: Decoded header lists by their JSON text: nearly every replay of a route has the same.
_HEADERS_SEEN: dict[bytes, tuple[tuple[str, str], ...]] = {}
_HEADERS_SEEN_MAX = 256


def encode_value(record: Completed) -> bytes:
    """A completed record as the cache stores it (after the origin line)."""
    response = record.response
    return b"\n".join(
        (
            _VALUE_V2,
            record.fingerprint.encode("ascii"),
            b"%d" % record.expires_at_ms,
            b"%d" % response.status,
            b"1" if response.body_omitted else b"0",
            response.headers_json().encode("ascii"),
            base64.b64encode(response.body),
        )
    )


def decode_value(raw: bytes) -> Completed | None:
    """The record in a cached value, either form; ``None`` for anything else."""
    if not raw.startswith(b"2\n"):
        return Completed.from_json(raw)  # written by an earlier release
    try:
        _, fingerprint, expires, status, omitted, headers, body = raw.split(b"\n")
        if omitted not in (b"0", b"1"):
            return None
        return Completed(
            fingerprint.decode("ascii"),
            int(expires),
            StoredResponse(
                int(status),
                _headers(headers),
                base64.b64decode(body, validate=True),
                omitted == b"1",
            ),
        )
    except (ValueError, TypeError, RecursionError):
        return None


def _headers(text: bytes) -> tuple[tuple[str, str], ...]:
    headers = _HEADERS_SEEN.get(text)
    if headers is None:
        pairs = json.loads(text)
        if not isinstance(pairs, list):
            raise ValueError("headers are a list of pairs")
        headers = tuple((str(name), str(value)) for name, value in pairs)
        if len(_HEADERS_SEEN) >= _HEADERS_SEEN_MAX:
            _HEADERS_SEEN.clear()
        _HEADERS_SEEN[text] = headers
    return headers
