"""The default scope, when no ``scope_loader`` is registered (issue 9 item 14; C5, C46).

C46: the loader's value; else, with Flask-Login installed and ``current_user``
authenticated, ``current_user.get_id()``; else a digest of ``Authorization``; else
``anonymous``. The ``Authorization`` fallback splits a client's retries when it
refreshes its OAuth token between them, so it is kept but announced: one WARNING
at an app's first protected request without a loader.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import threading

import pytest
from flask import Flask, jsonify
from flask_login import LoginManager, UserMixin
from sqlalchemy import select

from flask_idempotency import idempotent, signals

REPLAYED = "Idempotent-Replayed"
#: The Authorization scope is keyed by SECRET_KEY (or IDEMPOTENCY_SCOPE_SECRET): issue 26.
WITH_SECRET = {"IDEMPOTENCY_WAIT": 0, "SECRET_KEY": "default-scope-tests"}
#: Two access tokens of one user, as an OAuth client holds before and after a refresh.
TOKENS = {"token-before-refresh": "u1", "token-after-refresh": "u1", "token-of-u2": "u2"}


class User(UserMixin):
    def __init__(self, user_id: str) -> None:
        self.id = user_id


def _with_login(app: Flask) -> None:
    login = LoginManager(app)

    @login.request_loader
    def from_bearer(request):
        header = request.headers.get("Authorization", "")
        user_id = TOKENS.get(header.removeprefix("Bearer "))
        return User(user_id) if user_id else None


def _counted(app: Flask) -> list[str]:
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return jsonify(n=len(calls)), 201

    return calls


def _post(app: Flask, token: str | None, key: str = "k1"):
    headers = {"Idempotency-Key": key}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return app.test_client().post("/pay", json={"amount": 10}, headers=headers)


def test_i9_14_c46_flask_login_user_survives_a_token_refresh(make_app) -> None:
    """C46: with Flask-Login, the default scope is the user, so a refreshed token replays."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    _with_login(app)
    calls = _counted(app)
    first = _post(app, "token-before-refresh")
    retry = _post(app, "token-after-refresh")
    assert first.status_code == retry.status_code == 201
    assert retry.headers.get(REPLAYED) == "true" and retry.data == first.data
    assert calls == ["pay"]


def test_i9_14_c5_c46_two_logged_in_users_never_share_a_key(make_app) -> None:
    """C5/C46: the user id scopes the key: another user's same key is another record."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    _with_login(app)
    calls = _counted(app)
    assert _post(app, "token-before-refresh").status_code == 201
    other = _post(app, "token-of-u2")
    assert other.status_code == 201 and REPLAYED not in other.headers
    assert calls == ["pay", "pay"]


def test_i9_14_c46_anonymous_flask_login_user_falls_back_to_authorization(make_app) -> None:
    """C46: an unauthenticated ``current_user`` is no scope: the Authorization digest is."""
    app, _ = make_app(WITH_SECRET)
    _with_login(app)
    calls = _counted(app)
    assert _post(app, "unknown-token-a").status_code == 201
    assert _post(app, "unknown-token-a").headers.get(REPLAYED) == "true"
    assert REPLAYED not in _post(app, "unknown-token-b").headers
    assert calls == ["pay", "pay"]


def test_i9_14_c46_without_flask_login_a_refreshed_token_is_a_new_scope(make_app) -> None:
    """C46: the contract's default is kept: without a login manager, Authorization scopes."""
    app, _ = make_app(WITH_SECRET)
    calls = _counted(app)
    assert _post(app, "token-before-refresh").status_code == 201
    assert REPLAYED not in _post(app, "token-after-refresh").headers
    assert calls == ["pay", "pay"]


def test_i9_14_c46_loader_wins_over_flask_login(make_app) -> None:
    """C46: a registered scope_loader decides, whatever Flask-Login says."""
    app, ext = make_app({"IDEMPOTENCY_WAIT": 0})
    _with_login(app)
    ext.scope_loader(lambda: "tenant-7")
    calls = _counted(app)
    assert _post(app, "token-before-refresh").status_code == 201
    assert _post(app, "token-of-u2").headers.get(REPLAYED) == "true"
    assert calls == ["pay"]


def _scope_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "flask_idempotency"
        and r.levelno == logging.WARNING
        and "scope_loader" in r.getMessage()
    ]


