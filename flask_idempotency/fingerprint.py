"""What makes two requests "the same request" (CONTRACT C5–C7, C31).

The fingerprint is SHA-256 over the method, the endpoint and its URL rule (the
path with its values, and the rule's subdomain or host), the media type of the
body, the query string and a canonical body: JSON with sorted keys and no
insignificant whitespace (up to :data:`CANONICAL_JSON_MAX_BYTES`; a longer JSON
body as raw bytes), forms as fields, anything else as raw bytes. Query
items and form fields are sorted by name only, stably: the order of names does
not matter, the order of a repeated name's values does, as it does to
``request.args["a"]``. Each part is length-prefixed so that no two different
requests can run together into the same byte string. The body comes from
:mod:`.request_body`, its one reader, never from the request's stream directly.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import operator
import sys
from collections.abc import Callable
from typing import Any

from flask import Flask, Request, current_app
from werkzeug.local import LocalProxy

from . import request_body

#: Bumped whenever the canonical form changes, so old records never match by accident.
#: ``fp2`` (issue 26): a repeated query name, form field or upload keeps its values'
#: order; the endpoint, the rule's subdomain and host, and the media type are parts.
FINGERPRINT_VERSION = b"fp2"
ANONYMOUS_SCOPE = "anonymous"
#: The default scope of a request with an ``Authorization`` header: this, then the
#: header's HMAC-SHA256 under the scope key, as hex (C30, C46). (Records written before
#: issue 26 hold ``auth:`` and the header's unkeyed SHA-256.)
AUTHORIZATION_SCOPE_PREFIX = "auth-hmac:"
#: What the scope key is derived from a secret for: the secret itself is never the key,
#: so the scope digests are no HMAC that any other use of ``SECRET_KEY`` computes.
_SCOPE_KEY_PURPOSE = b"flask-idempotency scope key v1"
#: The scope key's keyed HMAC per secret (the few an app process has), made once.
_SCOPE_KEYS: dict[str | bytes, hmac.HMAC] = {}
_SCOPE_KEYS_MAX = 16
_CHUNK = 64 * 1024
#: JSON bodies up to this many bytes (as sent) are fingerprinted as canonical JSON;
#: longer ones byte for byte, like any other body (C6, C31). Canonicalising parses the
#: body into Python objects, which for the worst shapes (``[0,0,…]``, ``[[],[],…]``)
#: take up to about 40 times the body's size: at this size, under 1 MiB.
CANONICAL_JSON_MAX_BYTES = 16 * 1024
# One encoder each, built once: ``json.dumps`` with options builds a new encoder on every
# call, a measurable share of a replay. The output is byte for byte what ``dumps`` gives.
_VIEW_ARGS_JSON = json.JSONEncoder(sort_keys=True, default=str)
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_CANONICAL_JSON = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
)
_FORM_MIMETYPES = {
    "application/x-www-form-urlencoded": b"form:",
    "multipart/form-data": b"multipart:",
}
#: What ``json.dumps(ensure_ascii=False)`` does to one string (quotes included).
_JSON_STRING: Callable[[str], str] = json.encoder.encode_basestring
#: A decoder as ``json.loads`` uses when given no options, and its scanner: one value
#: from a position, as ``(value, end)``.
_JSON_DECODER = json.JSONDecoder()
#: Sort key of a query item or form field: its name only. ``sorted`` is stable, so the
#: values of a repeated name keep their order (``a=1&a=2`` is not ``a=2&a=1``, C6).
_NAME = operator.itemgetter(0)
#: The same for a form's fields and uploads, each ``[kind, name, ...]``: fields, then files.
_KIND_AND_NAME = operator.itemgetter(0, 1)
_scan_json: Callable[[str, int], tuple[Any, int]] = _JSON_DECODER.scan_once  # type: ignore[attr-defined]


def _frame(part: bytes) -> bytes:
    """One part of a digest's input: its length (8 bytes, big-endian), then the part."""
    return len(part).to_bytes(8, "big") + part


