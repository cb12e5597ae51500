"""What the Redis tier writes: the names of its keys and channels, and a cached record's value.

Names: every key and channel is ``{prefix}:{origin}:...``, the origin being a digest
of the durable store (:func:`~flask_idempotency.tier.store_origin`), so two services
sharing one Redis and prefix never see each other's records or wake-ups (C41). The
record's own key holds only the digest of (scope, key), never the raw key or the
scope (C30, R69). The cache and the notifier both name things through here.

Values: one completed record in a compact line format, about a quarter of the JSON
form's decoding CPU (issue 11), sealed with a MAC (C60): HMAC-SHA256 over the record's
key name and the value's content, under a key derived from the store's secret, which
only the store's database holds (:mod:`..store.identity`). Everything read back is
untrusted until that MAC checks out, and it is checked before anything is decoded: a
value written or rewritten by anyone without the secret (another service that shares
only the Redis, a hand-made ``SET``) or moved to another record's key raises
:class:`Unauthenticated`, and the cache treats it as a miss. A value that is
authentic is still checked (C22): its status must be 100-599, its headers only those
the app stores (:class:`ReplayHeaders`), without control characters; anything else
raises :class:`UnsafeValue`, a miss too.
"""

from __future__ import annotations

import base64
import binascii
import hmac
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
# ``{origin}\n3\n{MAC}\n{fingerprint}\n{expires_at_ms}\n{status}\n{0|1 body omitted}\n
# {headers as compact JSON}\n{body in base64}``: one split, no per-field objects (issue 11).
# The MAC (base64, 44 characters) covers the record's key name, a newline, and everything
# after the MAC's line. All ASCII, so a client that decodes responses reads it too. Values
# of earlier releases (``2``, or JSON) carry no MAC: misses, re-read from the database.

_VALUE_V3 = b"3"
#: What the cache's MAC key is derived from the store's secret for (the scope key has a
#: purpose of its own: two keys, neither of which gives the other).
_CACHE_KEY_PURPOSE = b"flask-idempotency cache mac v1"
#: The MAC's line: base64 of 32 bytes.
_TAG_LENGTH = 44
#: ``3\n{MAC}\n``: where the authenticated content starts, after the origin's line.
_SEALED_HEAD = len(_VALUE_V3) + 1 + _TAG_LENGTH + 1


class ValueMac:
    """The MAC of cached values under a key derived from the store's secret (C60).

    Keyed once; each value costs a copy of the keyed state and one pass over bytes the
    cache holds already (a few µs for a 1 KiB answer: hashing the value itself).
    """

    __slots__ = ("_keyed",)

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("the cache's MAC needs the store's secret")
        key = hmac.digest(secret, _CACHE_KEY_PURPOSE, "sha256")
        self._keyed = hmac.new(key, digestmod="sha256")

    def tag(self, name: bytes, content: bytes | memoryview) -> bytes:
        mac = self._keyed.copy()
        mac.update(name)
        mac.update(b"\n")
        mac.update(content)
        return binascii.b2a_base64(mac.digest(), newline=False)

    def __repr__(self) -> str:
        return "ValueMac(<key not shown>)"


class Unauthenticated(Exception):
    """A cached value without this store's MAC over its name and content (C60)."""


class ForeignOrigin(Exception):
    """A cached value that names another store as its origin (C41): its text is the origin."""


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


def encode_value(record: Completed, *, origin: bytes, name: bytes, mac: ValueMac) -> bytes:
    """A completed record as the cache stores it under ``name``: the origin's line, then
    the record sealed with its MAC."""
    response = record.response
    content = b"\n".join(
        (
            record.fingerprint.encode("ascii"),
            b"%d" % record.expires_at_ms,
            b"%d" % response.status,
            b"1" if response.body_omitted else b"0",
            response.headers_json().encode("ascii"),
            base64.b64encode(response.body),
        )
    )
    return b"".join((origin, b"\n", _VALUE_V3, b"\n", mac.tag(name, content), b"\n", content))


def decode_value(
    raw: bytes, *, origin: bytes, name: bytes, mac: ValueMac, headers: ReplayHeaders
) -> Completed | None:
    """The record in the value ``raw`` read from the key ``name``; ``None`` for a value
    this code could not have written.

    The MAC is checked first, over the bytes as read (C60): raises :class:`ForeignOrigin`
    for a value of another store, :class:`Unauthenticated` for one that fails its MAC
    (forged, altered, moved from another key, or written before this release), and
    :class:`UnsafeValue` for an authentic value that must not be replayed: a status
    outside 100-599, a header ``headers`` does not allow, a control character in a
    header's value (C22).
    """
    head = len(origin)
    if not raw.startswith(origin) or raw[head : head + 1] != b"\n":
        raise ForeignOrigin(raw.partition(b"\n")[0][:16].decode("ascii", "replace"))
    start = head + 1
    content = start + _SEALED_HEAD
    if raw[start : start + 2] != b"3\n" or raw[content - 1 : content] != b"\n":
        raise Unauthenticated("no MAC (a value of another kind or of an earlier release)")
    if not hmac.compare_digest(
        mac.tag(name, memoryview(raw)[content:]), raw[start + 2 : content - 1]
    ):
        raise Unauthenticated("its MAC does not match its key and content")
    try:
        _, _, _, fingerprint, expires, status_text, omitted, header_text, body = raw.split(b"\n")
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
