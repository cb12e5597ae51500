"""Misuse fails loudly (issue 23 items 1-4; CONTRACT C56).

- A view marked ``@idempotent`` in an app that never initialised the extension
  refuses to run, with "did you forget to call init_app?", instead of running
  unprotected on every request.
- A marked route none of whose methods can ever be protected (GET only, PUT
  without ``methods=``) is named in one WARNING at the first request.
- ``IDEMPOTENCY_ENABLED = False`` turns the layer off for an app: marked views
  run plainly, and neither the store nor Redis is touched.
- A malformed or clashing setting names the setting (and the default it clashes
  with); ``flask idempotency show`` names the scope it searched; a response too
  large to store is named once per endpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from flask import Blueprint, Flask, jsonify
from flask.views import MethodView

from flask_idempotency import Idempotency, idempotent

KEY = {"Idempotency-Key": "key-1"}


def _app(tmp_path: Any, name: str = "misuse", **config: Any) -> Flask:
    app = Flask(name, instance_path=str(tmp_path / name))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/{name}.sqlite3"
    app.config["IDEMPOTENCY_CREATE_TABLE"] = True
    app.config.update(config)
    return app


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and r.levelno == logging.WARNING
    ]


# -- item 1: a marked view in an app without the extension ----------------------------------


def test_i23_1_c56_a_marked_view_without_init_app_refuses_to_run(tmp_path) -> None:
    """C56: required=True, no key, no init_app: not 201 three times, but an error naming
    init_app, and the view never runs."""
    app = _app(tmp_path)
    calls: list[int] = []

    @app.post("/refunds")
    @idempotent(required=True)
    def refund():
        calls.append(1)
        return jsonify(ok=True), 201

    app.testing = True
    client = app.test_client()
    with pytest.raises(RuntimeError, match="init_app") as raised:
        client.post("/refunds")
    assert "'refund'" in str(raised.value) and "not initialised" in str(raised.value)
    app.testing = False  # in production: a 500 (Flask logs the error), never a silent 201
    for _ in range(2):
        assert client.post("/refunds").status_code == 500
    assert calls == []


def test_i23_1_c56_a_blueprint_refuses_only_in_the_app_without_init_app(tmp_path) -> None:
    """C56 with blueprints and app factories: the same marked view on two apps; the one
    that initialised the extension protects it, the other refuses it."""
    bp = Blueprint("shop", __name__)
    calls: list[str] = []

    @bp.post("/orders")
    @idempotent
    def order():
        calls.append("order")
        return jsonify(n=len(calls)), 201

    def create_app(name: str, with_extension: bool) -> Flask:
        app = _app(tmp_path, name)
        app.register_blueprint(bp)
        if with_extension:
            Idempotency().init_app(app)  # after the blueprint: the factory order
        app.testing = True
        return app

    good, bad = create_app("good", True), create_app("bad", False)
    first = good.test_client().post("/orders", headers=KEY)
    again = good.test_client().post("/orders", headers=KEY)
    assert first.status_code == 201 and again.headers.get("Idempotent-Replayed") == "true"
    with pytest.raises(RuntimeError, match=r"'shop\.order'.*init_app"):
        bad.test_client().post("/orders", headers=KEY)
    assert calls == ["order"]


def test_i23_1_c56_a_class_based_view_without_init_app_refuses_to_run(tmp_path) -> None:
    class Payments(MethodView):
        @idempotent
        def post(self):
            return jsonify(ok=True), 201

        def get(self):
            return jsonify(listed=True)

    app = _app(tmp_path)
    app.add_url_rule("/payments", view_func=Payments.as_view("payments"))
    app.testing = True
    client = app.test_client()
    assert client.get("/payments").status_code == 200  # unmarked handler: untouched
    with pytest.raises(RuntimeError, match="init_app"):
        client.post("/payments", headers=KEY)

    protected = _app(tmp_path, "protected")
    protected.add_url_rule("/payments", view_func=Payments.as_view("payments"))
    Idempotency(protected)
    client = protected.test_client()
    assert client.post("/payments", headers=KEY).status_code == 201
    assert client.post("/payments", headers=KEY).headers.get("Idempotent-Replayed") == "true"


def test_i23_1_a_marked_function_still_runs_as_a_plain_function() -> None:
    """Outside any app (a unit test calling the view function) it is just a function."""

    @idempotent(required=True)
    def add(a: int, b: int) -> int:
        return a + b

    assert add(2, 3) == 5
    assert add.__name__ == "add"


def test_i23_1_a_marked_class_stays_a_class() -> None:
    """The guard wraps functions only: a class keeps its ``as_view``."""

    @idempotent
    class Payments(MethodView):
        def post(self):
            return "ok", 201

    assert isinstance(Payments, type) and callable(Payments.as_view("payments"))


def test_i23_1_a_protected_request_never_runs_the_guard(make_app) -> None:
    """The layer calls the view itself: the guard costs a protected request nothing."""
    from tests.test_request_state import _calls_into_the_package

    app, _ = make_app()

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(paid=True), 201

    client = app.test_client()
    assert client.post("/pay", headers=KEY).status_code == 201
    entered = _calls_into_the_package(lambda: client.post("/pay", headers=KEY))
    assert entered and "guarded" not in entered and "_require_extension" not in entered


# -- item 2: a marked route none of whose methods can be protected --------------------------


def _first_request_warnings(app: Flask, caplog: pytest.LogCaptureFixture, path: str) -> list[str]:
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    client = app.test_client()
    client.open(path, method="GET")
    client.open(path, method="GET")
    return [w for w in _warnings(caplog) if "@idempotent" in w]


def test_i23_2_c56_a_get_only_marked_route_is_named_once_at_the_first_request(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(tmp_path)

    @app.get("/report")
    @idempotent
    def report():
        return jsonify(ok=True)

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(ok=True), 201

    Idempotency(app)
    [warning] = _first_request_warnings(app, caplog, "/report")
    assert "'report'" in warning and "GET, HEAD, OPTIONS" in warning
    assert "(PATCH, POST)" in warning and "IDEMPOTENCY_METHODS" in warning
    assert "methods=" in warning and "unprotected" in warning


def test_i23_2_c56_a_put_route_is_named_unless_put_is_keyed(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(tmp_path)

    @app.put("/items/<int:n>")
    @idempotent
    def replace_item(n: int):
        return jsonify(n=n)

    @app.put("/things/<int:n>")
    @idempotent(methods=["PUT"])
    def replace_thing(n: int):
        return jsonify(n=n)

    @app.route("/both", methods=["GET", "POST"])
    @idempotent
    def both():
        return jsonify(ok=True)

    Idempotency(app)
    warnings = _first_request_warnings(app, caplog, "/both")
    assert len(warnings) == 1
    assert "'replace_item'" in warnings[0] and "PUT" in warnings[0]


def test_i23_2_c56_a_class_based_view_marked_on_get_is_named(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    class Things(MethodView):
        @idempotent
        def get(self):
            return jsonify(ok=True)

        def post(self):
            return jsonify(ok=True), 201

    app = _app(tmp_path)
    app.add_url_rule("/things", view_func=Things.as_view("things"))
    Idempotency(app)
    [warning] = _first_request_warnings(app, caplog, "/things")
    assert "'things'" in warning and "covers GET," in warning


# -- item 3: IDEMPOTENCY_ENABLED ----------------------------------------------------------------


class _Listener:
    """A TCP port that only counts who connects: the store's or Redis's, for a test that
    must prove nobody did."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("flag", [False, "false", "0"])
