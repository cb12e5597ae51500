"""Atomic mode (C40): a view whose own writes fail at flush time fails like a view exception.

Its data broke a constraint: that is the view's error, not a store outage. The
claim is released (C17), nothing is kept, and a retry runs the view again; a
503 "store unavailable" would send the client back to the same failure forever.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import func, select, text
from sqlalchemy.engine import URL

from flask_idempotency import Idempotency, idempotent

pytestmark = pytest.mark.postgres


@pytest.fixture
def atomic_app(
    pg_url: URL, pg_table: str
) -> Iterator[tuple[Flask, Any, Any, Idempotency, list[int]]]:
    app = Flask("atomic_errors")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=pg_url.render_as_string(hide_password=False),
        IDEMPOTENCY_TABLE=pg_table,
        TESTING=False,  # production: an exception becomes a 500 response
    )
    db = SQLAlchemy(app)

    class Coupon(db.Model):  # type: ignore[name-defined]
        __tablename__ = f"{pg_table}_coupons"
        id = db.Column(db.Integer, primary_key=True)
        code = db.Column(db.String(20), unique=True, nullable=False)

    ext = Idempotency(app, db=db)
    calls: list[int] = []

    @app.post("/coupons")
    @idempotent(atomic=True)
    def create_coupon():  # type: ignore[no-untyped-def]
        calls.append(1)
        db.session.add(Coupon(code="TAKEN"))  # pending: the violation surfaces at the flush
        return jsonify(created=True), 201

    with app.app_context():
        db.create_all()
        db.session.add(Coupon(code="TAKEN"))
        db.session.commit()
    try:
        yield app, db, Coupon, ext, calls
    finally:
        with app.app_context():
            db.session.remove()
            db.drop_all()
            db.engine.dispose()


def test_c40_constraint_failure_at_flush_releases_and_is_a_500(atomic_app: Any) -> None:
    app, db, coupon, ext, calls = atomic_app
    client = app.test_client()
    headers = {"Idempotency-Key": "coupon-1"}

    first = client.post("/coupons", json={}, headers=headers)
    assert first.status_code == 500  # the view's own error, not 503 store-unavailable
    with app.app_context():
        table = ext.store.table
        assert db.session.execute(select(func.count()).select_from(table)).scalar_one() == 0
        assert db.session.execute(select(func.count()).select_from(coupon)).scalar_one() == 1

    second = client.post("/coupons", json={}, headers=headers)
    assert second.status_code == 500 and "Idempotent-Replayed" not in second.headers
    assert calls == [1, 1]  # released: the retry ran the view again


@pytest.fixture
def committing_app(pg_url: URL, pg_table: str) -> Iterator[tuple[Flask, Any, Any, list[int]]]:
    """A SERIALIZABLE atomic view that commits ``db.session`` itself, then conflicts."""
    app = Flask("atomic_self_commit")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=pg_url.render_as_string(hide_password=False),
        IDEMPOTENCY_TABLE=pg_table,
        TESTING=False,  # production: the view's own commit is only logged (C40)
    )
    db = SQLAlchemy(app)

    class Charge(db.Model):  # type: ignore[name-defined]
        __tablename__ = f"{pg_table}_charges"
        id = db.Column(db.Integer, primary_key=True)

    Idempotency(app, db=db)
    calls: list[int] = []

    @app.post("/charges")
    @idempotent(atomic=True, isolation="SERIALIZABLE", retries=3)
    def charge():  # type: ignore[no-untyped-def]
        calls.append(1)
        db.session.add(Charge())
        db.session.commit()  # against the rules of atomic mode: this write is final now
        # Then a serialization failure, as a concurrent transaction would cause it.
        db.session.execute(
            text("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = '40001'; END $$")
        )
        return jsonify(charged=True), 201

    with app.app_context():
        db.create_all()
    try:
        yield app, db, Charge, calls
    finally:
        with app.app_context():
            db.session.remove()
            db.drop_all()
            db.engine.dispose()


def test_i22_5_c43_a_view_that_committed_itself_is_never_run_again_by_a_retry(
    committing_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """C43/C40: a serialization failure after the view committed its own writes must not
    re-run the view (its first charge is final); the request fails like a view error."""
    app, db, charge, calls = committing_app
    response = app.test_client().post("/charges", json={}, headers={"Idempotency-Key": "c-1"})
    assert calls == [1], f"the view ran {len(calls)} times after committing its own writes"
    assert response.status_code == 500
    with app.app_context():
        assert db.session.execute(select(func.count()).select_from(charge)).scalar_one() == 1
    assert "called db.session.commit()" in caplog.text
