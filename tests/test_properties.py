"""Property tests (Hypothesis): header parsing, fingerprint invariance, exact replay.

CONTRACT C2, C3, C6, C9, C33.

Fingerprints are computed on real Flask requests; replay goes through a real app
and the SQLite store. ``max_examples`` is moderate and there is no deadline, so
a loaded 2-core machine does not turn into flaky failures.
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any
from urllib.parse import urlencode

import pytest
from flask import Flask, Response, request
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.config import CALLER_STATUSES, TRANSIENT_STATUSES, Settings
from flask_idempotency.fingerprint import key_digest, request_fingerprint
from flask_idempotency.keys import InvalidKey, parse_key
from flask_idempotency.records import Claim, Completed, Identity, Record, StoredResponse
from flask_idempotency.responses import (
    BODY_HEADERS,
    BODY_OMITTED_HEADER,
    BODY_OMITTED_VALUE,
    capture,
    replay,
)
from flask_idempotency.store import DurableStore
from flask_idempotency.store.connect import create_store_engine

PROPERTY_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
BARE_ALPHABET = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters='"\\,;')
OUTSIDE_PRINTABLE = st.characters(blacklist_categories=(), codec=None).filter(
    lambda c: not 0x20 <= ord(c) <= 0x7E
)


def sf_string(text: str) -> str:
    """Serialise ``text`` as an RFC 9651 String."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- header parsing ------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(text=st.text(PRINTABLE, min_size=1, max_size=255), strict=st.booleans())
def test_c2_sf_string_round_trip(text: str, strict: bool) -> None:
    assert parse_key([sf_string(text)], strict=strict) == text


@PROPERTY_SETTINGS
@given(
    text=st.text(PRINTABLE, min_size=1, max_size=64),
    params=st.lists(
        st.tuples(
            st.from_regex(r"[a-z*][a-z0-9_.*-]{0,8}", fullmatch=True),
            st.one_of(
                st.none(),
                st.integers(-(10**15) + 1, 10**15 - 1).map(str),
                st.booleans().map(lambda b: "?1" if b else "?0"),
                st.text(PRINTABLE, max_size=10).map(sf_string),
                st.from_regex(r"[A-Za-z*][A-Za-z0-9:/!#$%&'*+.^_`|~-]{0,8}", fullmatch=True),
            ),
        ),
        max_size=4,
    ),
)
def test_c2_parameters_never_change_the_key(text: str, params: list[tuple[str, Any]]) -> None:
    suffix = "".join(f";{k}" if v is None else f";{k}={v}" for k, v in params)
    assert parse_key([sf_string(text) + suffix]) == text


@PROPERTY_SETTINGS
@given(key=st.text(BARE_ALPHABET, min_size=1, max_size=255))
def test_c2_bare_keys_parse_to_themselves_and_equal_their_quoted_form(key: str) -> None:
    assert parse_key([key]) == key
    assert parse_key([sf_string(key)]) == key
    with pytest.raises(InvalidKey, match='"key"'):  # strict mode reads only sf-strings (i9.7)
        parse_key([key], strict=True)


@PROPERTY_SETTINGS
@given(
    before=st.text(PRINTABLE, max_size=20),
    bad=OUTSIDE_PRINTABLE,
    after=st.text(PRINTABLE, max_size=20),
    strict=st.booleans(),
)
def test_c3_any_char_outside_printable_ascii_inside_quotes_is_rejected(
    before: str, bad: str, after: str, strict: bool
) -> None:
    with pytest.raises(InvalidKey):
        parse_key([sf_string(before + bad + after)], strict=strict)


@PROPERTY_SETTINGS
@given(text=st.text(min_size=0, max_size=300))
def test_c3_parse_key_only_ever_returns_a_valid_key_or_raises_invalid_key(text: str) -> None:
    """Total function: any input is a key of printable ASCII within the limit, None, or
    InvalidKey."""
    try:
        key = parse_key([text])
    except InvalidKey:
        return
    assert key is not None
    assert 1 <= len(key) <= 255
    assert all(0x20 <= ord(c) <= 0x7E for c in key)


