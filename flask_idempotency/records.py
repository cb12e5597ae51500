"""Plain data passed between the request lifecycle and the two storage tiers."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Sequence
from typing import Any, TypeVar

IN_PROGRESS = "in_progress"
COMPLETED = "completed"


def storable(text: str) -> str:
    """``text`` as any database's text column holds it: NUL written ``%00``, and what is
    not text at all (lone surrogates) written as a backslash escape (issue 22.6)."""
    text = text.replace("\x00", "%00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


@dataclasses.dataclass(frozen=True, init=False)
class Identity:
    """Who is asking and for what: the record's name and the request's fingerprint."""

    scope: str
    key_digest: str
    fingerprint: str
    method: str
    path: str

    def __init__(
        self, scope: str, key_digest: str, fingerprint: str, method: str, path: str
    ) -> None:
        # ``path`` comes from the client (``/files/a%00b``) and ``scope`` from the app;
        # PostgreSQL text cannot hold NUL, so an unescaped one would turn a request
        # into a 500. They are informational columns: the record is named by the digest.
        if not scope.isascii() or "\x00" in scope:
            scope = storable(scope)
        if "\x00" in path:
            path = path.replace("\x00", "%00")
        # Set in one call: the generated __init__ of a frozen dataclass sets each field
        # through object.__setattr__, which cost more than the rest of it (issue 11).
        self.__dict__.update(
            scope=scope, key_digest=key_digest, fingerprint=fingerprint, method=method, path=path
        )

    def in_ascii(self) -> Identity:
        """The same identity with its informational columns in ASCII (backslash escapes)."""
        return Identity(
            self.scope.encode("ascii", "backslashreplace").decode("ascii"),
            self.key_digest,
            self.fingerprint,
            self.method,
            self.path.encode("ascii", "backslashreplace").decode("ascii"),
        )


@dataclasses.dataclass(frozen=True, init=False)
class StoredResponse:
    """A response as stored and replayed: status, allow-listed headers, exact body bytes."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    body_omitted: bool = False

    def __init__(
        self,
        status: int,
        headers: tuple[tuple[str, str], ...],
        body: bytes,
        body_omitted: bool = False,
    ) -> None:
        # In one call, not a frozen dataclass's object.__setattr__ per field (issue 11).
        self.__dict__.update(status=status, headers=headers, body=body, body_omitted=body_omitted)

    def without_body(self) -> StoredResponse:
        """This response stored as C33 stores one over ``IDEMPOTENCY_MAX_BODY_BYTES``:
        its status and headers, the body omitted (C58: a body the database refuses)."""
        return StoredResponse(self.status, self.headers, b"", body_omitted=True)

    def headers_json(self) -> str:
        text = _HEADERS_TEXT.get(self.headers)
        if text is None:
            text = json.dumps([list(pair) for pair in self.headers], separators=(",", ":"))
            _remember(_HEADERS_TEXT, self.headers, text)
        return text

    @staticmethod
    def headers_from_json(text: str | None) -> tuple[tuple[str, str], ...]:
        if not text:
            return ()
        headers = _HEADERS_READ.get(text)
        if headers is None:
            headers = tuple((str(name), str(value)) for name, value in json.loads(text))
            _remember(_HEADERS_READ, text, headers)
        return headers


#: Stored headers in both forms, by the other: a route's responses mostly carry the
#: same few headers, and encoding or decoding them each time cost more than the rest
#: of building a record (issue 11). Both forms are immutable, so sharing is safe.
_HEADERS_TEXT: dict[tuple[tuple[str, str], ...], str] = {}
_HEADERS_READ: dict[str, tuple[tuple[str, str], ...]] = {}
#: Entries each memo keeps before it starts afresh (headers that vary per response,
#: a ``Location`` say, would otherwise grow it without end).
_MEMO_SIZE = 512

K = TypeVar("K")
V = TypeVar("V")


def _remember(memo: dict[K, V], key: K, value: V) -> None:
    if len(memo) >= _MEMO_SIZE:
        memo.clear()
    memo[key] = value


