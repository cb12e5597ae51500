"""Fuzzing the payments example (``example/``): hostile requests never get a 500.

Hypothesis throws random ``Idempotency-Key`` values (any latin-1 text, several
header lines, huge values), random bodies (bytes, broken JSON, valid charges,
forms) under random content types, random methods and paths at the example app
on its embedded SQLite default. Properties (C3, C18, C27):

- never a 5xx;
- every ``application/problem+json`` answer has ``type``, ``title``, ``status``,
  ``detail`` and ``code``, with ``status`` equal to the HTTP status, and the
  layer's own problems have a ``type`` ending in their code;
- a layer error stores nothing, and more generally only a first 201 adds a
  record (and a payment): everything else leaves both tables as they were.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from example.app import create_app
from example.models import Payment, db

LAYER_CODES = frozenset(
    {"missing-key", "invalid-key", "key-reused", "request-in-progress", "store-unavailable"}
)
ENV_VARS = (
    "DATABASE_URL",
    "IDEMPOTENCY_DATABASE_URI",
    "REDIS_URL",
    "IDEMPOTENCY_REDIS_URL",
    "GATEWAY_LATENCY",
)

# -- strategies --------------------------------------------------------------------------

#: Any latin-1 character a header value can carry on the wire (CR and LF end a header line).
latin1_text = st.text(
    alphabet=st.characters(min_codepoint=0, max_codepoint=255, exclude_characters="\r\n"),
    max_size=300,
)
plausible_key = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40
)
huge_key = st.builds(lambda n, c: c * n, st.integers(256, 70_000), st.sampled_from('k"é \\,'))
key_value = st.one_of(
    plausible_key,
    plausible_key.map(lambda k: '"' + k.replace("\\", "\\\\").replace('"', '\\"') + '"'),
    latin1_text,
    huge_key,
    st.sampled_from(["", " ", '""', '"a", "b"', "a, b", '"a";p=1', '"\\x"', "\t", '"unterminated']),
)
header_name = st.sampled_from(
    ["Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY", "IdEmPoTeNcY-kEy"]
)
well_formed_key = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABC0123456789-_.:", min_size=1, max_size=24
)


def mostly(
    usual: st.SearchStrategy[Any], unusual: st.SearchStrategy[Any], one_in: int
) -> st.SearchStrategy[Any]:
    """``usual`` most of the time, ``unusual`` one time in ``one_in``: the layer must be
    reached often."""
    return st.integers(1, one_in).flatmap(lambda n: unusual if n == 1 else usual)


key_lines = mostly(
    st.tuples(header_name, well_formed_key).map(lambda line: [line]),
    st.lists(st.tuples(header_name, key_value), max_size=3),
    one_in=3,
)

valid_charge = st.fixed_dictionaries(
    {
        "amount_cents": st.integers(1, 100_000_000),
        "currency": st.sampled_from(["EUR", "usd", "GBP"]),
    },
    optional={"description": st.text(max_size=40)},
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
body = mostly(
    valid_charge.map(lambda c: json.dumps(c).encode()),
    st.one_of(
        st.binary(max_size=2000),
        valid_charge.map(lambda c: json.dumps(c).encode()),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.builds(lambda c, cut: json.dumps(c).encode()[:cut], valid_charge, st.integers(0, 30)),
        st.builds(
            lambda n: b"[" * n + b"]" * n, st.integers(1, 200)
        ),  # nested, within recursion reach
        st.just(b"amount_cents=100&currency=EUR"),
        st.builds(lambda n: b"x" * n, st.integers(60_000, 70_000)),  # around MAX_CONTENT_LENGTH
    ),
    one_in=3,
)
content_type = mostly(
    st.just("application/json"),
    st.one_of(
        st.none(),
        st.sampled_from(
            [
                "application/json",
                "application/json; charset=latin-1",
                "application/problem+json",
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data",
                "multipart/form-data; boundary=zz",
                "application/octet-stream",
                "*/*",
                ";;;",
            ]
        ),
        latin1_text,
    ),
    one_in=3,
)
method = mostly(
    st.just("POST"), st.sampled_from(["PATCH", "PUT", "GET", "DELETE", "HEAD", "OPTIONS"]), 4
)
path = mostly(
    st.just("/payments"),
    st.one_of(
        st.sampled_from(["/payments/1", "/payments/abc", "/payments/", "/", "/nope"]),
        st.text(alphabet="abcXYZ019-_./%", max_size=30).map(lambda p: "/payments/" + p),
    ),
    one_in=5,
)
account = mostly(
    st.sampled_from([None, "acme", "globex"]),
    st.sampled_from(["bad account!", "", "x" * 70]),
    one_in=6,
)


# -- the app -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flask]:
    """The example on its default store: SQLite in a fresh instance folder, no Redis.

    TESTING is off so an exception shows up as the 500 a real client would get.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name in ENV_VARS:
            patch.delenv(name, raising=False)
        app = create_app(
            {"TESTING": False}, instance_path=str(tmp_path_factory.mktemp("fuzz") / "instance")
        )
        with app.app_context():
            db.create_all()
        yield app
        with app.app_context():
            db.engine.dispose()