# -- fingerprint ----------------------------------------------------------------------------------


JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
JSON_DOCS = st.dictionaries(st.text(max_size=8), JSON_VALUES, min_size=1, max_size=6)


def messy_dump(value: Any, rnd: random.Random) -> str:
    """Serialise with shuffled keys, random insignificant whitespace and random escaping."""

    def ws() -> str:
        return rnd.choice(["", " ", "\n", "\t", "  ", "\r\n", " \n  "])

    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        inner = ",".join(
            ws()
            + json.dumps(k, ensure_ascii=rnd.random() < 0.5)
            + ws()
            + ":"
            + ws()
            + messy_dump(v, rnd)
            + ws()
            for k, v in items
        )
        return "{" + ws() + inner + "}"
    if isinstance(value, list):
        return "[" + ws() + ",".join(ws() + messy_dump(v, rnd) + ws() for v in value) + "]"
    return json.dumps(value, ensure_ascii=rnd.random() < 0.5)


@pytest.fixture(scope="module")
def fp_app() -> Flask:
    app = Flask("properties_fp")

    @app.route("/a", methods=["POST", "PATCH"])
    def route_a():
        return ""

    @app.post("/b")
    def route_b():
        return ""

    return app


def fingerprint(
    app: Flask,
    body: str | bytes,
    *,
    path: str = "/a",
    method: str = "POST",
    query: str = "",
    content_type: str = "application/json",
) -> str:
    url = path + ("?" + query if query else "")
    with app.test_request_context(url, method=method, data=body, content_type=content_type):
        return request_fingerprint(request)


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@PROPERTY_SETTINGS
@given(doc=JSON_DOCS, rnd=st.randoms(use_true_random=False))
def test_c6_json_key_order_and_whitespace_never_matter(fp_app, doc, rnd) -> None:
    messy = messy_dump(doc, rnd)
    assert json.loads(messy) == json.loads(json.dumps(doc))  # the generator is honest
    assert fingerprint(fp_app, messy) == fingerprint(fp_app, json.dumps(doc))


@PROPERTY_SETTINGS
@given(doc=JSON_DOCS, data=st.data())
def test_c6_changing_any_value_changes_the_fingerprint(fp_app, doc, data) -> None:
    key = data.draw(st.sampled_from(sorted(doc)))
    new_value = data.draw(JSON_VALUES)
    assume(canonical(new_value) != canonical(doc[key]))
    changed = {**doc, key: new_value}
    assert fingerprint(fp_app, json.dumps(changed)) != fingerprint(fp_app, json.dumps(doc))


@PROPERTY_SETTINGS
@given(doc=JSON_DOCS, data=st.data())
def test_c6_adding_or_removing_a_key_changes_the_fingerprint(fp_app, doc, data) -> None:
    new_key = data.draw(st.text(max_size=8))
    assume(new_key not in doc)
    bigger = {**doc, new_key: data.draw(JSON_VALUES)}
    assert fingerprint(fp_app, json.dumps(bigger)) != fingerprint(fp_app, json.dumps(doc))


@PROPERTY_SETTINGS
@given(doc=JSON_DOCS)
def test_c6_method_and_route_change_the_fingerprint(fp_app, doc) -> None:
    body = json.dumps(doc)
    post_a = fingerprint(fp_app, body)
    assert fingerprint(fp_app, body, method="PATCH") != post_a
    assert fingerprint(fp_app, body, path="/b") != post_a


QUERY_ITEMS = st.lists(
    st.tuples(st.text(PRINTABLE, min_size=1, max_size=6), st.text(PRINTABLE, max_size=6)),
    max_size=5,
)


def encode_query(items: list[tuple[str, str]]) -> str:
    return urlencode(items)


