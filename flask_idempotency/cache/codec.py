"""What the Redis tier writes: the names of its keys and channels, and a cached record's value.

Names: every key and channel is ``{prefix}:{origin}:...``, the origin being a digest
of the durable store (:func:`~flask_idempotency.tier.store_origin`), so two services
sharing one Redis and prefix never see each other's records or wake-ups (C41). The
record's own key holds only the digest of (scope, key), never the raw key or the
scope (C30, R69). The cache and the notifier both name things through here.

Values: one completed record in a compact line format, about a quarter of the JSON
form's decoding CPU (issue 11); the JSON form of earlier releases still reads. A
value that decodes is still not trusted (C22): its status must be 100-599, its
headers only those the app stores (:class:`ReplayHeaders`), without control
characters; anything else raises :class:`UnsafeValue`, and the cache treats it
as a miss.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterable

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


class UnsafeValue(Exception):
    """A cached value that decodes but must not be replayed (C22): the reason is its text."""


#: Control characters a header value must not hold (tab is allowed, as in HTTP).
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f]")


class ReplayHeaders:
    """The headers a replayed value may carry: names on the app's allow-list
    (``IDEMPOTENCY_REPLAY_HEADERS`` and the body's own ``Content-Encoding``, lower-cased),
    values without control characters. Never ``Set-Cookie``: the settings refuse it.

    Decoded header lists are kept by their JSON text, checked once: nearly every replay
    of a route has the same, so the check costs one dictionary look-up per read.
    """

    __slots__ = ("_allowed", "_seen")

    #: Header lists kept before the memo starts afresh (a varying ``Location``).
    MAX_SEEN = 256

    def __init__(self, allowed: Iterable[str]) -> None:
        self._allowed = frozenset(name.lower() for name in allowed)
        self._seen: dict[bytes, tuple[tuple[str, str], ...]] = {}

    def parse(self, text: bytes) -> tuple[tuple[str, str], ...]:
        """The checked header list of a value's JSON text (raises :class:`UnsafeValue`)."""
        headers = self._seen.get(text)
        if headers is None:
            pairs = json.loads(text)
            if not isinstance(pairs, list):
                raise ValueError("headers are a list of pairs")
            headers = tuple((str(name), str(value)) for name, value in pairs)
            self.check(headers)
            if len(self._seen) >= self.MAX_SEEN:
                self._seen.clear()
            self._seen[text] = headers
        return headers

    def check(self, headers: Iterable[tuple[str, str]]) -> None:
        """Raise :class:`UnsafeValue` unless every header may be replayed."""
        for name, value in headers:
            if name.lower() not in self._allowed:
                raise UnsafeValue(f"header {name[:40]!r} is not on the replay allow-list")
            if _CONTROL.search(value):
                raise UnsafeValue(f"header {name!r} holds a control character")


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


def decode_value(raw: bytes, headers: ReplayHeaders) -> Completed | None:
    """The record in a cached value, either form; ``None`` for anything it cannot read.

    Raises :class:`UnsafeValue` for a value that reads but must not be replayed: a
    status outside 100-599, a header ``headers`` does not allow, a control character
    in a header's value (C22).
    """
    if not raw.startswith(b"2\n"):
        record = Completed.from_json(raw)  # written by an earlier release
        if record is not None:
            if not 100 <= record.response.status <= 599:
                raise UnsafeValue(f"status {record.response.status} is not an HTTP status")
            headers.check(record.response.headers)
        return record
    try:
        _, fingerprint, expires, status_text, omitted, header_text, body = raw.split(b"\n")
        status = int(status_text)
        if not 100 <= status <= 599:  # (a chained comparison: the fastest check)
            raise UnsafeValue(f"status {status} is not an HTTP status")
        if omitted not in (b"0", b"1"):
            return None
        return Completed(
            fingerprint.decode("ascii"),
            int(expires),
            StoredResponse(
                status,
                headers.parse(header_text),
                base64.b64decode(body, validate=True),
                omitted == b"1",
            ),
        )
    except (ValueError, TypeError, RecursionError):
        return None
