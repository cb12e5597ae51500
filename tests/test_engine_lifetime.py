"""Engines the extension built are released with their app (C47)."""

from __future__ import annotations

import gc
from pathlib import Path

from flask import Flask

from flask_idempotency import Idempotency, idempotent

from .support.waiting import wait_until

pytest_plugins = ["pytester"]


def _collected(pool_of: object) -> bool:
    """Collect garbage, then say whether the pool has no idle connection left. The lease
    renewer may hold the last store a moment longer, until its next tick."""
    gc.collect()
    return pool_of.checkedin() == 0  # type: ignore[attr-defined]


def test_c47_an_apps_own_engine_closes_its_connections_when_the_app_is_gone(tmp_path) -> None:
    """A short-lived app (a test, a CLI run) leaves no open database connection behind:
    Python 3.13 reports each one the garbage collector has to close as a ResourceWarning."""
    app = Flask("short_lived", instance_path=str(tmp_path / "instance"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/idem.sqlite3"
    app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    Idempotency(app)

    @app.post("/pay")
    @idempotent
    def pay() -> tuple[str, int]:
        return "paid", 201

    assert app.test_client().post("/pay", headers={"Idempotency-Key": "k1"}).status_code == 201
    engine = app.extensions["idempotency"].store.engine
    assert engine.pool.checkedin() >= 1  # the store's pooled connection is open

    del app, pay
    # disposed with the app, not left to the collector
    wait_until(lambda: _collected(engine.pool), "the engine to be disposed", within=10)


def test_c47_the_request_paths_own_pool_closes_with_its_app_on_postgresql(
    tmp_path, pg_url, pg_table
) -> None:
    """On PostgreSQL with psycopg2 the request path has a pool of its own (one round trip
    per statement); it is released with the app too, not left holding server slots."""
    app = Flask("short_lived_pg", instance_path=str(tmp_path / "instance"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = pg_url.render_as_string(hide_password=False)
    app.config["IDEMPOTENCY_TABLE"] = pg_table
    app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    Idempotency(app)

    @app.post("/pay")
    @idempotent
    def pay() -> tuple[str, int]:
        return "paid", 201

    assert app.test_client().post("/pay", headers={"Idempotency-Key": "k1"}).status_code == 201
    store = app.extensions["idempotency"].store
    engine, single = store.engine, store._single()
    assert single is not None and single.pool.checkedin() >= 1
    with engine.begin() as conn:  # leave the table for the next test run clean
        store.table.drop(conn)

    del app, pay, store
    wait_until(lambda: _collected(single.pool), "the request path's pool to close", within=10)
    wait_until(lambda: _collected(engine.pool), "the engine to be disposed", within=10)


def test_c25_a_failed_create_on_first_use_is_a_503_not_a_500(tmp_path) -> None:
    """C25: setting the store up on first use (creating the table) can meet an outage too;
    the client gets 503 store-unavailable, never a traceback, and the next request tries
    the set-up again."""
    app = Flask("unreachable_store", instance_path=str(tmp_path / "instance"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/missing-dir/idem.sqlite3"
    app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    Idempotency(app)

    @app.post("/pay")
    @idempotent
    def pay() -> tuple[str, int]:
        return "paid", 201

    client = app.test_client()
    first = client.post("/pay", headers={"Idempotency-Key": "k1"})
    assert first.status_code == 503
    assert first.get_json()["code"] == "store-unavailable"
    (tmp_path / "missing-dir").mkdir()  # the outage ends
    assert client.post("/pay", headers={"Idempotency-Key": "k1"}).status_code == 201


def test_make_app_fails_the_test_that_leaves_a_connection_checked_out(pytester, monkeypatch):
    """A connection a test checks out and never returns is closed by nobody: Python 3.13
    reported it, at interpreter exit, as an unclosed database naming no test. The
    ``make_app`` fixture fails the very test that left it."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    pytester.makeconftest("from tests.conftest import make_app  # noqa: F401\n")
    pytester.makepyfile(
        test_leaky="""
        KEPT = []

        def test_returns_it(make_app):
            app, ext = make_app()
            with app.extensions["idempotency"].store.autocommit.connect() as conn:
                conn.exec_driver_sql("SELECT 1")

        def test_keeps_it(make_app):
            app, ext = make_app()
            KEPT.append(app.extensions["idempotency"].store.autocommit.connect())
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_keeps_it*", "*never returned*"])


def test_no_pool_outlives_its_test_even_while_its_app_lives_on(pytester, monkeypatch):
    """An app the collector has not reached yet (apps live in reference cycles) keeps its
    pooled connections open: on PostgreSQL the suite once held well over a hundred. The
    suite's autouse fixture closes them when the test ends."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    pytester.makeconftest("from tests.conftest import _no_pool_outlives_its_test  # noqa: F401\n")
    pytester.makepyfile(
        test_kept="""
        from flask import Flask
        from flask_idempotency import Idempotency

        KEPT = []

        def test_uses_the_store(tmp_path):
            app = Flask("kept")
            app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/idem.sqlite3"
            Idempotency(app)
            store = app.extensions["idempotency"].store
            with store.autocommit.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            KEPT.append(store.engine)  # as an uncollected cycle would
            assert store.engine.pool.checkedin() == 1

        def test_finds_it_closed():
            assert KEPT[0].pool.checkedin() == 0
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