_KEY_DIGEST_HEAD = _frame(b"key1")
_FINGERPRINT_HEAD = _frame(FINGERPRINT_VERSION)
#: The framed URL values and query of a request that has neither (``{}`` and ``[]``).
_NO_ARGS = _frame(b"{}") + _frame(b"[]")
#: The body part is always a SHA-256 digest: its frame's length prefix is a constant.
_BODY_DIGEST_LENGTH = (32).to_bytes(8, "big")
#: Framed version, method, endpoint, rule path, subdomain and host per route (the
#: tuple of those); a route's fingerprint then costs one look-up for them. Bounded:
#: only matched rules go in.
_HEADS: dict[tuple[str, str, str, str | None, str | None], bytes] = {}
_HEADS_MAX = 4096
#: ``Request.mimetype`` and its framed bytes per ``Content-Type`` value (a pure
#: function of it), bounded.
_MIMETYPES: dict[str, tuple[str, bytes]] = {}
_MIMETYPES_MAX = 256


def key_digest(scope: str, key: str) -> str:
    """The name of a record everywhere outside the request: database, Redis, logs (C22, C30)."""
    # surrogatepass: a scope with lone surrogates (bytes a loader decoded with
    # surrogateescape) still names exactly one record (issue 22.6).
    scope_bytes = scope.encode("utf-8", "surrogatepass")
    key_bytes = key.encode("utf-8")
    return hashlib.sha256(
        b"".join(
            (
                _KEY_DIGEST_HEAD,
                len(scope_bytes).to_bytes(8, "big"),
                scope_bytes,
                len(key_bytes).to_bytes(8, "big"),
                key_bytes,
            )
        )
    ).hexdigest()


def default_scope(request: Request, app: Flask | None = None, *, host: bool = False) -> str:
    """Scope when no ``scope_loader`` is registered, or it returned nothing (C46).

    The Flask-Login user when one is logged in; else a keyed digest of
    ``Authorization`` (:func:`authorization_scope`), which changes when a client
    refreshes its token, so a retry after a refresh is a new request; else the
    shared scope ``anonymous``, where
    any client that guesses another's key could read its response. Register a
    ``scope_loader`` that names the tenant or user to avoid both.

    On a route with a subdomain or a host (tenants served by host), the default
    scope also carries the request's host (:func:`with_host`): user 5 of
    ``acme.example.com`` and user 5 of ``globex.example.com`` are two owners. With
    ``host`` (``IDEMPOTENCY_SCOPE_HOST``) it carries it on every route: for an app
    that picks its tenant from ``Host`` in a hook, on plain routes.

    ``app``: the request's app, when the caller has it (saves a context look-up).
    """
    request = _unproxied(request)
    user_id = _login_user_id(app)
    if user_id is not None:
        scope = "user:" + user_id
    else:
        # The environ entry ``headers.get("Authorization")`` reads, without building
        # the request's header view for it.
        authorization = request.environ.get("HTTP_AUTHORIZATION")
        if not authorization:
            scope = ANONYMOUS_SCOPE
        else:
            scope = authorization_scope(authorization, current_app if app is None else app)
    rule = request.url_rule
    if host or (rule is not None and (rule.subdomain or rule.host)):
        return with_host(scope, request.host)
    return scope


def authorization_scope(authorization: str, app: Flask) -> str:
    """The default scope of a request with this ``Authorization`` header (C30, C46).

    An HMAC-SHA256 of the header under a key derived from ``IDEMPOTENCY_SCOPE_SECRET``,
    else the app's ``SECRET_KEY``, else the secret the store keeps in its own database
    (C63): the scope is stored, printed by ``flask idempotency show`` and sent with
    every signal, and an unkeyed digest of a Basic-auth header or a short token gives
    its secret to a wordlist. Raises the store's error when its secret is needed and
    cannot be read, and ``RuntimeError`` in an app without the extension and without
    either setting: no request is scoped by a guessable digest.

    The standard library's HMAC, keyed once per secret and copied per request: a
    hand-written one from SHA-256 states saved about half a microsecond, under the
    noise of a whole replay (issue 34 item 7).
    """
    mac = _scope_hmac(app).copy()
    mac.update(authorization.encode("latin-1"))
    return AUTHORIZATION_SCOPE_PREFIX + mac.hexdigest()


