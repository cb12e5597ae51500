"""The fingerprint's bytes change only where a change was meant (C5, C6, C31).

Stored records are compared with the fingerprint a retry computes, so a faster
implementation must give exactly the bytes the plain one gives, for every request.

``frozen_request_fingerprint`` below is the implementation of 2026-11-24 before
issue 11's rewrite, kept verbatim in its logic (the form fields as the one JSON
text the piecewise hashing reproduces): the ``fp1`` format. Issue 26 changed the
format on purpose (``fp2``): a repeated query name keeps the order of its values.
``reference_fingerprint`` is the frozen code with exactly those changes, written
as plainly; Hypothesis compares today's implementation with it over generated
requests, and checks that every part of ``fp1`` the change does not concern is
still the same bytes. Fixed vectors pin the frozen copy to the digests the old
code computed, and today's code to the ``fp2`` digests.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import random
from typing import Any
from urllib.parse import urlencode

import pytest
from flask import Flask, Request, request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge
from werkzeug.test import EnvironBuilder

from flask_idempotency.fingerprint import key_digest, request_fingerprint

OMIT = frozenset({"_idempotency_key", "csrf_token"})
FORM = "application/x-www-form-urlencoded"

# -- the frozen copy ---------------------------------------------------------------------


def _frozen_digest(*parts: bytes) -> str:
    framed = b"".join(len(part).to_bytes(8, "big") + part for part in parts)
    return hashlib.sha256(framed).hexdigest()


def frozen_key_digest(scope: str, key: str) -> str:
    return _frozen_digest(b"key1", scope.encode("utf-8"), key.encode("utf-8"))


def _frozen_canonical_json(data: bytes) -> bytes | None:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True
        ).encode("utf-8")
    except (ValueError, RecursionError):
        return None


def _frozen_form(req: Request, omit: frozenset[str], *, with_files: bool) -> bytes:
    fields: list[list[str]] = [["f", k, v] for k, v in req.form.items(multi=True) if k not in omit]
    if with_files:
        for name, upload in req.files.items(multi=True):
            content = hashlib.sha256(upload.stream.read()).hexdigest()
            upload.stream.seek(0)
            fields.append(["file", name, upload.filename or "", upload.mimetype, content])
    fields.sort()
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def frozen_parts(req: Request, omit_fields: frozenset[str] = frozenset()) -> dict[str, bytes]:
    """The ``fp1`` digest's parts, in order (the frozen code, split where it digests)."""
    rule = req.url_rule.rule if req.url_rule is not None else req.path
    view_args = json.dumps(req.view_args, sort_keys=True, default=str) if req.view_args else "{}"
    if req.query_string:
        query = json.dumps(sorted(req.args.items(multi=True)), separators=(",", ":"))
    else:
        query = "[]"
    body = hashlib.sha256()
    mimetype = req.mimetype
    if mimetype == "application/json" or mimetype.endswith("+json"):
        data = req.get_data(cache=True)
        canonical = _frozen_canonical_json(data)
        body.update(b"json:" if canonical is not None else b"raw:")
        body.update(canonical if canonical is not None else data)
    elif mimetype == "application/x-www-form-urlencoded":
        body.update(b"form:" + _frozen_form(req, omit_fields, with_files=False))
    elif mimetype == "multipart/form-data":
        body.update(b"multipart:" + _frozen_form(req, omit_fields, with_files=True))
    else:
        body.update(b"raw:" + req.get_data(cache=True))
    return {
        "version": b"fp1",
        "method": req.method.encode("ascii"),
        "rule": rule.encode("utf-8"),
        "view_args": view_args.encode("utf-8"),
        "query": query.encode("utf-8"),
        "body": body.digest(),
    }


def frozen_request_fingerprint(req: Request, omit_fields: frozenset[str] = frozenset()) -> str:
    return _frozen_digest(*frozen_parts(req, omit_fields).values())


# -- the reference: the frozen code with issue 26's changes, and nothing else ------------