def table_sizes(app: Flask) -> tuple[int, int]:
    """(idempotency records, payments)."""
    records = app.extensions["idempotency"].store.table
    with app.app_context():
        return (
            int(db.session.scalar(select(func.count()).select_from(records)) or 0),
            int(db.session.scalar(select(func.count()).select_from(Payment)) or 0),
        )


def assert_problem_document(response: Any) -> dict[str, Any]:
    document = json.loads(response.get_data())
    for member in ("type", "title", "status", "detail", "code"):
        assert member in document, f"{member} missing from {document}"
    assert document["status"] == response.status_code, document
    if document["code"] in LAYER_CODES:
        assert document["type"].endswith(document["code"]), document
    return document


# -- the property ------------------------------------------------------------------------


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples on every run: a CI verdict does not depend on luck
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    method=method,
    path=path,
    key_lines=key_lines,
    body=body,
    content_type=content_type,
    account=account,
)
def test_hostile_requests_never_500_and_layer_errors_store_nothing(
    example_app: Flask,
    method: str,
    path: str,
    key_lines: list[tuple[str, str]],
    body: bytes,
    content_type: str | None,
    account: str | None,
) -> None:
    headers: list[tuple[str, str]] = list(key_lines)
    if content_type is not None:
        headers.append(("Content-Type", content_type))
    if account is not None:
        headers.append(("X-Account", account))
    client: FlaskClient = example_app.test_client()
    before = table_sizes(example_app)

    response = client.open(path, method=method, headers=headers, data=body)

    after = table_sizes(example_app)
    assert response.status_code < 500, (response.status_code, response.get_data()[:500])
    layer_error = None
    if response.mimetype == "application/problem+json" and method != "HEAD":
        code = assert_problem_document(response).get("code")
        layer_error = code in LAYER_CODES
        event(f"problem {code}")
    event(f"status {response.status_code}")
    first_success = response.status_code == 201 and "Idempotent-Replayed" not in response.headers
    if first_success and method == "POST" and key_lines:
        assert after == (before[0] + 1, before[1] + 1), (before, after)
    else:
        assert after[0] == before[0], (
            f"records changed for a {response.status_code} (layer error: {layer_error})"
        )
        if not first_success:
            assert after[1] == before[1], "a payment was made without a 201"


def test_deeply_nested_json_body_is_a_client_error_not_a_500(example_app: Flask) -> None:
    """Found by the fuzz above: nesting deeper than Python's recursion limit crashed the view.

    The layer itself copes (its fingerprint treats such a body as raw bytes), and
    releases the claim on the exception; the example's view does not.
    """
    before = table_sizes(example_app)
    response = example_app.test_client().post(
        "/payments",
        data=b"[" * 5000,
        headers={"Idempotency-Key": "deep-nesting", "Content-Type": "application/json"},
    )
    assert table_sizes(example_app) == before  # released, not stored (C17)
    assert response.status_code == 400, response.status_code
    assert assert_problem_document(response)["code"] == "invalid-payment"