def test_i23_3_c56_disabled_runs_marked_views_plainly_and_touches_no_store_or_redis(
    tmp_path, caplog: pytest.LogCaptureFixture, flag: Any
) -> None:
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    database, cache = _Listener(), _Listener()
    try:
        app = _app(
            tmp_path,
            IDEMPOTENCY_ENABLED=flag,
            IDEMPOTENCY_DATABASE_URI=f"postgresql+psycopg2://u@127.0.0.1:{database.port}/x",
            IDEMPOTENCY_REDIS_URL=f"redis://127.0.0.1:{cache.port}/0",
        )
        calls: list[int] = []

        @app.post("/refunds")
        @idempotent(required=True)
        def refund():
            calls.append(1)
            return jsonify(n=len(calls)), 201

        idempotency = Idempotency(app)
        client = app.test_client()
        answers = [client.post("/refunds", headers=KEY) for _ in range(2)]
        answers.append(client.post("/refunds"))  # required=True, and no key: still runs
        assert [a.status_code for a in answers] == [201, 201, 201]
        assert not [a for a in answers if "Idempotent-Replayed" in a.headers]
        assert calls == [1, 1, 1]
        with app.app_context():
            with idempotency.once("job-1") as run:
                assert run.owned
            with idempotency.once("job-1") as run:
                assert run.owned  # the work runs every time
        assert database.connections() == 0 and cache.connections() == 0
        assert app.extensions["idempotency"].store._engines is None
        assert any("DISABLED" in r.getMessage() for r in caplog.records)
    finally:
        database.close()
        cache.close()