def _reference_form(req: Request, omit: frozenset[str], *, with_files: bool) -> bytes:
    """:func:`_frozen_form`, its fields and files sorted by (kind, name) only, stably."""
    fields: list[list[str]] = [["f", k, v] for k, v in req.form.items(multi=True) if k not in omit]
    if with_files:
        for name, upload in req.files.items(multi=True):
            content = hashlib.sha256(upload.stream.read()).hexdigest()
            upload.stream.seek(0)
            fields.append(["file", name, upload.filename or "", upload.mimetype, content])
    fields.sort(key=lambda field: (field[0], field[1]))
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def reference_parts(req: Request, omit_fields: frozenset[str] = frozenset()) -> dict[str, bytes]:
    """The ``fp2`` digest's parts, in order. What differs from :func:`frozen_parts`:

    - the version is ``fp2``;
    - query items are sorted by name only, stably (item 1): a repeated name keeps
      the order of its values;
    - so are form fields, and uploads, each by name (item 2);
    - the endpoint, and the rule's subdomain and host, follow the method (item 3);
    - the media type (``request.mimetype``: no parameters, lower case) follows (item 4).
    """
    old = frozen_parts(req, omit_fields)
    rule = req.url_rule
    parts = {
        "version": b"fp2",
        "method": old["method"],
        "endpoint": (rule.endpoint if rule is not None else "").encode("utf-8"),
        "rule": old["rule"],
        "subdomain": ((rule.subdomain if rule is not None else "") or "").encode("utf-8"),
        "host": ((rule.host if rule is not None else "") or "").encode("utf-8"),
        "media_type": req.mimetype.encode("utf-8"),
        "view_args": old["view_args"],
        "query": old["query"],
        "body": old["body"],
    }
    if req.query_string:
        items = sorted(req.args.items(multi=True), key=lambda item: item[0])
        parts["query"] = json.dumps(items, separators=(",", ":")).encode("utf-8")
    if req.mimetype == "application/x-www-form-urlencoded":
        form = _reference_form(req, omit_fields, with_files=False)
        parts["body"] = hashlib.sha256(b"form:" + form).digest()
    elif req.mimetype == "multipart/form-data":
        form = _reference_form(req, omit_fields, with_files=True)
        parts["body"] = hashlib.sha256(b"multipart:" + form).digest()
    return parts


def reference_fingerprint(req: Request, omit_fields: frozenset[str] = frozenset()) -> str:
    return _frozen_digest(*reference_parts(req, omit_fields).values())


# -- requests ----------------------------------------------------------------------------


def make_fp_app() -> Flask:
    app = Flask("fingerprint_frozen")

    @app.route("/pay", methods=["POST", "PATCH"])
    def pay():
        return ""

    @app.post("/items/<int:item_id>")
    def item(item_id: int):
        return ""

    @app.post("/files/<path:name>")
    def files(name: str):
        return ""

    return app


@pytest.fixture(scope="module")
def app() -> Flask:
    return make_fp_app()


def compute_each(app: Flask, path: str, method: str, computes: Any, **kwargs: Any) -> list[Any]:
    """Each of ``computes`` on the same request, each in a request context of its own."""
    out = []
    for compute in computes:
        with app.test_request_context(path, method=method, **kwargs):
            out.append(compute(request, OMIT))
    return out


def both(app: Flask, path: str, method: str = "POST", **kwargs: Any) -> tuple[str, str]:
    """(today's, reference) fingerprint of the same request."""
    new, reference = compute_each(
        app, path, method, (request_fingerprint, reference_fingerprint), **kwargs
    )
    return new, reference


def frozen(app: Flask, path: str, method: str = "POST", **kwargs: Any) -> str:
    """The ``fp1`` fingerprint of the request, as records written before issue 26 hold it."""
    return str(compute_each(app, path, method, (frozen_request_fingerprint,), **kwargs)[0])


def _repeats(names: list[str]) -> bool:
    return len(set(names)) != len(names)


def _names(req: Request, omit: frozenset[str]) -> dict[str, bool]:
    """Whether the query, the form fields or the uploads repeat a name."""
    is_form = req.mimetype in ("application/x-www-form-urlencoded", "multipart/form-data")
    return {
        "query": _repeats([name for name, _ in req.args.items(multi=True)]),
        "fields": is_form and _repeats([k for k, _ in req.form.items(multi=True) if k not in omit]),
        "files": req.mimetype == "multipart/form-data"
        and _repeats([name for name, _ in req.files.items(multi=True)]),
    }


