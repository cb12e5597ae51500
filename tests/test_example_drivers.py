"""``make run`` with a plain database URL (issue 35 item 3; CONTRACT C51).

The ``example`` extra, which is what ``make run`` installs, carries both
PostgreSQL drivers and PyMySQL, so ``DATABASE_URL=postgresql://…`` works whichever
driver SQLAlchemy picks for it (2.0 psycopg2, 2.1 psycopg 3), and ``mysql://…``
runs on PyMySQL. A missing driver is named by ``init_app`` on the Flask-SQLAlchemy
path too (it was a bare ``ModuleNotFoundError`` from Flask-SQLAlchemy), and
``make run`` says it in one line, without a traceback. Each run is ``make run``'s
own path (``create_app()`` from the environment, then ``prepare_database``: the
repository's migrations) on a private database of the real server.
"""

from __future__ import annotations

import configparser
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

from flask_idempotency import Idempotency
from flask_idempotency.store.drivers import MissingDriver

ROOT = Path(__file__).resolve().parent.parent
CHARGE = {"amount_cents": 1999, "currency": "EUR"}
HEADERS = {"X-Account": "acme", "Idempotency-Key": "order-1001"}
ENV_VARS = (
    "DATABASE_URL",
    "REDIS_URL",
    "IDEMPOTENCY_REDIS_URL",
    "FLASK_IDEMPOTENCY_REDIS_URL",
    "FLASK_SQLALCHEMY_DATABASE_URI",
    "GATEWAY_LATENCY",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``import <module>`` fail as if the package were not installed."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def _serve_like_make_run(instance: Path) -> Flask:
    """What ``make run`` does before serving: the app from the environment, the schema."""
    from example.app import create_app
    from example.serve import prepare_database

    app = create_app({"TESTING": True}, instance_path=str(instance))
    prepare_database(app)
    return app


def _charge_twice(app: Flask) -> str:
    """One charge and its retry; the driver the store ran on."""
    from example.models import db

    client = app.test_client()
    first = client.post("/payments", json=CHARGE, headers=HEADERS)
    again = client.post("/payments", json=CHARGE, headers=HEADERS)
    assert first.status_code == 201, first.get_data(as_text=True)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.get_data() == first.get_data()
    with app.app_context():
        driver = db.engine.dialect.driver
        db.engine.dispose()
    return driver


def test_c51_the_example_extra_carries_both_postgresql_drivers_and_pymysql() -> None:
    """``make run`` installs install_requires and this extra, nothing else (Makefile)."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    extra = parser["options.extras_require"]["example"]
    names = {line.split(">")[0].split("=")[0].strip().lower() for line in extra.splitlines()}
    assert {"psycopg2-binary", "psycopg[binary]", "pymysql"} <= names, names
    makefile = (ROOT / "Makefile").read_text("utf-8")
    assert 'c["options.extras_require"]["example"]' in makefile


@pytest.fixture
def private_pg_database(pg_database: URL) -> Iterator[URL]:
    """A database of this test's own (the example creates its tables and migrations'). Not
    through ``pg_url``: the plain URL names no driver, so one run covers it."""
    name = f"{pg_database.database}_run_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_database, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_database.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# Flask-Migrate's stock env.py still calls the deprecated ``db.get_engine()`` first.
@pytest.mark.filterwarnings("ignore:'get_engine' is deprecated:DeprecationWarning")
@pytest.mark.postgres
def test_c51_make_run_with_a_plain_postgresql_url(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, private_pg_database: URL
) -> None:
    """It crashed with "No module named 'psycopg'": SQLAlchemy 2.1 picks psycopg 3 for a
    plain URL, and the extra installed psycopg2 only."""
    from sqlalchemy.engine import make_url

    plain = private_pg_database.set(drivername="postgresql")
    monkeypatch.setenv("DATABASE_URL", plain.render_as_string(hide_password=False))
    driver = _charge_twice(_serve_like_make_run(tmp_path / "instance"))
    assert driver == make_url("postgresql://").get_dialect().driver  # SQLAlchemy's own pick


@pytest.fixture
def private_mysql_database(mysql_url: URL) -> Iterator[URL]:
    name = f"run_{uuid.uuid4().hex[:12]}"
    admin = create_engine(mysql_url)
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    try:
        yield mysql_url.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


@pytest.mark.filterwarnings("ignore:'get_engine' is deprecated:DeprecationWarning")
@pytest.mark.mysql
@pytest.mark.parametrize("scheme", ["mysql", "mariadb"])
def test_c51_make_run_with_a_plain_mysql_url(
    clean_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    private_mysql_database: URL,
    scheme: str,
) -> None:
    """SQLAlchemy picks mysqlclient for a plain mysql://, which needs a C compiler to
    install; the example reads it as PyMySQL, which its extra carries."""
    _hide(monkeypatch, "MySQLdb")  # as on a machine without mysqlclient
    plain = private_mysql_database.set(drivername=scheme)
    monkeypatch.setenv("DATABASE_URL", plain.render_as_string(hide_password=False))
    assert _charge_twice(_serve_like_make_run(tmp_path / "instance")) == "pymysql"


def test_c51_a_missing_driver_is_named_on_the_flask_sqlalchemy_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idempotency(db=db).init_app names the driver SQLALCHEMY_DATABASE_URI needs, as it
    does for IDEMPOTENCY_DATABASE_URI."""
    _hide(monkeypatch, "psycopg", "psycopg2")
    app = Flask(__name__, instance_path=str(tmp_path))
    app.config["SQLALCHEMY_DATABASE_URI"] = "postgresql://app:s3cret@db.internal/app"
    with pytest.raises(MissingDriver) as caught:
        Idempotency(db=SQLAlchemy()).init_app(app)
    message = str(caught.value)
    assert message.startswith("SQLALCHEMY_DATABASE_URI (postgresql://…)")
    assert "extra 'postgresql'" in message and "postgresql+psycopg2://" in message
    assert "s3cret" not in message and "db.internal" not in message


def test_c51_make_run_names_a_missing_driver_in_one_line(
    clean_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The example initialises the extension before Flask-SQLAlchemy, so the driver is
    named (it was a ModuleNotFoundError traceback from flask_sqlalchemy), and its runner
    exits with that line."""
    from example import serve

    _hide(monkeypatch, "psycopg", "psycopg2")
    monkeypatch.setenv("DATABASE_URL", "postgresql://app@127.0.0.1:1/app")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve, "create_app", _in(tmp_path, serve.create_app))
    with pytest.raises(SystemExit) as exited:
        serve.main(["--port", "1"])
    said = str(exited.value)
    assert said.startswith("The example cannot start: SQLALCHEMY_DATABASE_URI (postgresql://…)")
    assert "is not installed" in said and "pip install" in said
    assert "Traceback" not in capsys.readouterr().err


def test_c51_make_run_names_an_unreachable_database_in_one_line(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from example import serve

    monkeypatch.setenv("DATABASE_URL", "postgresql://app:s3cret@127.0.0.1:1/app")
    monkeypatch.setattr(serve, "create_app", _in(tmp_path, serve.create_app))
    with pytest.raises(SystemExit) as exited:
        serve.main(["--port", "1"])
    said = str(exited.value)
    assert said.startswith("The example cannot reach its database postgresql://app:***@")
    assert "s3cret" not in said


def _in(tmp_path: Path, create_app: Any) -> Any:
    """``create_app`` with its instance folder under ``tmp_path``."""
    return lambda: create_app(instance_path=str(tmp_path / "instance"))