def test_i23_3_c56_the_testing_plugin_honours_the_switch(tmp_path) -> None:
    """isolated_store makes no table for a disabled app; assert_idempotent says why it
    cannot pass instead of reporting the view ran 10 times."""
    from sqlalchemy import inspect

    from flask_idempotency.testing import assert_idempotent, isolated_store

    app = _app(tmp_path, IDEMPOTENCY_ENABLED=False)

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(ok=True), 201

    Idempotency(app)
    with isolated_store(app) as store:
        assert store is app.extensions["idempotency"].store
        assert store._engines is None  # no table made, no connection opened
    with pytest.raises(AssertionError, match="IDEMPOTENCY_ENABLED = False"):
        assert_idempotent(app.test_client(), "POST", "/pay", json={"a": 1})

    enabled = _app(tmp_path, "enabled")
    Idempotency(enabled)
    with isolated_store(enabled) as store:
        assert inspect(store.engine).has_table(store.table.name)


def test_i23_3_a_malformed_switch_names_the_setting(tmp_path) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_ENABLED must be True or False"):
        Idempotency(_app(tmp_path, IDEMPOTENCY_ENABLED="maybe"))


# -- item 4: errors that name their setting ---------------------------------------------------


@pytest.mark.parametrize("url", ["localhost:6379", "127.0.0.1:6379/0", "http://cache:6379"])
def test_i23_4_c56_a_redis_url_without_its_scheme_names_the_setting(tmp_path, url: str) -> None:
    with pytest.raises(ValueError) as raised:
        Idempotency(_app(tmp_path, IDEMPOTENCY_REDIS_URL=url))
    message = str(raised.value)
    assert message.startswith("IDEMPOTENCY_REDIS_URL") and "redis://localhost:6379/0" in message
    assert "rediss://" in message and "redis+sentinel://" in message


def test_i23_4_c56_a_redis_url_keeps_its_password_out_of_the_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_REDIS_URL") as raised:
        Idempotency(_app(tmp_path, IDEMPOTENCY_REDIS_URL="cache:s3cret@host:6379"))
    assert "s3cret" not in str(raised.value)
    with pytest.raises(ValueError, match="IDEMPOTENCY_REDIS_URL") as raised:
        Idempotency(_app(tmp_path, "port", IDEMPOTENCY_REDIS_URL="redis://:s3cret@h:port/0"))
    assert "s3cret" not in str(raised.value) and "Port" in str(raised.value)


@pytest.mark.parametrize("uri", ["localhost:5432/shop", "postgresql://app:s3cret@db:port/shop"])
def test_i23_4_c56_a_database_uri_that_is_no_url_names_the_setting(tmp_path, uri: str) -> None:
    """At init_app, not as a 503 at the first request; the password stays out of it."""
    with pytest.raises(
        ValueError, match="IDEMPOTENCY_DATABASE_URI is not a database URL"
    ) as raised:
        Idempotency(_app(tmp_path, IDEMPOTENCY_DATABASE_URI=uri))
    assert "s3cret" not in str(raised.value) and "postgresql+psycopg2://" in str(raised.value)