def assert_fp1_parts_kept(app: Flask, path: str, method: str = "POST", **kwargs: Any) -> None:
    """Every part of ``fp1`` the changes of issue 26 do not concern is the same bytes."""
    old, new, repeated = compute_each(
        app, path, method, (frozen_parts, reference_parts, _names), **kwargs
    )
    assert new["version"] == b"fp2"
    for name in ("method", "rule", "view_args"):
        assert new[name] == old[name], name
    # Item 3: an app that routes neither by subdomain nor by host adds the endpoint only.
    if not (app.url_map.host_matching or app.subdomain_matching):
        assert new["subdomain"] == new["host"] == b""
    # Item 1: the same query items, in the same order unless a name is repeated.
    assert sorted(json.loads(new["query"])) == json.loads(old["query"])
    if not repeated["query"]:
        assert new["query"] == old["query"]
    # Item 2: the same body, unless a form repeats a field's or an upload's name.
    if not (repeated["fields"] or repeated["files"]):
        assert new["body"] == old["body"]


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    head = f"--b0undary\r\nContent-Disposition: {disposition}\r\n"
    if filename:
        head += "Content-Type: text/plain\r\n"
    return head.encode() + b"\r\n" + value + b"\r\n"


#: A multipart body that repeats a field and an upload name.
MULTIPART = (
    _part("qty", b"50")
    + _part("doc", b"second", "b.txt")
    + _part("qty", b"1")
    + _part("doc", b"first", "a.txt")
    + _part("_idempotency_key", b"k")
    + b"--b0undary--\r\n"
)

GOLDEN = [
    (
        "/pay",
        "POST",
        {
            "data": b'{"amount_cents": 1999, "currency": "EUR", "customer": "cus_42"}',
            "content_type": "application/json",
        },
        "3169d76f50980b0544cdd2886edc409928031e6ccefc6a584624636761372be2",
        "256660dfbda95c5b381e8132dba6356c28a666bbb7cd5e4f0a037a0e25e76cb5",
    ),
    (
        "/pay?b=2&a=1&a=0",
        "PATCH",
        {
            "data": b' {"z":[1,2.5,null,true],"a":"\\u00e9"} \n',
            "content_type": "application/merge-patch+json",
        },
        "8e01901ce791e3b3048622f19ec6ced9747871e25e34f1f3253746bb9271a992",
        "dba7ff19244fa5a6811a55cedae4fa715c595e1d4dc5122fdbb51a01f1f8baad",
    ),
    (
        "/items/7",
        "POST",
        {"data": b"{not json", "content_type": "application/json; charset=utf-8"},
        "535849dded5a07908911ac024fc5864cf53826ffa0b424972ac74fcc0d09a86d",
        "b16c9880c418b0b26215a599f147bcbd3525d28d930516060b5be557791901ee",
    ),
    (
        "/items/7",
        "POST",
        {"data": '{"a":"é"}'.encode("utf-16"), "content_type": "application/json"},
        "eebd82b6ce9e00dc91b6bffc1171043c3b08880df59bda4cba261ed6a94f39de",
        "56d91d4cf9731950259afb2784e3f19950c50febf1979cba30f29a7eb9a04116",
    ),
    (
        "/pay",
        "POST",
        {"data": bytes(range(256)), "content_type": "application/octet-stream"},
        "6bf50749bbde0c6e606374e76d8f4f320f60e296b8b6eac146c1847345491989",
        "a9b9ea0ca793b42d65158fe4e8515dc3ec4053269b66614b7bd4f0b190109e69",
    ),
    (
        "/pay",
        "POST",
        {"data": {"b": "2", "a": "1", "_idempotency_key": "k"}},
        "9e7a824ea465682a91e3888aa2a99c71897ce8e0db67ae8960c4944a4b087e3f",
        "b707bd553a5e2e0b1f19adacb8ec8cb2827664422a359817619212184b994510",
    ),
    (  # a fp1 digest computed by the frozen copy, not by the code of 2026-11-24 itself
        "/pay",
        "POST",
        {"data": MULTIPART, "content_type": "multipart/form-data; boundary=b0undary"},
        "8c4d93457d4f1428ab5e023df249a474fb53a009c00e1a3e8bbef816e983d595",
        "0a18db02f51af7efa6751ec90bf7697c4293b8285d1be5e609e2ea30a3a797f2",
    ),
    (
        "/nowhere",
        "POST",
        {"data": b"[1,2]", "content_type": "application/json"},
        "35567820055291dd1340e419ae89878e56f85676b1ba163cc40ec8b6612a2508",
        "9a7b36a88fe2bafdc644a8d720edeb3c28c550d1b90348c4df077b92226daa6c",
    ),
]