def test_i9_14_c46_one_warning_at_the_first_protected_request_without_a_loader(
    make_app, caplog: pytest.LogCaptureFixture
) -> None:
    """C46: an app without a scope_loader says so once, naming the token-refresh risk."""
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    app, _ = make_app(WITH_SECRET)
    _counted(app)
    assert _scope_warnings(caplog) == []  # not at start-up: views may come later
    threads = [threading.Thread(target=_post, args=(app, f"t{i}", f"k{i}")) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    _post(app, None, "k-last")
    warnings = _scope_warnings(caplog)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "Authorization" in message and "refresh" in message and "anonymous" in message

    other, _ = make_app(WITH_SECRET)
    _counted(other)
    _post(other, None)
    assert len(_scope_warnings(caplog)) == 2, "one warning per app"


def test_i9_14_c46_no_warning_with_a_scope_loader(
    make_app, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    app, ext = make_app({"IDEMPOTENCY_WAIT": 0})
    ext.scope_loader(lambda: "tenant-1")
    _counted(app)
    _post(app, None)
    assert _scope_warnings(caplog) == []


# -- issue 26 item 5: the Authorization digest is keyed (C30, C46) ------------------------------

#: A small wordlist, as the review used: the password is in it.
WORDLIST = ["123456", "password", "letmein", "qwerty", "hunter2", "dragon", "iloveyou"]


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _stored_scopes(app: Flask) -> list[str]:
    store = app.extensions["idempotency"].store
    with store.autocommit.connect() as conn:
        return list(conn.execute(select(store.table.c.scope)).scalars())


def _post_with(app: Flask, authorization: str, key: str = "k1"):
    headers = {"Idempotency-Key": key, "Authorization": authorization}
    return app.test_client().post("/pay", json={"amount": 10}, headers=headers)


def test_i26_5_c30_a_wordlist_does_not_recover_basic_auth_from_the_scope(make_app) -> None:
    """C30: the scope column, ``show`` and every signal carry the scope; an unsalted
    SHA-256 of ``Authorization`` gave a Basic-auth password to a small wordlist."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0, "SECRET_KEY": "server-side secret"})
    _counted(app)
    seen: list[str] = []
    signals.request_executed.connect(
        lambda sender, **extra: seen.append(extra["scope"]), app, weak=False
    )
    assert _post_with(app, _basic("alice", "hunter2")).status_code == 201
    exposed = [*_stored_scopes(app), *seen]
    assert len(exposed) == 2
    for password in WORDLIST:
        header = _basic("alice", password)
        guesses = {
            hashlib.sha256(header.encode("latin-1")).hexdigest(),
            hashlib.sha256(header.split(" ", 1)[1].encode()).hexdigest(),
        }
        for scope in exposed:
            assert not any(guess in scope for guess in guesses), password
            assert header not in scope and password not in scope
    assert all(scope.startswith("auth-hmac:") for scope in exposed)


def test_i26_5_c30_the_digest_is_keyed_by_the_scope_secret_else_secret_key(make_app) -> None:
    """C46: one header is one scope under one secret, another under another secret;
    ``IDEMPOTENCY_SCOPE_SECRET`` wins over ``SECRET_KEY``, so rotating ``SECRET_KEY``
    need not change the scopes."""
    configs = {
        "key-a": {"SECRET_KEY": "a"},
        "key-a-again": {"SECRET_KEY": "a"},
        "key-b": {"SECRET_KEY": "b"},
        "scope-s-key-a": {"SECRET_KEY": "a", "IDEMPOTENCY_SCOPE_SECRET": "s"},
        "scope-s-key-b": {"SECRET_KEY": b"b", "IDEMPOTENCY_SCOPE_SECRET": b"s"},
        "scope-s-only": {"IDEMPOTENCY_SCOPE_SECRET": "s"},
    }
    scopes = {}
    for name, config in configs.items():
        app, _ = make_app(config)
        _counted(app)
        assert _post_with(app, "Bearer tok").status_code == 201
        (scopes[name],) = _stored_scopes(app)
    assert scopes["key-a"] == scopes["key-a-again"] != scopes["key-b"]
    assert scopes["scope-s-key-a"] == scopes["scope-s-key-b"] == scopes["scope-s-only"]
    assert scopes["scope-s-key-a"] != scopes["key-a"]
    # RFC 2104 HMAC-SHA256 of the header under a key derived from the secret.
    key = hmac.digest(b"s", b"flask-idempotency scope key v1", "sha256")
    assert (
        scopes["scope-s-only"] == "auth-hmac:" + hmac.new(key, b"Bearer tok", "sha256").hexdigest()
    )


def test_c63_without_a_secret_the_authorization_scope_is_keyed_by_the_stores_own(
    make_app, caplog
) -> None:
    """C63 (issue 35 item 1): no ``SECRET_KEY`` and no ``IDEMPOTENCY_SCOPE_SECRET`` (a JSON
    API without sessions). A request scoped by its ``Authorization`` header used to be an
    HTML 500; now its scope is the HMAC under a key derived from the secret the store
    keeps beside its identity: the same in every process on that store (a second app on
    the same database replays), another store's is another, and it is never logged."""
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls = _counted(app)
    caplog.set_level(logging.DEBUG, logger="flask_idempotency")
    first = _post_with(app, "Bearer tok")
    assert first.status_code == 201 and calls == ["pay"]
    store = app.extensions["idempotency"].store
    secret = store.identity().secret
    key = hmac.digest(secret, b"flask-idempotency scope key v1", "sha256")
    expected = "auth-hmac:" + hmac.new(key, b"Bearer tok", "sha256").hexdigest()
    assert _stored_scopes(app) == [expected]
    assert secret.decode() not in caplog.text
    uri = app.config["IDEMPOTENCY_DATABASE_URI"]
    same_store, _ = make_app({"IDEMPOTENCY_WAIT": 0, "IDEMPOTENCY_DATABASE_URI": uri})
    same_calls = _counted(same_store)
    again = _post_with(same_store, "Bearer tok")
    assert again.headers.get(REPLAYED) == "true" and again.data == first.data
    assert same_calls == []
    other_store, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    _counted(other_store)
    assert _post_with(other_store, "Bearer tok").status_code == 201
    assert _stored_scopes(other_store) != [expected]


@pytest.mark.parametrize("loader", [False, True], ids=["no-loader", "loader-returns-none"])
def test_c63_an_unreadable_store_secret_is_a_503_that_says_why(make_app, caplog, loader) -> None:
    """C63, C45: the store's secret is needed (no secret configured, a request scoped by
    ``Authorization``) and its table is missing: a 503 problem, never a 500, the view not
    run; the log names the cause, and says the loader returned nothing when it did (it
    used to say "no scope_loader" either way)."""
    app, ext = make_app({"IDEMPOTENCY_WAIT": 0})
    if loader:
        ext.scope_loader(lambda: None)
    calls = _counted(app)
    store = app.extensions["idempotency"].store
    store.identity_table.drop(store.engine)
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    response = _post_with(app, "Bearer tok")
    assert response.status_code == 503 and response.mimetype == "application/problem+json"
    assert calls == [] and _stored_scopes(app) == []
    (logged,) = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and "this request is scoped" in r.getMessage()
    ]
    assert "Authorization" in logged and store.identity_table.name in logged
    if loader:
        assert "the scope_loader returned nothing" in logged and "no scope_loader" not in logged
    else:
        assert "no scope_loader is registered" in logged
    assert _post(app, None, key="anonymous").status_code == 201  # no Authorization: no secret


def test_i34_7_c5_the_host_is_in_the_default_scope_with_scope_host(make_app) -> None:
    """Issue 34 item 7 (C5): an app that picks its tenant from ``Host`` in a hook, with
    Flask-Login ids that repeat per tenant, on a plain route. By default the host is not
    part of the default scope there (globex's user 5 gets acme's stored answer: the
    documented limit, docs/guarantees.md); with ``IDEMPOTENCY_SCOPE_HOST`` it is, and the
    two user 5s are two owners."""
    from flask import current_app, request

    for scope_host, shared in ((False, True), (True, False)):
        app, _ = make_app({"IDEMPOTENCY_WAIT": 0, "IDEMPOTENCY_SCOPE_HOST": scope_host})
        login = LoginManager(app)
        login.request_loader(lambda request: User("5"))  # each tenant's user 5
        orders: list[str] = []
        app.config["ORDERS"] = orders

        @app.post("/orders")
        @idempotent
        def place():
            current_app.config["ORDERS"].append(request.host)
            return jsonify(tenant=request.host.split(".")[0]), 201

        answers = [
            app.test_client().post(
                "/orders",
                json={"item": 1},
                headers={"Idempotency-Key": "k1"},
                base_url=f"https://{tenant}.example.com",
            )
            for tenant in ("acme", "globex")
        ]
        assert answers[1].get_json()["tenant"] == ("acme" if shared else "globex"), scope_host
        assert len(orders) == (1 if shared else 2)


@pytest.mark.parametrize("value", ["", b"", 42, ["s"]])
def test_i26_5_c56_a_bad_scope_secret_names_its_setting(make_app, value) -> None:
    with pytest.raises(ValueError, match="IDEMPOTENCY_SCOPE_SECRET"):
        make_app({"IDEMPOTENCY_SCOPE_SECRET": value})


def test_i26_5_c30_the_scope_secret_is_never_in_the_settings_repr(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_SCOPE_SECRET": "do-not-print-me"})
    settings = app.extensions["idempotency"].settings
    assert settings.scope_secret == "do-not-print-me"
    assert "do-not-print-me" not in repr(settings)