@dataclasses.dataclass(frozen=True, init=False)
class Completed:
    """A finished request: what Redis caches and what a replay needs (C9, C22)."""

    fingerprint: str
    expires_at_ms: int
    response: StoredResponse

    FORMAT_VERSION = 1

    def __init__(self, fingerprint: str, expires_at_ms: int, response: StoredResponse) -> None:
        # In one call, not a frozen dataclass's object.__setattr__ per field (issue 11).
        self.__dict__.update(
            fingerprint=fingerprint, expires_at_ms=expires_at_ms, response=response
        )

    def to_json(self) -> bytes:
        """A safe, versioned wire format for Redis (never pickle)."""
        return json.dumps(
            {
                "v": self.FORMAT_VERSION,
                "fp": self.fingerprint,
                "exp": self.expires_at_ms,
                "st": self.response.status,
                "h": [list(pair) for pair in self.response.headers],
                "b": base64.b64encode(self.response.body).decode("ascii"),
                "om": self.response.body_omitted,
            },
            separators=(",", ":"),
        ).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes | str) -> Completed | None:
        """Decode a cached record; ``None`` for anything not written by this version."""
        try:
            data: dict[str, Any] = json.loads(raw)
            if data.get("v") != cls.FORMAT_VERSION:
                return None
            return cls(
                fingerprint=str(data["fp"]),
                expires_at_ms=int(data["exp"]),
                response=StoredResponse(
                    status=int(data["st"]),
                    headers=tuple((str(n), str(v)) for n, v in data["h"]),
                    body=base64.b64decode(data["b"], validate=True),
                    body_omitted=bool(data["om"]),
                ),
            )
        except (ValueError, KeyError, TypeError, OverflowError, AttributeError):
            return None


@dataclasses.dataclass(frozen=True)
class Record:
    """A durable record as read, with the database clock at the moment of reading."""

    id: int
    key_digest: str
    scope: str
    fingerprint: str
    method: str
    path: str
    state: str
    lock_token: str | None
    created_at_ms: int
    expires_at_ms: int
    lease_expires_at_ms: int | None
    completed_at_ms: int | None
    response: StoredResponse | None
    now_ms: int

    @property
    def lease_live(self) -> bool:
        return (
            self.state == IN_PROGRESS
            and self.lease_expires_at_ms is not None
            and self.lease_expires_at_ms > self.now_ms
        )

    @property
    def expired(self) -> bool:
        """Past its life, and not an in-progress claim whose lease still holds (C21)."""
        return self.expires_at_ms <= self.now_ms and not self.lease_live

    @property
    def lease_remaining(self) -> float:
        if self.lease_expires_at_ms is None:
            return 0.0
        return max(0.0, (self.lease_expires_at_ms - self.now_ms) / 1000.0)

    def completed(self) -> Completed:
        assert self.response is not None, "only a completed record has a response"
        return Completed(self.fingerprint, self.expires_at_ms, self.response)


@dataclasses.dataclass(frozen=True, init=False)
class Claim:
    """Ownership of a record: only the holder of ``lock_token`` may complete or release it."""

    record_id: int
    lock_token: str
    expires_at_ms: int
    #: How the claim was won: ``new``, ``replaced`` (an expired record), ``taken_over``.
    how: str

    def __init__(self, record_id: int, lock_token: str, expires_at_ms: int, how: str) -> None:
        # In one call, not a frozen dataclass's object.__setattr__ per field (issue 11):
        # every first execution makes one.
        self.__dict__.update(
            record_id=record_id, lock_token=lock_token, expires_at_ms=expires_at_ms, how=how
        )


#: The columns a :class:`Record` is read from, in the order :func:`record_from_values` takes.
RECORD_COLUMNS = (
    "id",
    "key_digest",
    "scope",
    "fingerprint",
    "method",
    "path",
    "state",
    "lock_token",
    "created_at_ms",
    "expires_at_ms",
    "lease_expires_at_ms",
    "completed_at_ms",
    "response_status",
    "response_headers",
    "response_body",
    "body_omitted",
    "now_ms",
)


def record_from_values(values: Sequence[Any]) -> Record:
    """A :class:`Record` from the values of :data:`RECORD_COLUMNS`, in that order.

    Positional, so that a driver's plain row tuple needs no per-row name lookups.
    """
    (
        id_,
        key_digest,
        scope,
        fingerprint,
        method,
        path,
        state,
        lock_token,
        created_at_ms,
        expires_at_ms,
        lease_expires_at_ms,
        completed_at_ms,
        status,
        headers,
        body,
        omitted,
        now_ms,
    ) = values
    response = None
    if state == COMPLETED and status is not None:
        response = StoredResponse(
            int(status),
            StoredResponse.headers_from_json(headers),
            bytes(body or b""),
            bool(omitted),
        )
    # Filled in directly: a frozen dataclass's __init__ sets each of its fields through
    # object.__setattr__, which cost more than the rest of this function (issue 11).
    record = _new(Record)
    _set(
        record,
        "__dict__",
        {
            "id": int(id_),
            "key_digest": key_digest,
            "scope": scope,
            "fingerprint": fingerprint,
            "method": method,
            "path": path,
            "state": state,
            "lock_token": lock_token,
            "created_at_ms": int(created_at_ms),
            "expires_at_ms": int(expires_at_ms),
            "lease_expires_at_ms": None
            if lease_expires_at_ms is None
            else int(lease_expires_at_ms),
            "completed_at_ms": None if completed_at_ms is None else int(completed_at_ms),
            "response": response,
            "now_ms": int(now_ms),
        },
    )
    return record


_new = object.__new__
_set = object.__setattr__
