"""Bytes a database cannot hold never answer 500 (issue 22 item 6; CONTRACT C3, C25).

A NUL in the path (``/orders/a%00b`` on a route with a path variable) or in a
scope, and a scope with characters that are not text at all (lone surrogates,
as ``surrogateescape`` decoding leaves them), reach the store's informational
``scope`` and ``path`` columns. PostgreSQL text cannot hold a NUL, so these
used to answer 500 on every driver, and on the direct psycopg2 path also threw a
healthy pooled connection away. The record is keyed by the digest of (scope,
key), so the columns store a safe rendering and any bytes work.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from flask import jsonify

from flask_idempotency import idempotent

from .test_lifecycle import KEY, REPLAYED

pytestmark = pytest.mark.postgres

AWKWARD_SCOPES = ["acme\x00evil", "lone\udcffsurrogate", "tab\tand\x01control"]


def _orders_app(make_pg_app: Any, scope: str | None = None) -> tuple[Any, list[str]]:
    app, ext = make_pg_app()
    calls: list[str] = []
    if scope is not None:
        ext.scope_loader(lambda: scope)

    @app.post("/orders/<ref>")
    @idempotent
    def order(ref: str):
        calls.append(ref)
        return jsonify(ref=ref), 201

    return app, calls


def _pool_invalidations(app: Any) -> list[Any]:
    from sqlalchemy import event

    engine = app.extensions["idempotency"].store.engine
    seen: list[Any] = []
    event.listen(engine.pool, "invalidate", lambda *args: seen.append(args))
    event.listen(engine.pool, "soft_invalidate", lambda *args: seen.append(args))
    return seen


def test_i22_6_c3_a_nul_in_the_path_is_stored_safely_and_replays(make_pg_app) -> None:
    app, calls = _orders_app(make_pg_app)
    client = app.test_client()
    client.post("/orders/warm", json={}, headers={"Idempotency-Key": "warm"})  # a pooled conn
    invalidated = _pool_invalidations(app)
    first = client.post("/orders/a%00b", json={"n": 1}, headers=KEY)
    assert first.status_code == 201, first.get_data(as_text=True)
    again = client.post("/orders/a%00b", json={"n": 1}, headers=KEY)
    assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
    assert calls == ["warm", "a\x00b"]
    assert invalidated == [], "a healthy pooled connection was thrown away"


@pytest.mark.parametrize("scope", AWKWARD_SCOPES, ids=["nul", "surrogate", "control"])
def test_i22_6_c5_any_scope_a_loader_returns_works(make_pg_app, scope: str) -> None:
    app, calls = _orders_app(make_pg_app, scope)
    client = app.test_client()
    client.post("/orders/warm", json={}, headers={"Idempotency-Key": "warm"})
    invalidated = _pool_invalidations(app)
    first = client.post("/orders/x", json={"n": 1}, headers=KEY)
    assert first.status_code == 201, first.get_data(as_text=True)
    again = client.post("/orders/x", json={"n": 1}, headers=KEY)
    assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
    assert calls == ["warm", "x"]
    assert invalidated == []


def test_i22_6_c5_a_scope_the_client_encoding_cannot_carry_works(
    make_app, pg_driver_url, pg_table
) -> None:
    """A database connection in LATIN1 cannot send "€": the columns get an escaped
    rendering instead of the request failing, and the pooled connection stays."""
    url = pg_driver_url.update_query_dict({"client_encoding": "latin1"})
    app, ext = make_app(
        {
            "IDEMPOTENCY_DATABASE_URI": url.render_as_string(hide_password=False),
            "IDEMPOTENCY_TABLE": pg_table,
        }
    )
    ext.scope_loader(lambda: "tenant-€-ü")
    calls: list[str] = []

    @app.post("/orders/<ref>")
    @idempotent
    def order(ref: str):
        calls.append(ref)
        return jsonify(ref=ref), 201

    client = app.test_client()
    try:
        client.post("/orders/warm", json={}, headers={"Idempotency-Key": "warm"})
        invalidated = _pool_invalidations(app)
        first = client.post("/orders/x", json={"n": 1}, headers=KEY)
        assert first.status_code == 201, first.get_data(as_text=True)
        again = client.post("/orders/x", json={"n": 1}, headers=KEY)
        assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"
        assert calls == ["warm", "x"]
        assert invalidated == []
    finally:
        store = app.extensions["idempotency"].store
        store.table.drop(store.engine, checkfirst=True)


@pytest.mark.parametrize("store", ["sqlite"])
def test_i22_6_c9_any_scope_and_path_value_replays_property(make_app, store: str) -> None:
    """Property (issue 22.6): whatever text a scope loader returns and whatever a path
    variable holds, the first request runs once and its retry replays; never a 500."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    app, ext = make_app()
    current: dict[str, str] = {}
    ext.scope_loader(lambda: current["scope"])
    calls: list[str] = []

    @app.post("/orders/<ref>")
    @idempotent
    def order(ref: str):
        calls.append(ref)
        return jsonify(n=len(calls)), 201

    client = app.test_client()
    seen = 0

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        scope=st.text(st.characters(exclude_categories=()), min_size=1, max_size=12),
        ref=st.text(st.characters(blacklist_characters="/", codec="utf-8"), min_size=1, max_size=8),
    )
    @example(scope="lone\udcff", ref="a\x00b")
    @example(scope="nul\x00", ref="\u20ac")
    def run(scope: str, ref: str) -> None:
        nonlocal seen
        current["scope"] = scope
        key = {"Idempotency-Key": f"k-{seen}"}
        seen += 1
        path = "/orders/" + quote(ref, safe="")
        first = client.post(path, json={}, headers=key)
        assert first.status_code == 201, first.get_data(as_text=True)
        again = client.post(path, json={}, headers=key)
        assert again.status_code == 201 and again.headers.get(REPLAYED) == "true"

    run()
    assert len(calls) == seen