def values_by_name(items: list[tuple[str, str]]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name, value in items:
        grouped.setdefault(name, []).append(value)
    return grouped


@PROPERTY_SETTINGS
@given(items=QUERY_ITEMS, other=QUERY_ITEMS, rnd=st.randoms(use_true_random=False))
def test_c6_query_name_order_never_matters_and_content_does(fp_app, items, other, rnd) -> None:
    """C6: the names may come in any order; each name's values count in their order."""
    names = [name for name, _ in items]
    rnd.shuffle(names)
    values = {name: iter(found) for name, found in values_by_name(items).items()}
    interleaved = [(name, next(values[name])) for name in names]
    base = fingerprint(fp_app, "{}", query=encode_query(items))
    assert fingerprint(fp_app, "{}", query=encode_query(interleaved)) == base
    if values_by_name(other) != values_by_name(items):
        assert fingerprint(fp_app, "{}", query=encode_query(other)) != base


@PROPERTY_SETTINGS
@given(body=st.binary(max_size=2048), other=st.binary(max_size=2048))
def test_c6_raw_bodies_differ_exactly_when_their_bytes_do(fp_app, body, other) -> None:
    ct = "application/octet-stream"
    same = fingerprint(fp_app, body, content_type=ct) == fingerprint(fp_app, other, content_type=ct)
    assert same == (body == other)


# -- stored and replayed bodies are byte-identical -------------------------------------------------

STORED_STATUSES = [
    s
    for s in [
        *range(200, 209),
        226,
        *range(300, 309),
        *range(400, 419),
        421,
        422,
        424,
        426,
        428,
        431,
        451,
        299,
        399,
        499,
    ]
    if s not in TRANSIENT_STATUSES and s not in CALLER_STATUSES
]


@pytest.fixture(scope="module")
def replay_app(tmp_path_factory) -> tuple[Flask, list[str]]:
    tmp = tmp_path_factory.mktemp("replay")
    app = Flask("properties_replay", instance_path=str(tmp / "instance"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp}/replay.sqlite3"
    app.config["IDEMPOTENCY_WAIT"] = 0
    Idempotency(app)
    store = app.extensions["idempotency"].store
    store.create_table()
    calls: list[str] = []

    @app.post("/echo")
    @idempotent
    def echo():
        calls.append(request.headers["Idempotency-Key"])
        status = int(request.args["status"])
        return Response(request.get_data(), status=status, mimetype=request.args["mimetype"])

    yield app, calls
    store.engine.dispose()


@PROPERTY_SETTINGS
@given(
    body=st.binary(max_size=4096),
    status=st.sampled_from(STORED_STATUSES),
    mimetype=st.sampled_from(["application/octet-stream", "application/json", "text/plain"]),
)
def test_c9_replay_is_byte_identical(replay_app, body: bytes, status: int, mimetype: str) -> None:
    app, calls = replay_app
    key = uuid.uuid4().hex
    client = app.test_client()
    kwargs = {
        "query_string": {"status": status, "mimetype": mimetype},
        "data": body,
        "content_type": "application/octet-stream",
        "headers": {"Idempotency-Key": key},
    }
    first = client.post("/echo", **kwargs)
    replay = client.post("/echo", **kwargs)
    assert first.status_code == replay.status_code == status
    assert replay.data == first.data
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert "Idempotent-Replayed" not in first.headers
    assert replay.headers.get("Content-Type") == first.headers.get("Content-Type")
    assert calls.count(key) == 1


def frozen_replay(completed: Completed, settings_: Settings) -> Response:
    """``responses.replay`` as it was before issue 11 (one Response, then header sets)."""
    stored = completed.response
    response = Response(stored.body, status=stored.status, headers=list(stored.headers))
    if not any(name.lower() == "content-type" for name, _ in stored.headers):
        del response.headers["Content-Type"]
    response.headers[settings_.replay_header] = "true"
    if stored.body_omitted:
        response.headers[BODY_OMITTED_HEADER] = BODY_OMITTED_VALUE
    return response


#: Header names a replay meets, some of them the names a replay adds itself.
REPLAY_HEADER_NAMES = st.sampled_from(
    [
        "Content-Type",
        "content-type",
        "Location",
        "ETag",
        "Content-Language",
        "Content-Encoding",
        "Idempotent-Replayed",
        "idempotency-replay",
        "Content-Length",
        "X-Replayed",
    ]
)
HEADER_VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)


@PROPERTY_SETTINGS
@given(
    body=st.binary(max_size=512),
    status=st.sampled_from([200, 201, 204, 299, 302, 404, 422, 500]),
    headers=st.lists(st.tuples(REPLAY_HEADER_NAMES, HEADER_VALUES), max_size=4),
    omitted=st.booleans(),
    replay_header=st.sampled_from(["Idempotent-Replayed", "X-Replayed"]),
)
def test_c9_c33_replay_builds_what_it_always_built(
    body: bytes,
    status: int,
    headers: list[tuple[str, str]],
    omitted: bool,
    replay_header: str,
) -> None:
    """Status, headers in order, body: as before issue 11, also when a stored header has
    the name of one the replay adds (the added one replaces it where it stood)."""
    stored = StoredResponse(status, tuple(headers), b"" if omitted else body, omitted)
    completed = Completed("f" * 64, 0, stored)
    options = Settings(replay_header=replay_header)
    new, old = replay(completed, options), frozen_replay(completed, options)
    assert isinstance(new, Response)
    assert (new.status, list(new.headers), new.get_data()) == (
        old.status,
        list(old.headers),
        old.get_data(),
    )


def frozen_capture(response: Response, settings_: Settings) -> StoredResponse:
    """``responses.capture`` before issue 11, for a body held as a sequence."""
    headers = tuple(
        (name, value)
        for name, value in response.headers.items()
        if name.lower() in settings_.replay_headers or name.lower() in BODY_HEADERS
    )
    body = response.get_data()
    if len(body) > settings_.max_body_bytes:
        return StoredResponse(response.status_code, headers, b"", body_omitted=True)
    return StoredResponse(response.status_code, headers, body)


@PROPERTY_SETTINGS
@given(
    chunks=st.lists(st.one_of(st.binary(max_size=64), st.text(max_size=16)), max_size=3),
    headers=st.lists(st.tuples(REPLAY_HEADER_NAMES, HEADER_VALUES), max_size=4),
    limit=st.integers(1, 100),
)
def test_c9_c33_capture_stores_what_it_always_stored(
    chunks: list[bytes | str], headers: list[tuple[str, str]], limit: int
) -> None:
    options = Settings(max_body_bytes=limit)
    first = Response(list(chunks), status=201, headers=headers)
    second = Response(list(chunks), status=201, headers=headers)
    assert capture(first, options) == frozen_capture(second, options)


@PROPERTY_SETTINGS
@given(
    body=st.binary(max_size=2048),
    status=st.integers(100, 599),
    headers=st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=20)), max_size=4),
    omitted=st.booleans(),
    expires=st.integers(0, 2**53),
)
def test_c22_cache_record_round_trips(body, status, headers, omitted, expires) -> None:
    record = Completed("f" * 64, expires, StoredResponse(status, tuple(headers), body, omitted))
    assert Completed.from_json(record.to_json()) == record


