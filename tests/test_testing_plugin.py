"""The users' pytest plugin, ``flask_idempotency.testing`` (issue 13; checks C8, C9, C7).

``assert_idempotent`` must pass for a protected endpoint and must catch one that
is not idempotent; ``idempotency_store`` must give each test its own records.
The inner test runs use pytester, with the plugin loaded through its ``pytest11``
entry point, the way users get it.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify, redirect, request
from werkzeug.serving import make_server

from flask_idempotency import idempotent, release_claim
from flask_idempotency.testing import assert_idempotent, isolated_store
from tests.support.gunicorn import free_port

pytest_plugins = ["pytester"]


def _payments_app(app: Flask) -> dict[str, int]:
    effects = {"protected": 0, "unprotected": 0, "releasing": 0}
    numbers = itertools.count(1)
    lock = threading.Lock()

    def charge(kind: str) -> Any:
        with lock:
            effects[kind] += 1
            number = next(numbers)
        return jsonify(id=number, amount=request.get_json()["amount"], nonce=uuid.uuid4().hex), 201

    @app.post("/payments")
    @idempotent
    def protected() -> Any:
        return charge("protected")

    @app.post("/unprotected")
    def unprotected() -> Any:  # the deliberate mistake: no @idempotent
        return charge("unprotected")

    @app.post("/releasing")
    @idempotent
    def releasing() -> Any:  # gives its key back every time: every retry charges again
        release_claim()
        return charge("releasing")

    @app.post("/orders")
    @idempotent
    def order() -> Any:
        with lock:
            effects["protected"] += 1
        return redirect("/orders/1", code=303)

    return effects


def test_c8_c9_c7_assert_idempotent_passes_a_protected_endpoint(make_pg_app) -> None:
    app, _ = make_pg_app({"IDEMPOTENCY_WAIT": 10})
    effects = _payments_app(app)
    report = assert_idempotent(
        app.test_client(), "POST", "/payments", json={"amount": 5}, concurrency=8, retries=3
    )
    assert report.executions == 1 and effects["protected"] == 1
    assert len(report.answers) == 11
    assert report.changed is not None and report.changed.status == 422
    counted = assert_idempotent(
        app.test_client(),
        "POST",
        "/payments",
        json={"amount": 6},
        counter=lambda: effects["protected"],
    )
    assert counted.executions == 1


def test_c8_assert_idempotent_catches_an_unprotected_endpoint(make_pg_app) -> None:
    app, _ = make_pg_app()
    effects = _payments_app(app)
    with pytest.raises(AssertionError, match=r"never ran the view .*@idempotent"):
        assert_idempotent(app.test_client(), "POST", "/unprotected", json={"amount": 5})
    with pytest.raises(AssertionError, match="ran 11 times for one key"):
        assert_idempotent(
            app.test_client(),
            "POST",
            "/unprotected",
            json={"amount": 5},
            counter=lambda: effects["unprotected"],
        )


def test_c19_assert_idempotent_catches_a_view_that_always_releases(make_pg_app) -> None:
    app, _ = make_pg_app({"IDEMPOTENCY_WAIT": 10})
    _payments_app(app)
    with pytest.raises(AssertionError, match=r"ran \d+ times for one key"):
        assert_idempotent(app.test_client(), "POST", "/releasing", json={"amount": 5})


@pytest.fixture
def live_server(make_pg_app) -> Iterator[tuple[str, dict[str, int]]]:
    app, _ = make_pg_app({"IDEMPOTENCY_WAIT": 10})
    effects = _payments_app(app)
    server = make_server("127.0.0.1", free_port(), app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", effects
    finally:
        server.shutdown()
        thread.join(10)


def test_c8_c9_assert_idempotent_against_a_live_server(live_server) -> None:
    url, effects = live_server
    report = assert_idempotent(
        url, "POST", "/payments", json={"amount": 7}, counter=lambda: effects["protected"]
    )
    assert report.executions == 1 and effects["protected"] == 1
    redirect_report = assert_idempotent(
        url,
        "POST",
        "/orders",
        data={"item": "tea"},
        counter=lambda: effects["protected"],
        concurrency=4,
    )
    assert {a.status for a in redirect_report.answers} == {303}  # not followed
    with pytest.raises(AssertionError, match="ran 11 times"):
        assert_idempotent(
            url, "POST", "/unprotected", json={"amount": 1}, counter=lambda: effects["unprotected"]
        )
    with pytest.raises(TypeError, match="counter="):
        assert_idempotent(url, "POST", "/payments", json={"amount": 1})


def test_isolated_store_gives_a_fresh_table_and_cache_names(make_app) -> None:
    app, _ = make_app()
    effects = _payments_app(app)
    client = app.test_client()
    headers = {"Idempotency-Key": "same-key"}
    client.post("/payments", json={"amount": 1}, headers=headers)
    with isolated_store(app) as store:
        assert store.table.name.startswith("idem_test_")
        client.post("/payments", json={"amount": 1}, headers=headers)
        replay = client.post("/payments", json={"amount": 1}, headers=headers)
        assert replay.headers["Idempotent-Replayed"] == "true"
    assert effects["protected"] == 2
    back = client.post("/payments", json={"amount": 1}, headers=headers)
    assert back.headers["Idempotent-Replayed"] == "true"  # the app's own table again
    assert effects["protected"] == 2


# -- as users run it: pytester, plugin loaded by its entry point ------------------------

CONFTEST = """
import pytest
from flask import Flask, jsonify, request
from flask_idempotency import Idempotency, idempotent