@pytest.mark.parametrize(("path", "method", "kwargs", "expected", "expected_fp2"), GOLDEN)
def test_c6_fingerprints_are_the_digests_stored_records_hold(
    app: Flask, path: str, method: str, kwargs: dict[str, Any], expected: str, expected_fp2: str
) -> None:
    """``fp1``: digests computed by the implementation before issue 11 (the frozen copy's
    origin), which records written before issue 26 hold. ``fp2``: today's, pinned."""
    assert frozen(app, path, method, **kwargs) == expected
    assert both(app, path, method, **kwargs) == (expected_fp2, expected_fp2)


def test_c5_key_digests_are_the_ones_stored_records_hold() -> None:
    vectors = [
        (
            "anonymous",
            "8e03978e-40d5",
            "7d24ff4cd99634155c6b5416bd93d47cc8fd15811e593e8b8e0d06e52d774a77",
        ),
        ("user:é", '"a,b"', "79cb361f7148f174394e40dc547d6b7aa707ebffc7cf534dd329725e7d3f5f19"),
    ]
    for scope, key, expected in vectors:
        assert key_digest(scope, key) == frozen_key_digest(scope, key) == expected


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"{}",
        b"[]",
        b"[1]  ",
        b"[1] x",
        b"{} {}",
        b"\t{}",
        b"\xef\xbb\xbf{}",  # a UTF-8 byte order mark: json.loads reads it as utf-8-sig
        '{"a":1}'.encode("utf-16-le"),
        '{"a":1}'.encode("utf-16-be"),
        '{"a":1}'.encode("utf-32"),
        b"{\x00}",
        b'{"a":NaN,"b":Infinity,"c":-Infinity,"d":1e400,"e":-0.0}',
        b'{"a":1,"a":2}',
        b'{"\xed\xa0\x80":1}',  # a lone surrogate, which surrogatepass decodes
        b'{"a":"\xff"}',
        b'["\\ud800"]',
        b"[" * 5000 + b"]" * 5000,  # deeper than the recursion limit: fingerprinted raw
        b'"just a string"',
        b"12",
        b"null",
    ],
)
def test_c6_odd_json_bodies_keep_their_fingerprint(app: Flask, body: bytes) -> None:
    new, reference = both(app, "/pay", data=body, content_type="application/json")
    assert new == reference


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=10),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=15,
)


def messy_dump(value: Any, rnd: random.Random) -> str:
    """Shuffled keys, random insignificant whitespace and escaping, around and inside."""

    def ws() -> str:
        return rnd.choice(["", "", " ", "\n", "\t", "\r\n "])

    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        inner = ",".join(
            ws() + json.dumps(k, ensure_ascii=rnd.random() < 0.5) + ws() + ":" + messy_dump(v, rnd)
            for k, v in items
        )
        return "{" + inner + ws() + "}"
    if isinstance(value, list):
        return "[" + ",".join(ws() + messy_dump(v, rnd) for v in value) + ws() + "]"
    return json.dumps(value, ensure_ascii=rnd.random() < 0.5)


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    rnd = draw(st.randoms(use_true_random=False))
    text = draw(st.sampled_from(["", " ", "\n"])) + messy_dump(draw(JSON_VALUES), rnd)
    text += draw(st.sampled_from(["", " ", "\r\n", "x", "}", ","]))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-32-be"]))
    body = text.encode(encoding, "surrogatepass")
    if draw(st.booleans()) and body:
        cut = draw(st.integers(0, len(body)))
        body = body[:cut]  # a truncated body: sometimes still JSON, mostly not
    return body


CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "Application/JSON",
    "application/problem+json",
    " application/json ;x=y",
    "application/merge-patch+json",
    "application/json-patch+json",
    "text/plain",
    "text/csv",
    "text/csv; charset=latin-1",
    "application/xml",
    "application/octet-stream",
    "application/x-www-form-urlencoded",
    "",
]
#: Names that repeat often, so repeated names and their values' order are exercised.
NAMES = st.one_of(st.sampled_from(["a", "b", "amount", ""]), st.text(max_size=5))
QUERY = st.lists(st.tuples(NAMES, st.text(max_size=5)), max_size=5).map(urlencode)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    where=st.sampled_from(
        [(None, path) for path in ("/pay", "/items/7", "/files/a/b%20c", "/nowhere")]
        + [
            (by, f"http://{tenant}.example.com{path}")
            for by in ("subdomain", "host")
            for tenant in ("acme", "globex")
            for path in ("/orders", "/orders/7", "/nowhere")
        ]
    ),
    method=st.sampled_from(["POST", "PATCH"]),
    query=QUERY,
    content_type=st.sampled_from(CONTENT_TYPES),
    body=st.one_of(
        json_bodies(),
        st.binary(max_size=300),
        st.lists(st.tuples(NAMES, st.text(max_size=6)), max_size=5).map(
            lambda fields: urlencode([*fields, ("_idempotency_key", "k")]).encode()
        ),
    ),
)
def test_c6_the_fingerprint_is_the_references_for_any_request(
    app: Flask,
    where: tuple[str | None, str],
    method: str,
    query: str,
    content_type: str,
    body: bytes,
) -> None:
    """Today's code gives the reference's bytes, and every ``fp1`` part issue 26 does not
    concern is kept, on plain routes and on routes by subdomain or host."""
    by, path = where
    on = app if by is None else tenants_app(by)
    url = path + ("?" + query if query else "")
    new, reference = both(on, url, method, data=body, content_type=content_type)
    assert new == reference
    assert_fp1_parts_kept(on, url, method, data=body, content_type=content_type)


def _values_by_name(req: Request, omit: frozenset[str]) -> dict[str, list[str]]:
    return {"query": req.args.to_dict(flat=False), "form": req.form.to_dict(flat=False)}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    where=st.sampled_from(["query", "form"]),
    items=st.lists(st.tuples(NAMES, st.text(max_size=4)), min_size=2, max_size=6),
    rnd=st.randoms(use_true_random=False),
)
def test_i26_1_2_c6_a_names_values_keep_their_order_the_names_do_not(
    app: Flask, where: str, items: list[tuple[str, str]], rnd: random.Random
) -> None:
    """The new difference: ``fp1`` merged every reordering of a query or a form;
    ``fp2`` merges exactly those that leave each name's values in their order."""
    shuffled = list(items)
    rnd.shuffle(shuffled)
    requests = []
    for order in (items, shuffled):
        if where == "query":
            requests.append(("/pay?" + urlencode(order), {"json": {}}))
        else:
            form = urlencode([*order, ("_idempotency_key", "k")]).encode()
            requests.append(("/pay", {"data": form, "content_type": FORM}))
    (first, first_kwargs), (second, second_kwargs) = requests
    assert frozen(app, first, **first_kwargs) == frozen(app, second, **second_kwargs)
    read = [
        compute_each(app, url, "POST", (_values_by_name,), **kwargs)[0][where]
        for url, kwargs in requests
    ]
    same = both(app, first, **first_kwargs)[0] == both(app, second, **second_kwargs)[0]
    assert same == (read[0] == read[1])


def _mimetype(req: Request, omit: frozenset[str]) -> str:
    return req.mimetype


@pytest.mark.parametrize("body", [b'[{"b": 1, "a": 2}]', b"a,b\n1,2\n", b"a=1&b=2"])
def test_i26_4_c6_the_media_type_refines_fp1_and_nothing_else(app: Flask, body: bytes) -> None:
    """The new difference: two content types give one ``fp2`` exactly when they gave
    one ``fp1`` and name one media type (parameters and case never counted)."""
    seen = {}
    for content_type in CONTENT_TYPES:
        kwargs = {"data": body, "content_type": content_type}
        new, reference = both(app, "/pay", **kwargs)
        assert new == reference
        mimetype = compute_each(app, "/pay", "POST", (_mimetype,), **kwargs)[0]
        seen[content_type] = (new, frozen(app, "/pay", **kwargs), mimetype)
    for first, (new_a, old_a, type_a) in seen.items():
        for second, (new_b, old_b, type_b) in seen.items():
            assert (new_a == new_b) == (old_a == old_b and type_a == type_b), (first, second)


def make_tenants_app(by: str) -> Flask:
    """``/orders`` and ``/orders/<int:n>`` for two tenants, by subdomain or by host."""
    app = Flask("fingerprint_tenants")
    if by == "subdomain":
        app.config["SERVER_NAME"] = "example.com"
        app.subdomain_matching = True
    else:
        app.url_map.host_matching = True
    for tenant in ("acme", "globex"):
        where = {"subdomain": tenant} if by == "subdomain" else {"host": f"{tenant}.example.com"}
        app.add_url_rule("/orders", f"{tenant}_orders", lambda: "", methods=["POST"], **where)
        app.add_url_rule(
            "/orders/<int:n>", f"{tenant}_order", lambda n: "", methods=["POST"], **where
        )
    return app