def _scope_hmac(app: Flask) -> hmac.HMAC:
    """The scope key's HMAC-SHA256, keyed and not yet fed, from the app's secret."""
    state = app.extensions.get("idempotency")
    if state is not None:
        secret = state.scope_secret(app)  # the settings', SECRET_KEY, or the store's (C63)
    else:  # a bare app (tests of the fingerprint alone): the same settings, unchecked
        secret = app.config.get("IDEMPOTENCY_SCOPE_SECRET") or app.config.get("SECRET_KEY")
        if not secret or not isinstance(secret, (str, bytes)):
            raise RuntimeError(
                "Flask-Idempotency: this request is scoped by its Authorization header, and"
                " that scope is an HMAC of the header: set IDEMPOTENCY_SCOPE_SECRET or the"
                " app's SECRET_KEY (with the extension registered, the store's own secret"
                " serves when neither is set)."
            )
    keyed = _SCOPE_KEYS.get(secret)
    if keyed is None:
        raw = secret.encode("utf-8") if isinstance(secret, str) else secret
        keyed = hmac.new(hmac.digest(raw, _SCOPE_KEY_PURPOSE, "sha256"), digestmod="sha256")
        if len(_SCOPE_KEYS) < _SCOPE_KEYS_MAX:
            _SCOPE_KEYS[secret] = keyed
    return keyed


def with_host(scope: str, host: str) -> str:
    """A default scope on a route with a subdomain or a host: ``user:5@acme.example.com``.

    The host is as routing matched it (lower case, no default port). A host never
    holds ``@`` (Werkzeug accepts letters, digits, ``.``, ``-``, ``:`` and ``[]``),
    so the last ``@`` always starts it.
    """
    return scope + "@" + host.lower()


def _login_user_id(app: Flask | None = None) -> str | None:
    """``current_user.get_id()`` when the app uses Flask-Login and a user is logged in.

    Looked up in ``sys.modules``, not imported: an app that uses Flask-Login has
    imported it already, and one that does not pays nothing. An app without a
    ``LoginManager`` has no ``current_user`` to ask.
    """
    flask_login = sys.modules.get("flask_login")
    if flask_login is None:
        return None
    if getattr(current_app if app is None else app, "login_manager", None) is None:
        return None
    user = flask_login.current_user
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    user_id = user.get_id()
    return None if user_id is None or str(user_id) == "" else str(user_id)


def request_fingerprint(request: Request, omit_fields: frozenset[str] = frozenset()) -> str:
    """SHA-256 over method, route, media type, query and canonical body, as hex (C6).

    ``omit_fields``: form fields that say nothing about the request itself (the
    form's idempotency key and CSRF token, C49), left out of a form body.

    The digest's input is the framed parts (see :func:`_digest`) of the version,
    the method, the endpoint, the rule's path, subdomain and host, the media type,
    the URL values as JSON, the query as JSON (sorted by name, each name's values
    in their order) and the body's own SHA-256. Every replay computes it, so the
    parts that are the same for a route, or for a ``Content-Type``, are framed once
    (issue 11).
    """
    if isinstance(request, LocalProxy):
        request = request._get_current_object()
    method = request.method
    url_rule = request.url_rule
    view_args = request.view_args
    query_string = request.query_string
    mimetype, media = _media_type(request)
    body = hashlib.sha256()
    _hash_body(request, mimetype, body, omit_fields)
    if url_rule is None:
        head = _head((method, "", request.path, None, None))  # the client's path: never kept
    else:
        route = (method, url_rule.endpoint, url_rule.rule, url_rule.subdomain, url_rule.host)
        head = _HEADS.get(route) or _remember_head(route)
    if not view_args and not query_string:
        args = _NO_ARGS  # what the two encoders give for no values and no query
    else:
        values = _VIEW_ARGS_JSON.encode(view_args) if view_args else "{}"
        query = (
            _COMPACT_JSON.encode(sorted(request.args.items(multi=True), key=_NAME))
            if query_string
            else "[]"
        )
        args = _frame(values.encode("utf-8")) + _frame(query.encode("utf-8"))
    return hashlib.sha256(
        b"".join((head, media, args, _BODY_DIGEST_LENGTH, body.digest()))
    ).hexdigest()


