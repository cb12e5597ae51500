"""The first hour (issue 14 item 4): say what is in use, and never ignore configuration silently.

- ``init_app`` logs one INFO line naming the store (dialect, table) and the
  cache/wake-up tier, or "none", without any I/O (misconfiguration must fail
  loudly at first use, not hang at start-up; CONTRACT C24, C25).
- ``IDEMPOTENCY_*`` set in the environment but absent from ``app.config`` is
  named in a WARNING with Flask's fix (``app.config.from_prefixed_env()``).
- ``flask idempotency check`` also reports the Redis tier: configured, reachable,
  prefix, listener live (C10, C24).
"""

from __future__ import annotations

import logging
import time

import pytest
import redis as redis_lib
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import create_engine

from flask_idempotency import Idempotency
from tests.conftest import REDIS_URL, service_missing
from tests.support.gunicorn import free_port


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and r.levelno == level
    ]


def _app(tmp_path, name: str = "first_hour", **config) -> Flask:
    app = Flask(name, instance_path=str(tmp_path / name))
    app.config.update(config)
    return app


@pytest.fixture
def real_redis_url() -> str:
    client = redis_lib.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except Exception as exc:
        service_missing("Redis", f"{REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


# -- the INFO line at init_app ---------------------------------------------------------------


def test_i14_4_init_app_names_the_default_store_and_no_cache(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    Idempotency(_app(tmp_path))
    [line] = [m for m in _lines(caplog, logging.INFO) if "store" in m]
    assert "sqlite" in line and "'idempotency_keys'" in line
    assert "cache: none" in line and "wake-ups: this process only" in line


def test_i14_4_c24_init_app_names_redis_without_connecting_or_leaking_the_password(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """C24: nothing listens on the port; init_app neither waits nor fails; no password logged."""
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    port = free_port()
    started = time.monotonic()
    Idempotency(
        _app(
            tmp_path,
            IDEMPOTENCY_DATABASE_URI="postgresql+psycopg2://app:s3cret@db.invalid:5432/pay",
            IDEMPOTENCY_REDIS_URL=f"redis://:hunter2@127.0.0.1:{port}/3",
            IDEMPOTENCY_REDIS_PREFIX="shop",
            IDEMPOTENCY_TABLE="idem_records",
        )
    )
    assert time.monotonic() - started < 1.0
    [line] = [m for m in _lines(caplog, logging.INFO) if "store" in m]
    assert "postgresql" in line and "db.invalid" in line and "'idem_records'" in line
    assert f"127.0.0.1:{port}/3" in line and "'shop'" in line and "pub/sub" in line
    assert "s3cret" not in caplog.text and "hunter2" not in caplog.text


def test_i14_4_init_app_names_the_engine_and_db_dialects(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    engine = create_engine("postgresql+psycopg2://u:pw@pg.invalid/x")
    Idempotency(_app(tmp_path, "by_engine"), engine=engine, redis=redis_lib.Redis(port=free_port()))
    db = SQLAlchemy()
    app = _app(tmp_path, "by_db", SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path}/app.db")
    db.init_app(app)
    Idempotency(app, db=db)
    by_engine, by_db = [m for m in _lines(caplog, logging.INFO) if "store" in m]
    assert "postgresql" in by_engine and "pw@" not in by_engine
    assert "Redis client" in by_engine and "pub/sub" in by_engine
    assert "sqlite" in by_db and "Flask-SQLAlchemy" in by_db and "cache: none" in by_db
    # Issue 35: "(Flask-SQLAlchemy db=)" read as a setting with its value missing.
    assert "(Flask-SQLAlchemy db=)" not in by_db
    assert "(Flask-SQLAlchemy's database, given as db=)" in by_db
    assert "(the engine given as engine=)" in by_engine
    engine.dispose()


# -- environment variables app.config never saw ----------------------------------------------


def test_i14_4_environment_setting_missing_from_app_config_is_named(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("IDEMPOTENCY_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("IDEMPOTENCY_TEST_SOMETHING", "not a setting: never named")
    Idempotency(_app(tmp_path))
    [warning] = [m for m in _lines(caplog, logging.WARNING) if "environment" in m]
    assert "IDEMPOTENCY_REDIS_URL" in warning and "IDEMPOTENCY_TEST_SOMETHING" not in warning
    assert "from_prefixed_env" in warning and "FLASK_IDEMPOTENCY_REDIS_URL" in warning


def test_i14_4_from_prefixed_env_is_the_way_and_then_nothing_is_said(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Flask's convention: FLASK_IDEMPOTENCY_REDIS_URL + app.config.from_prefixed_env()."""
    caplog.set_level(logging.INFO, logger="flask_idempotency")
    port = free_port()
    monkeypatch.setenv("FLASK_IDEMPOTENCY_REDIS_URL", f"redis://127.0.0.1:{port}/0")
    app = _app(tmp_path)
    app.config.from_prefixed_env()
    Idempotency(app)
    assert app.config["IDEMPOTENCY_REDIS_URL"] == f"redis://127.0.0.1:{port}/0"
    assert [m for m in _lines(caplog, logging.WARNING) if "environment" in m] == []
    assert any(f"127.0.0.1:{port}" in m for m in _lines(caplog, logging.INFO))


def test_i14_4_prefixed_variable_without_from_prefixed_env_is_named(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLASK_IDEMPOTENCY_WAIT", "0")
    Idempotency(_app(tmp_path))
    [warning] = [m for m in _lines(caplog, logging.WARNING) if "environment" in m]
    assert "FLASK_IDEMPOTENCY_WAIT" in warning and "from_prefixed_env" in warning


def test_i14_4_example_reads_flask_prefixed_environment(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from example.app import create_app

    monkeypatch.setenv("FLASK_IDEMPOTENCY_REDIS_URL", "redis://cache.invalid:6379/2")
    monkeypatch.setenv("FLASK_IDEMPOTENCY_WAIT", "1.5")
    app = create_app(instance_path=str(tmp_path))
    assert app.config["IDEMPOTENCY_REDIS_URL"] == "redis://cache.invalid:6379/2"
    assert app.config["IDEMPOTENCY_WAIT"] == 1.5
    assert app.extensions["idempotency"].settings.wait == 1.5


# -- flask idempotency check: the Redis tier ----------------------------------------------------


def _checked(app: Flask):
    with app.app_context():
        app.extensions["idempotency"].store.create_table()
    return app.test_cli_runner().invoke(args=["idempotency", "check"])


def test_i14_4_c10_check_reports_a_live_redis_tier(tmp_path, real_redis_url: str) -> None:
    """C10/C24: configured, reachable, prefix, and the wake-up listener subscribed."""
    app = _app(
        tmp_path,
        IDEMPOTENCY_DATABASE_URI=f"sqlite:///{tmp_path}/idem.sqlite3",
        IDEMPOTENCY_REDIS_URL=real_redis_url,
        IDEMPOTENCY_REDIS_PREFIX="chk",
    )
    Idempotency(app)
    result = _checked(app)
    assert result.exit_code == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Redis tier: configured" in out and "prefix 'chk'" in out
    assert "reachable: yes" in out and "wake-up listener: live" in out


def test_i14_4_check_reports_no_redis_tier(tmp_path) -> None:
    app = _app(tmp_path, IDEMPOTENCY_DATABASE_URI=f"sqlite:///{tmp_path}/idem.sqlite3")
    Idempotency(app)
    result = _checked(app)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert "Redis tier: none" in result.stdout
    assert "IDEMPOTENCY_REDIS_URL" in result.stdout


def test_i14_4_c24_check_fails_loudly_for_an_unreachable_redis(tmp_path) -> None:
    """C24: requests would run without the tier; the operator's check says it is down."""
    port = free_port()
    app = _app(
        tmp_path,
        IDEMPOTENCY_DATABASE_URI=f"sqlite:///{tmp_path}/idem.sqlite3",
        IDEMPOTENCY_REDIS_URL=f"redis://:pw@127.0.0.1:{port}/0",
    )
    Idempotency(app)
    started = time.monotonic()
    result = _checked(app)
    assert time.monotonic() - started < 15
    assert result.exit_code == 1
    assert "reachable: NO" in result.stdout
    assert f"127.0.0.1:{port}" in result.stderr and "pw@" not in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