CALLS = {"n": 0}

@pytest.fixture
def app(tmp_path):
    app = Flask("users_app")
    app.config.update(TESTING=True,
        IDEMPOTENCY_DATABASE_URI=f"sqlite:///{tmp_path}/idem.sqlite3", IDEMPOTENCY_WAIT=10)
    Idempotency(app)

    @app.post("/payments")
    @idempotent
    def pay():
        CALLS["n"] += 1
        return jsonify(n=CALLS["n"]), 201

    @app.post("/broken")
    def broken():
        CALLS["n"] += 1
        return jsonify(n=CALLS["n"]), 201

    return app
"""

USERS_TESTS = """
from flask_idempotency.testing import assert_idempotent

def test_plugin_is_loaded(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("flask_idempotency")

def test_payments_are_idempotent(app, idempotency_store):
    assert_idempotent(app.test_client(), "POST", "/payments", json={"amount": 5})

def test_broken_endpoint_is_caught(app, idempotency_store):
    assert_idempotent(app.test_client(), "POST", "/broken", json={"amount": 5})

def test_first_use_of_a_fixed_key(app, idempotency_store):
    r = app.test_client().post("/payments", json={}, headers={"Idempotency-Key": "fixed"})
    assert "Idempotent-Replayed" not in r.headers

def test_fixed_key_again_in_another_test(app, idempotency_store):
    r = app.test_client().post("/payments", json={}, headers={"Idempotency-Key": "fixed"})
    assert "Idempotent-Replayed" not in r.headers
"""


def test_plugin_through_its_entry_point_catches_a_non_idempotent_endpoint(pytester) -> None:
    """The users' view: the fixture isolates tests and the helper fails the broken endpoint."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_users=USERS_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_broken_endpoint_is_caught*", "*the idempotency layer never ran the view*"]
    )


def test_idempotency_store_fixture_needs_an_app_fixture(pytester) -> None:
    pytester.makepyfile("def test_x(idempotency_store):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*needs an `app` fixture*"])


def test_c22_isolated_store_keeps_redis_copies_apart(make_app) -> None:
    """A record cached in Redis by one test is never replayed in an isolated one."""
    import redis

    from tests.conftest import REDIS_URL, service_missing

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception as exc:
        service_missing("Redis", str(exc))
    prefix = f"idem-plugin-{uuid.uuid4().hex[:8]}"
    app, _ = make_app({"IDEMPOTENCY_REDIS_URL": REDIS_URL, "IDEMPOTENCY_REDIS_PREFIX": prefix})
    effects = _payments_app(app)
    headers = {"Idempotency-Key": "cached-key"}
    try:
        app.test_client().post("/payments", json={"amount": 1}, headers=headers)
        assert client.keys(f"{prefix}:*"), "the first record was promoted to Redis"
        with isolated_store(app):
            first = app.test_client().post("/payments", json={"amount": 1}, headers=headers)
            assert "Idempotent-Replayed" not in first.headers
            again = app.test_client().post("/payments", json={"amount": 1}, headers=headers)
            assert again.headers["Idempotent-Replayed"] == "true"
        assert effects["protected"] == 2
    finally:
        for name in client.scan_iter(f"{prefix}:*"):
            client.delete(name)
        client.close()