def test_i23_4_c56_a_ttl_below_the_default_lease_says_the_lease_is_the_default(tmp_path) -> None:
    with pytest.raises(ValueError) as raised:
        Idempotency(_app(tmp_path, IDEMPOTENCY_TTL=3))
    message = str(raised.value)
    assert "IDEMPOTENCY_LEASE = 60 s (its default)" in message
    assert "IDEMPOTENCY_TTL = 3 s" in message and "below 3" in message


def test_i23_4_c56_show_without_scope_names_the_scope_it_searched(tmp_path) -> None:
    app = _app(tmp_path)
    Idempotency(app)
    with app.app_context():
        app.extensions["idempotency"].store.create_table()
    runner = app.test_cli_runner()
    plain = runner.invoke(args=["idempotency", "show", "order-42"])
    assert plain.exit_code == 1
    assert "'anonymous' scope" in plain.output and "--scope" in plain.output
    scoped = runner.invoke(args=["idempotency", "show", "order-42", "--scope", "acme"])
    assert scoped.exit_code == 1
    assert "scope 'acme'" in scoped.output and "--authorization" in scoped.output
    forget = runner.invoke(args=["idempotency", "forget", "order-42", "--yes"])
    assert forget.exit_code == 1 and "'anonymous' scope" in forget.output


def test_i23_4_c33_c56_a_response_over_the_body_limit_is_named_once_per_endpoint(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    app = _app(tmp_path, IDEMPOTENCY_MAX_BODY_BYTES=10)

    @app.post("/export")
    @idempotent
    def export():
        return "x" * 100, 201

    @app.post("/report")
    @idempotent
    def report():
        return "y" * 100, 201

    @app.post("/small")
    @idempotent
    def small():
        return "z", 201

    idempotency = Idempotency(app)
    client = app.test_client()
    for path in ("/export", "/export", "/report", "/small"):
        for key in ("a", "b"):
            answer = client.post(path, headers={"Idempotency-Key": path + key})
            assert answer.status_code == 201
    with app.app_context():
        with idempotency.once("big") as run:
            run.result = "w" * 100
    lines = [w for w in _warnings(caplog) if "IDEMPOTENCY_MAX_BODY_BYTES" in w]
    assert len(lines) == 3
    assert "'export'" in lines[0] and "(10 bytes)" in lines[0] and "omitted" in lines[0]
    assert "'report'" in lines[1] and "'once:once'" in lines[2]


# -- a decorator stacked above @idempotent ------------------------------------------------------


def test_i35_c56_a_decorator_stacked_above_idempotent_still_runs(tmp_path) -> None:
    """``@login_required``/``@app.input``-style decorators copy the guard's attributes onto
    their own wrapper (functools.wraps). The layer took the copied attribute for the guard
    itself and called the bare view: the decorator above was skipped (an authentication
    check bypassed; APIFlask's parsed body missing, a TypeError)."""
    import functools

    def needs_token(view):
        @functools.wraps(view)
        def checked(*args, **kwargs):
            from flask import request

            if request.headers.get("X-Token") != "secret":
                return jsonify(error="no token"), 401
            return view(*args, token="secret", **kwargs)

        return checked

    app = _app(tmp_path)

    @app.post("/pay")
    @needs_token
    @idempotent
    def pay(token: str):
        return jsonify(token=token), 201

    Idempotency(app)
    client = app.test_client()
    refused = client.post("/pay", json={}, headers=KEY)
    assert refused.status_code == 401, refused.get_data(as_text=True)
    paid = client.post("/pay", json={}, headers={**KEY, "X-Token": "secret"})
    assert paid.status_code == 201 and paid.get_json() == {"token": "secret"}
    again = client.post("/pay", json={}, headers={**KEY, "X-Token": "secret"})
    assert again.headers.get("Idempotent-Replayed") == "true"