# -- forms ---------------------------------------------------------------------------------

FORM_FIELDS = st.lists(
    st.tuples(st.text(min_size=1, max_size=8), st.text(max_size=8)), min_size=1, max_size=6
)


@PROPERTY_SETTINGS
@given(fields=FORM_FIELDS, other=FORM_FIELDS, rnd=st.randoms(use_true_random=False))
def test_c6_form_field_name_order_never_matters_and_content_does(
    fp_app, fields, other, rnd
) -> None:
    """C6: the names may come in any order; each name's values count in their order."""
    ct = "application/x-www-form-urlencoded"
    names = [name for name, _ in fields]
    rnd.shuffle(names)
    values = {name: iter(found) for name, found in values_by_name(fields).items()}
    interleaved = [(name, next(values[name])) for name in names]
    base = fingerprint(fp_app, urlencode(fields), content_type=ct)
    assert fingerprint(fp_app, urlencode(interleaved), content_type=ct) == base
    if values_by_name(other) != values_by_name(fields):
        assert fingerprint(fp_app, urlencode(other), content_type=ct) != base


# -- the durable store against a model ------------------------------------------------------------


@pytest.fixture(scope="module")
def store_engine(tmp_path_factory):
    engine = create_store_engine(f"sqlite:///{tmp_path_factory.mktemp('model')}/model.sqlite3")
    yield engine
    engine.dispose()


