"""Configuration (CONTRACT §2): defaults, and every mistake caught at ``init_app``.

A misconfiguration must fail when the app starts, with a message naming the key,
never as a 500 on the first protected request.
"""

from __future__ import annotations

import pytest
from flask import Flask

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.config import EffectiveOptions, RouteOptions, Settings


def fresh_app(tmp_path, config: dict | None = None) -> Flask:
    app = Flask("config_test", instance_path=str(tmp_path / "instance"))
    app.config["TESTING"] = True
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/idem.sqlite3"
    app.config.update(config or {})
    return app


def test_defaults_match_the_contract() -> None:
    """CONTRACT §2 table, key by key."""
    s = Settings.from_config({})
    assert s.header == "Idempotency-Key"
    assert s.replay_header == "Idempotent-Replayed"
    assert s.methods == {"POST", "PATCH"}
    assert s.required is False
    assert s.ttl == 86400
    assert s.lease == 60
    assert s.wait == 5.0
    assert s.key_max_length == 255
    assert s.strict_header is False
    assert s.store_server_errors is False
    assert s.max_body_bytes == 1048576
    assert s.replay_headers == {
        "content-type",
        "content-language",
        "location",
        "etag",
        "last-modified",
        "cache-control",  # C62: a replay keeps the caching semantics of the original
        "vary",
        "expires",
        "content-disposition",
    }
    assert s.fail_open is False
    assert s.redis_prefix == "idem"
    assert s.table == "idempotency_keys"
    assert s.redis_url is None


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"IDEMPOTENCY_TTL": 60, "IDEMPOTENCY_LEASE": 60}, "LEASE"),
        ({"IDEMPOTENCY_TTL": 30, "IDEMPOTENCY_LEASE": 60}, "LEASE"),
        ({"IDEMPOTENCY_TTL": 0}, "TTL"),
        ({"IDEMPOTENCY_TTL": -5}, "TTL"),
        ({"IDEMPOTENCY_TTL": float("nan")}, "TTL"),
        ({"IDEMPOTENCY_TTL": float("inf")}, "TTL"),
        ({"IDEMPOTENCY_TTL": "a day"}, "TTL"),
        ({"IDEMPOTENCY_TTL": None}, "TTL"),
        ({"IDEMPOTENCY_LEASE": 0}, "LEASE"),
        ({"IDEMPOTENCY_LEASE": -1}, "LEASE"),
        ({"IDEMPOTENCY_WAIT": -0.1}, "WAIT"),
        ({"IDEMPOTENCY_WAIT": None}, "WAIT"),
        ({"IDEMPOTENCY_METHODS": []}, "METHODS"),
        ({"IDEMPOTENCY_METHODS": ""}, "METHODS"),
        ({"IDEMPOTENCY_METHODS": None}, "METHODS"),
        ({"IDEMPOTENCY_METHODS": ["GET"]}, "GET"),
        ({"IDEMPOTENCY_METHODS": "POST, HEAD"}, "HEAD"),
        ({"IDEMPOTENCY_METHODS": ["options"]}, "OPTIONS"),
        ({"IDEMPOTENCY_METHODS": [1]}, "METHODS"),
        ({"IDEMPOTENCY_METHODS": ["PO ST"]}, "METHODS"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["Content-Type", "Set-Cookie"]}, "set-cookie"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["set-cookie"]}, "set-cookie"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["Date"]}, "date"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["Transfer-Encoding"]}, "transfer-encoding"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["Connection"]}, "connection"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["Content-Length"]}, "content-length"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["Retry-After"]}, "retry-after"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": "ETag, Set-Cookie"}, "set-cookie"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": None}, "REPLAY_HEADERS"),
        ({"IDEMPOTENCY_REPLAY_HEADERS": ["X Bad"]}, "REPLAY_HEADERS"),
        ({"IDEMPOTENCY_KEY_MAX_LENGTH": 0}, "KEY_MAX_LENGTH"),
        ({"IDEMPOTENCY_KEY_MAX_LENGTH": 5000}, "KEY_MAX_LENGTH"),
        ({"IDEMPOTENCY_KEY_MAX_LENGTH": "long"}, "KEY_MAX_LENGTH"),
        ({"IDEMPOTENCY_MAX_BODY_BYTES": -1}, "MAX_BODY_BYTES"),
        ({"IDEMPOTENCY_MAX_BODY_BYTES": 1.5}, "MAX_BODY_BYTES"),
        ({"IDEMPOTENCY_HEADER": ""}, "HEADER"),
        ({"IDEMPOTENCY_HEADER": "Idempotency Key"}, "HEADER"),
        ({"IDEMPOTENCY_REPLAY_HEADER": ""}, "REPLAY_HEADER"),
        ({"IDEMPOTENCY_REQUIRED": "maybe"}, "REQUIRED"),
        ({"IDEMPOTENCY_STRICT_HEADER": 2}, "STRICT_HEADER"),
        ({"IDEMPOTENCY_STORE_SERVER_ERRORS": None}, "STORE_SERVER_ERRORS"),
        ({"IDEMPOTENCY_FAIL_OPEN": "sometimes"}, "FAIL_OPEN"),
    ],
)
def test_invalid_settings_raise_at_init_app(tmp_path, config: dict, message: str) -> None:
    app = fresh_app(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        Idempotency(app)
    assert "idempotency" not in app.extensions, "a failed init_app must not half-register"


def test_failed_init_app_can_be_retried_with_a_fixed_config(tmp_path) -> None:
    app = fresh_app(tmp_path, {"IDEMPOTENCY_LEASE": 100, "IDEMPOTENCY_TTL": 10})
    ext = Idempotency()
    with pytest.raises(ValueError):
        ext.init_app(app)
    app.config["IDEMPOTENCY_TTL"] = 1000
    ext.init_app(app)
    assert app.extensions["idempotency"].settings.ttl == 1000


def test_values_are_normalised() -> None:
    s = Settings.from_config(
        {
            "IDEMPOTENCY_METHODS": "post, put",
            "IDEMPOTENCY_REPLAY_HEADERS": "ETag, X-Request-Cost",
            "IDEMPOTENCY_TTL": "120",
            "IDEMPOTENCY_LEASE": 10,
            "IDEMPOTENCY_WAIT": 0,
            "IDEMPOTENCY_REQUIRED": "true",
            "IDEMPOTENCY_FAIL_OPEN": "0",
            "IDEMPOTENCY_PROBLEM_TYPE_BASE": "https://example.com/problems",
        }
    )
    assert s.methods == {"POST", "PUT"}
    assert s.replay_headers == {"etag", "x-request-cost"}
    assert s.ttl == 120.0 and isinstance(s.ttl, float)
    assert s.wait == 0.0
    assert s.required is True
    assert s.fail_open is False
    assert s.problem_type_base == "https://example.com/problems/"


def test_unknown_idempotency_keys_are_ignored_but_known_ones_read() -> None:
    s = Settings.from_config({"IDEMPOTENCY_HEADER": "X-Idem", "OTHER": 1})
    assert s.header == "X-Idem"


@pytest.mark.parametrize(
    "name", ["Idempotency-Key", "x-request-KEY", "X_Odd-Name", "Content-Type", "content-length"]
)
def test_c2_the_key_header_is_read_from_where_werkzeug_reads_it(name: str) -> None:
    """The layer reads the key header's environ entry directly (issue 11): for any header
    name, the same entry Werkzeug's request headers read, CGI names included."""
    from werkzeug.datastructures import EnvironHeaders
    from werkzeug.test import EnvironBuilder

    key = Settings.from_config({"IDEMPOTENCY_HEADER": name}).header_environ_key
    environ = EnvironBuilder(
        method="POST", data=b"1", headers={name: "the-value"}, content_type="text/plain"
    ).get_environ()
    assert environ.get(key) == EnvironHeaders(environ).get(name) is not None
    environ.pop(key)
    assert EnvironHeaders(environ).get(name) is None


# -- per-route options --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl": 0},
        {"ttl": -1},
        {"lease": 0},
        {"wait": -1},
        {"ttl": float("nan")},
        {"ttl": 10, "lease": 10},
        {"ttl": 10, "lease": 20},
        {"methods": []},
        {"methods": ["GET"]},
        {"methods": ["POST", "DELETE", "HEAD"]},
        {"required": "perhaps"},
    ],
)
def test_invalid_route_options_raise_at_decoration(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        idempotent(**kwargs)


def test_idempotent_rejects_a_non_callable() -> None:
    with pytest.raises(TypeError):
        idempotent("not a view")  # type: ignore[call-overload]


def test_route_options_override_app_settings() -> None:
    settings = Settings.from_config({"IDEMPOTENCY_WAIT": 5, "IDEMPOTENCY_REQUIRED": False})
    route = RouteOptions(required=True, ttl=3600, wait=0, methods=frozenset({"put"}))
    merged = EffectiveOptions.merge(settings, route)
    assert merged.required is True
    assert merged.ttl == 3600
    assert merged.wait == 0
    assert merged.methods == {"PUT"}
    assert merged.lease == settings.lease
    assert merged.store_server_errors is False
    untouched = EffectiveOptions.merge(settings, RouteOptions())
    assert (untouched.required, untouched.ttl, untouched.wait) == (False, 86400, 5)


def test_c63_route_ttl_shorter_than_app_lease_is_reported_at_init_app(tmp_path, caplog) -> None:
    """Reported, not raised: the route answers a problem, the app serves (test_start_up)."""
    app = fresh_app(tmp_path, {"IDEMPOTENCY_LEASE": 60})

    @app.post("/short")
    @idempotent(ttl=30)
    def short():
        return "ok"

    Idempotency(app)
    assert any(
        "'short'" in r.getMessage() and "lease" in r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR"
    )