def _head(route: tuple[str, str, str, str | None, str | None]) -> bytes:
    """The framed version, method, endpoint, rule path, and the rule's subdomain and
    host (C6): ``/orders`` on ``acme.example.com`` is not ``/orders`` on ``globex``."""
    method, endpoint, rule, subdomain, host = route
    return b"".join(
        (
            _FINGERPRINT_HEAD,
            _frame(method.encode("ascii")),
            _frame(endpoint.encode("utf-8")),
            _frame(rule.encode("utf-8")),
            _frame((subdomain or "").encode("utf-8")),
            _frame((host or "").encode("utf-8")),
        )
    )


def _remember_head(route: tuple[str, str, str, str | None, str | None]) -> bytes:
    head = _head(route)
    if len(_HEADS) < _HEADS_MAX:
        _HEADS[route] = head
    return head


def _media_type(request: Request) -> tuple[str, bytes]:
    """``request.mimetype``, and it framed for the digest (C6).

    The media type without its parameters, in lower case: ``application/json;
    charset=utf-8`` is ``application/json``, and a multipart boundary does not
    count. ``request.mimetype`` parses ``Content-Type`` again on every read;
    Werkzeug derives it from the ``Content-Type`` value alone, so both are
    remembered per value (the few an app sees; a bounded number of them).
    """
    content_type = request.environ.get("CONTENT_TYPE", "")
    known = _MIMETYPES.get(content_type) if type(content_type) is str else None
    if known is None:
        mimetype = request.mimetype
        known = (mimetype, _frame(mimetype.encode("utf-8", "surrogatepass")))
        if type(content_type) is str and len(_MIMETYPES) < _MIMETYPES_MAX:
            _MIMETYPES[content_type] = known
    return known


def _hash_body(
    request: Request, mimetype: str, body: Any, omit_fields: frozenset[str] = frozenset()
) -> None:
    if mimetype == "application/json" or mimetype.endswith("+json"):
        # Read once, through the cap (:mod:`.request_body`); the view reuses the bytes.
        # A body longer than CANONICAL_JSON_MAX_BYTES is hashed as it streams in.
        data = request_body.read(
            request, body.update, whole_up_to=CANONICAL_JSON_MAX_BYTES, before=b"raw:"
        )
        if data is not None:
            canonical = _canonical_json(data)
            body.update(b"json:" if canonical is not None else b"raw:")
            body.update(canonical if canonical is not None else data)
    elif mimetype in _FORM_MIMETYPES:
        # A form is parsed once, by Werkzeug, from the capped stream, exactly as the
        # view would have it parsed, and the view reuses that parse: its fields (and
        # uploads, spooled to Werkzeug's temporary files) are the one copy (C31). The
        # raw bytes are not kept on top of it: an app that verifies a signature over
        # them caches them in a before_request hook (every hook runs before the layer
        # decides), and the form is then parsed from that cache, as in Flask without it.
        body.update(_FORM_MIMETYPES[mimetype])
        _hash_fields(request, body, omit_fields, with_files=mimetype == "multipart/form-data")
    else:
        request_body.read(request, body.update, whole_up_to=-1, before=b"raw:")  # kept, too


def _canonical_json(data: bytes) -> bytes | None:
    """Sorted keys, no whitespace; ``None`` when the body is not valid JSON.

    Malformed JSON is fingerprinted as raw bytes and the view decides what to
    answer: the idempotency layer never turns a client's bad JSON into a 500.
    """
    try:
        value = _loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError, StopIteration):
        return None
    try:
        return _dump_canonical(value).encode("utf-8")
    except (ValueError, RecursionError):  # a lone surrogate ("\ud800") has no UTF-8
        return None


def _loads(data: bytes) -> Any:
    """``json.loads(data)``, with its encoding detection and whitespace scan skipped
    for the common body: UTF-8 that starts with ``{`` or ``[`` and ends at the value.

    Every other body goes through ``json.loads`` itself, so the value (or the error)
    is always the one ``json.loads`` gives.
    """
    if len(data) >= 2 and data[0] in (0x7B, 0x5B) and data[1]:  # ``{`` or ``[``, not UTF-16/32
        text = data.decode("utf-8", "surrogatepass")  # json.detect_encoding() says UTF-8
        value, end = _scan_json(text, 0)
        if end == len(text):
            return value
        return _JSON_DECODER.decode(text)  # trailing whitespace, or not JSON after all
    return json.loads(data)


