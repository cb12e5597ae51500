"""What makes two requests "the same request" (CONTRACT C5–C7, C31).

The fingerprint is SHA-256 over the method, the URL rule with its values, the
sorted query string and a canonical body: JSON with sorted keys and no
insignificant whitespace, forms as sorted fields, anything else as raw bytes.
Each part is length-prefixed so that no two different requests can run together
into the same byte string.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import tempfile
from typing import IO, Any

from flask import Request, current_app

#: Bumped whenever the canonical form changes, so old records never match by accident.
FINGERPRINT_VERSION = b"fp1"
ANONYMOUS_SCOPE = "anonymous"
_CHUNK = 64 * 1024
#: Raw bodies up to this size are hashed in memory; larger ones spill to disk.
_SPOOL_IN_MEMORY = 1024 * 1024
# One encoder each, built once: ``json.dumps`` with options builds a new encoder on every
# call, a measurable share of a replay. The output is byte for byte what ``dumps`` gives.
_VIEW_ARGS_JSON = json.JSONEncoder(sort_keys=True, default=str)
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_CANONICAL_JSON = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
)
_FIELDS_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def key_digest(scope: str, key: str) -> str:
    """The name of a record everywhere outside the request: database, Redis, logs (C22, C30)."""
    return _digest(b"key1", scope.encode("utf-8"), key.encode("utf-8"))


def default_scope(request: Request) -> str:
    """Scope when no ``scope_loader`` is registered (C46).

    The Flask-Login user when one is logged in; else a digest of
    ``Authorization``, which changes when a client refreshes its token, so a retry
    after a refresh is a new request; else the shared scope ``anonymous``, where
    any client that guesses another's key could read its response. Register a
    ``scope_loader`` that names the tenant or user to avoid both.
    """
    user_id = _login_user_id()
    if user_id is not None:
        return "user:" + user_id
    authorization = request.headers.get("Authorization")
    if not authorization:
        return ANONYMOUS_SCOPE
    return "auth:" + hashlib.sha256(authorization.encode("latin-1")).hexdigest()


def _login_user_id() -> str | None:
    """``current_user.get_id()`` when the app uses Flask-Login and a user is logged in.

    Looked up in ``sys.modules``, not imported: an app that uses Flask-Login has
    imported it already, and one that does not pays nothing. An app without a
    ``LoginManager`` has no ``current_user`` to ask.
    """
    flask_login = sys.modules.get("flask_login")
    if flask_login is None or getattr(current_app, "login_manager", None) is None:
        return None
    user = flask_login.current_user
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    user_id = user.get_id()
    return None if user_id is None or str(user_id) == "" else str(user_id)


def request_fingerprint(request: Request) -> str:
    """SHA-256 over method, route, query and canonical body, as hex (C6)."""
    rule = request.url_rule.rule if request.url_rule is not None else request.path
    # The common cases (no URL values, no query string) skip the encoder: "{}" and "[]"
    # are exactly what it would produce for them.
    view_args = _VIEW_ARGS_JSON.encode(request.view_args) if request.view_args else "{}"
    if request.query_string:
        query = _COMPACT_JSON.encode(sorted(request.args.items(multi=True)))
    else:
        query = "[]"
    body = hashlib.sha256()
    _hash_body(request, body)
    return _digest(
        FINGERPRINT_VERSION,
        request.method.encode("ascii"),
        rule.encode("utf-8"),
        view_args.encode("utf-8"),
        query.encode("utf-8"),
        body.digest(),
    )


def _hash_body(request: Request, body: Any) -> None:
    mimetype = request.mimetype
    if mimetype == "application/json" or mimetype.endswith("+json"):
        data = request.get_data(cache=True)
        canonical = _canonical_json(data)
        body.update(b"json:" if canonical is not None else b"raw:")
        body.update(canonical if canonical is not None else data)
    elif mimetype == "application/x-www-form-urlencoded":
        # Cache the raw bytes first: the form is then parsed from the cache and the
        # view can still read them (webhook signatures are computed over them, X18).
        # Werkzeug reads an urlencoded body into memory to parse it anyway.
        request.get_data(cache=True)
        body.update(b"form:")
        body.update(_canonical_fields(request, with_files=False))
    elif mimetype == "multipart/form-data":
        # Spool the raw body (memory, then disk) and parse the form from the spool,
        # then rewind it, so the view can read the exact bytes too (X18). A form an
        # earlier hook already parsed has consumed the stream: the fields still count.
        if "form" not in request.__dict__:
            _spool_stream(request, None)
        body.update(b"multipart:")
        body.update(_canonical_fields(request, with_files=True))
        _rewind_spool(request)
    else:
        body.update(b"raw:")
        _spool_stream(request, body)


def _canonical_json(data: bytes) -> bytes | None:
    """Sorted keys, no whitespace; ``None`` when the body is not valid JSON.

    Malformed JSON is fingerprinted as raw bytes and the view decides what to
    answer: the idempotency layer never turns a client's bad JSON into a 500.
    """
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    try:
        return _CANONICAL_JSON.encode(value).encode("utf-8")
    except (ValueError, RecursionError):  # pragma: no cover - loads() output always dumps
        return None


def _canonical_fields(request: Request, *, with_files: bool) -> bytes:
    fields: list[list[str]] = [["f", k, v] for k, v in request.form.items(multi=True)]
    if with_files:
        for name, upload in request.files.items(multi=True):
            content = hashlib.sha256()
            stream = upload.stream
            for chunk in iter(functools.partial(stream.read, _CHUNK), b""):
                content.update(chunk)
            stream.seek(0)
            fields.append(
                ["file", name, upload.filename or "", upload.mimetype, content.hexdigest()]
            )
    fields.sort()
    return _FIELDS_JSON.encode(fields).encode("utf-8")


def _spool_stream(request: Request, body: Any | None) -> None:
    """Read the body once, hashing it into ``body`` if given, and hand the view a spooled copy.

    The body is read through Werkzeug's guarded stream (so the app's
    ``MAX_CONTENT_LENGTH`` applies, C31), chunk by chunk, and kept in one place
    only: memory for small bodies, a temporary file for large ones.
    """
    cached = getattr(request, "_cached_data", None)
    if cached is not None:
        if body is not None:
            body.update(cached)
        return
    stream = request.stream
    # Not a context manager: the spool outlives this call, closed with the request.
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY)  # noqa: SIM115
    try:
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            if body is not None:
                body.update(chunk)
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    request.__dict__["stream"] = spool
    request.close = _closing(request.close, spool)  # type: ignore[method-assign]


def _rewind_spool(request: Request) -> None:
    stream = request.__dict__.get("stream")
    if isinstance(stream, tempfile.SpooledTemporaryFile) and not stream.closed:
        stream.seek(0)


def _closing(close: Any, spool: IO[bytes]) -> Any:
    def close_both() -> None:
        try:
            close()
        finally:
            spool.close()

    return close_both


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()