class StoreModel:
    """What the store must say, per key: absent, or (state, fingerprint, current token)."""

    def __init__(self) -> None:
        self.records: dict[str, tuple[str, str, str | None]] = {}


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "complete", "release"]),
        st.sampled_from(["k1", "k2", "k3"]),
        st.sampled_from(["fp-a", "fp-b"]),
        st.integers(0, 10),  # which earlier claim a complete/release uses
    ),
    min_size=1,
    max_size=40,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(operations=OPERATIONS)
def test_c8_c14_c20_store_follows_the_model(store_engine, operations) -> None:
    """Any sequence of claims, completions and releases (stale ones included) obeys the rules:
    one owner per key, only the current token writes, a release frees the key, a
    completed record stays completed and keeps its response."""
    store = DurableStore(
        lambda: store_engine, table_name=f"m_{uuid.uuid4().hex[:12]}", create_table=True
    )
    model = StoreModel()
    claims: list[tuple[str, Claim]] = []
    try:
        for op, key, fp, pick in operations:
            digest = key_digest("s", key)
            fp_hex = fp.ljust(64, "0")
            expected = model.records.get(key)
            if op == "acquire":
                outcome = store.acquire(
                    Identity("s", digest, fp_hex, "POST", "/"), ttl=3600, lease=600
                )
                if expected is None:
                    assert isinstance(outcome, Claim) and outcome.how == "new"
                    model.records[key] = ("in_progress", fp_hex, outcome.lock_token)
                    claims.append((key, outcome))
                else:
                    assert isinstance(outcome, Record)
                    assert (outcome.state, outcome.fingerprint, outcome.lock_token) == expected
            elif claims:
                claim_key, claim = claims[pick % len(claims)]
                current = model.records.get(claim_key)
                # Only an in-progress record is owned; a completed one keeps its last owner's
                # token (so a completion whose COMMIT reply was lost knows itself) but no
                # token writes to it again.
                is_owner = (
                    current is not None
                    and current[0] == "in_progress"
                    and current[2] == claim.lock_token
                )
                if op == "complete":
                    body = f"{claim_key}:{claim.lock_token}".encode()
                    result = store.complete(claim, StoredResponse(201, (), body))
                    assert (result is not None) == is_owner
                    if is_owner:
                        model.records[claim_key] = ("completed", current[1], claim.lock_token)
                else:
                    assert store.release(claim) == is_owner
                    if is_owner:
                        del model.records[claim_key]
            for model_key in ("k1", "k2", "k3"):
                record = store.get(key_digest("s", model_key))
                want = model.records.get(model_key)
                if want is None:
                    assert record is None
                else:
                    assert (record.state, record.fingerprint, record.lock_token) == want
                    if record.state == "completed":
                        assert record.response.body.startswith(f"{model_key}:".encode())
    finally:
        store.table.drop(store_engine, checkfirst=True)


@PROPERTY_SETTINGS
@given(
    raw=st.one_of(
        st.binary(max_size=200),
        st.text(max_size=200),
        st.recursive(
            JSON_SCALARS,
            lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=3), c)),
            max_leaves=10,
        ).map(json.dumps),
        st.fixed_dictionaries(
            {"v": st.just(1)},
            optional={
                "fp": JSON_VALUES,
                "exp": JSON_VALUES,
                "st": JSON_VALUES,
                "h": JSON_VALUES,
                "b": JSON_VALUES,
                "om": JSON_VALUES,
            },
        ).map(json.dumps),
    )
)
@example(raw='{"v":1,"fp":"x","exp":1e999,"st":200,"h":[],"b":"","om":false}')  # inf
@example(raw='{"v":1,"fp":"x","exp":1,"st":-1e999,"h":[],"b":"","om":false}')
def test_c24_garbage_in_the_cache_is_a_miss_never_an_error(raw) -> None:
    """Whatever sits under a cache key (another version, a bug, an attacker with Redis
    access), decoding it gives a record or ``None``; it never raises into a request."""
    decoded = Completed.from_json(raw)
    assert decoded is None or isinstance(decoded, Completed)