def _canonical_encoder() -> Callable[[Any], str]:
    """``_CANONICAL_JSON.encode`` as one call into the C encoder, built once.

    ``JSONEncoder.encode`` builds a C encoder per call, with a dict to detect cycles;
    ``json.loads`` output has none, so one encoder without it serves every call (it
    keeps no state between calls). Falls back to ``encode`` where the C encoder is
    missing or gives anything else for a probe.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return _CANONICAL_JSON.encode

    def no_default(value: Any) -> Any:  # pragma: no cover - loads() output never needs it
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    try:
        encoder = make(None, no_default, _JSON_STRING, None, ":", ",", True, False, True)

        def encode(value: Any) -> str:
            return "".join(encoder(value, 0))

        probe = {"b": [1.5, -0.0, 1e300, float("nan"), 'é\u2028"\n'], "a": {"y": None, "x": True}}
        if encode(probe) != _CANONICAL_JSON.encode(probe):  # pragma: no cover
            return _CANONICAL_JSON.encode
    except Exception:  # pragma: no cover - a future signature: keep the public path
        return _CANONICAL_JSON.encode
    return encode


_dump_canonical = _canonical_encoder()


def _hash_fields(request: Request, body: Any, omit: frozenset[str], *, with_files: bool) -> None:
    """Hash the fields as a compact JSON list, piece by piece.

    The fields (``["f", name, value]``), then the uploads (``["file", name,
    filename, mimetype, sha256]``), each sorted by name only, stably: the order of
    names does not count, the order of a repeated name's values does (C6).

    The bytes fed to ``body`` are exactly ``json.dumps(fields, separators=(",", ":"),
    ensure_ascii=False).encode()``, but no whole JSON text of the form is ever
    built: an 80 MiB field used to cost two more 80 MiB copies (the JSON string and
    its UTF-8 bytes), see C31.
    """
    form, files = request_body.form(request)
    fields = [["f", k, v] for k, v in form.items(multi=True) if k not in omit]
    if with_files:
        for name, upload in files.items(multi=True):
            content = hashlib.sha256()
            stream = upload.stream
            for chunk in iter(functools.partial(stream.read, _CHUNK), b""):
                content.update(chunk)
            stream.seek(0)
            fields.append(
                ["file", name, upload.filename or "", upload.mimetype, content.hexdigest()]
            )
    fields.sort(key=_KIND_AND_NAME)  # stable: a repeated name keeps its values' order (C6)
    body.update(b"[")
    for index, field in enumerate(fields):
        body.update(b"[" if index == 0 else b",[")
        for position, text in enumerate(field):
            if position:
                body.update(b",")
            _hash_json_string(text, body)
        body.update(b"]")
    body.update(b"]")


def _hash_json_string(text: str, body: Any) -> None:
    """Feed ``json.dumps(text, ensure_ascii=False).encode()`` to ``body`` in slices.

    JSON escapes each code point on its own, so escaping slices and joining them
    gives the same text as escaping the whole string.
    """
    body.update(b'"')
    for start in range(0, len(text), _CHUNK):
        body.update(_JSON_STRING(text[start : start + _CHUNK])[1:-1].encode("utf-8"))
    body.update(b'"')


def _digest(*parts: bytes) -> str:
    """SHA-256 over length-prefixed parts, fed as one buffer (one call into the hash)."""
    framed = b"".join(len(part).to_bytes(8, "big") + part for part in parts)
    return hashlib.sha256(framed).hexdigest()


def _unproxied(request: Request) -> Request:
    """The request itself when given Flask's ``request`` proxy.

    Every attribute read through the proxy looks the request up in a context
    variable again; a fingerprint reads a dozen, which was half its cost (issue 11).
    """
    if isinstance(request, LocalProxy):
        return request._get_current_object()  # type: ignore[no-any-return]
    return request