@functools.cache
def tenants_app(by: str) -> Flask:
    return make_tenants_app(by)


@pytest.mark.parametrize("by", ["subdomain", "host"])
@pytest.mark.parametrize("path", ["/orders", "/orders/7?a=2&a=1"])
def test_i26_3_c6_tenants_routes_differ_only_by_the_new_parts(by: str, path: str) -> None:
    """The new difference: the same request to two tenants' routes had one ``fp1``; its
    ``fp2`` differs, by the endpoint and the subdomain or host parts alone."""
    app = make_tenants_app(by)
    kwargs: dict[str, Any] = {"json": {"b": 1, "a": [1, 2]}}
    prints: dict[str, tuple[str, str, str]] = {}
    parts: dict[str, dict[str, bytes]] = {}
    for tenant in ("acme", "globex"):
        base_url = f"http://{tenant}.example.com"
        new, reference = both(app, path, base_url=base_url, **kwargs)
        assert new == reference
        assert_fp1_parts_kept(app, path, base_url=base_url, **kwargs)
        prints[tenant] = (new, frozen(app, path, base_url=base_url, **kwargs), reference)
        with app.test_request_context(path, method="POST", base_url=base_url, **kwargs):
            parts[tenant] = reference_parts(request, OMIT)
    assert prints["acme"][1] == prints["globex"][1]  # fp1: one request
    assert prints["acme"][0] != prints["globex"][0]  # fp2: two
    changed = {name for name in parts["acme"] if parts["acme"][name] != parts["globex"][name]}
    assert changed == {"endpoint", by}


@settings(max_examples=200, deadline=None)
@given(scope=st.text(max_size=20), key=st.text(max_size=40))
def test_c5_the_key_digest_is_the_frozen_one(scope: str, key: str) -> None:
    try:
        expected = frozen_key_digest(scope, key)
    except UnicodeEncodeError:  # a lone surrogate: neither can digest it
        with pytest.raises(UnicodeEncodeError):
            key_digest(scope, key)
        return
    assert key_digest(scope, key) == expected


# -- the body as the view then sees it (C31, X18) -----------------------------------------


def _environ(body: bytes, declared: int, **extra: Any) -> dict[str, Any]:
    environ = EnvironBuilder(
        path="/pay", method="POST", data=body, content_type="application/json"
    ).get_environ()
    environ["CONTENT_LENGTH"] = str(declared)
    environ["wsgi.input"] = io.BytesIO(body)
    environ.update(extra)
    return environ


@pytest.mark.parametrize("compute", [request_fingerprint, frozen_request_fingerprint])
def test_c31_the_view_reads_the_body_it_would_have_read(app: Flask, compute: Any) -> None:
    body = b'{"b": 1, "a": [1, 2]}' + b" " * 70_000  # more than one 64 KiB read
    with app.request_context(_environ(body, len(body))):
        compute(request, OMIT)
        assert request.get_data() == body
        assert request.get_json() == {"a": [1, 2], "b": 1}
        assert request.stream.read() == b""  # consumed, as after get_data()


@pytest.mark.parametrize("compute", [request_fingerprint, frozen_request_fingerprint])
def test_c31_a_body_shorter_than_its_content_length_is_a_disconnect(
    app: Flask, compute: Any
) -> None:
    with app.request_context(_environ(b'{"a": 1}', 100)), pytest.raises(ClientDisconnected):
        compute(request, OMIT)


@pytest.mark.parametrize("compute", [request_fingerprint, frozen_request_fingerprint])
def test_c31_max_content_length_applies_to_the_fingerprint_read(app: Flask, compute: Any) -> None:
    app.config["MAX_CONTENT_LENGTH"] = 10
    try:
        body = b'{"a": "0123456789"}'
        with app.request_context(_environ(body, len(body))), pytest.raises(RequestEntityTooLarge):
            compute(request, OMIT)
    finally:
        app.config["MAX_CONTENT_LENGTH"] = None


def test_c31_a_body_read_before_the_layer_is_used_as_read(app: Flask) -> None:
    body = b'{"a": 1}'
    with app.request_context(_environ(body, len(body))):
        assert request.get_data() == body  # an earlier hook cached it
        cached = request_fingerprint(request, OMIT)
    assert cached == both(app, "/pay", data=body, content_type="application/json")[1]
