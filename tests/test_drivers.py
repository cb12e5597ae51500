"""C51: a plain ``postgresql://`` / ``mysql://`` URL works on every supported SQLAlchemy, and
a URL whose driver is missing fails at ``init_app``, never at the first request.

Run in both nox sets (SQLAlchemy 2.0.0 picks psycopg2 for ``postgresql://``, 2.1 psycopg 3).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import sqlalchemy
from flask import Flask
from sqlalchemy.engine import URL, make_url

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.store.drivers import MissingDriver, check_driver

#: The driver SQLAlchemy picks for a plain ``postgresql://`` URL on this release.
PLAIN_PG_DRIVER = "psycopg2" if sqlalchemy.__version__.startswith("2.0.") else "psycopg"


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``import module`` fail as it does where the package is not installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # type: ignore[arg-type]


def _app(uri: str) -> Flask:
    app = Flask(__name__)
    app.config.update(IDEMPOTENCY_DATABASE_URI=uri, IDEMPOTENCY_CREATE_TABLE=True)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return {"ok": True}, 201

    return app


def test_c51_sqlalchemy_picks_the_driver_the_docs_say() -> None:
    assert make_url("postgresql://h/d").get_dialect().driver == PLAIN_PG_DRIVER
    assert make_url("mysql://h/d").get_dialect().driver == "mysqldb"


@pytest.mark.parametrize(
    ("uri", "hidden", "names"),
    [
        ("postgresql://u@h/d", ("psycopg", "psycopg2"), [PLAIN_PG_DRIVER, "extra 'postgresql'"]),
        ("postgresql+psycopg://u@h/d", ("psycopg",), ["pip install 'psycopg[binary]'"]),
        ("postgresql+psycopg2://u@h/d", ("psycopg2",), ["pip install 'psycopg2-binary'"]),
        ("mysql://u@h/d", ("MySQLdb",), ["mysqlclient", "extra 'mysqlclient'", "mysql+pymysql://"]),
        ("mysql+pymysql://u@h/d", ("pymysql",), ["pip install 'PyMySQL'", "mysql+mysqldb://"]),
    ],
)
def test_c51_a_missing_driver_fails_at_init_app(
    monkeypatch: pytest.MonkeyPatch, uri: str, hidden: tuple[str, ...], names: list[str]
) -> None:
    """Before C51 this ``init_app`` succeeded and the first request answered 500."""
    _hide(monkeypatch, *hidden)
    app = _app(uri)
    with pytest.raises(MissingDriver) as caught:
        Idempotency(app)
    message = str(caught.value)
    assert "IDEMPOTENCY_DATABASE_URI" in message
    for name in names:
        assert name in message, message
    if uri.startswith("postgresql"):
        assert "postgresql+psycopg2://" in message and "postgresql+psycopg://" in message
    assert "u@h" not in message  # the URL's credentials and host are not repeated


def test_c51_an_installed_driver_passes_the_check() -> None:
    pytest.importorskip("psycopg2")
    pytest.importorskip("psycopg")
    for uri in ("postgresql://u@h/d", "postgresql+psycopg2://u@h/d", "postgresql+psycopg://u@h/d"):
        check_driver(uri)
    check_driver("sqlite://")
    check_driver("not a url")  # create_engine reports that one, as before


@pytest.mark.postgres
def test_c51_a_plain_postgresql_url_serves_requests(pg_database: URL, pg_table: str) -> None:
    """``postgresql://``: whatever driver this SQLAlchemy picks, requests are served."""
    pytest.importorskip(PLAIN_PG_DRIVER)
    uri = pg_database.set(drivername="postgresql").render_as_string(hide_password=False)
    app = _app(uri)
    app.config["IDEMPOTENCY_TABLE"] = pg_table
    Idempotency(app)
    client = app.test_client()
    try:
        first = client.post("/pay", headers={"Idempotency-Key": "c51-plain"})
        again = client.post("/pay", headers={"Idempotency-Key": "c51-plain"})
        assert first.status_code == 201, first.get_data(as_text=True)
        assert again.status_code == 201
        assert again.headers.get("Idempotent-Replayed") == "true"
        store = app.extensions["idempotency"].store
        assert store.engine.dialect.driver == PLAIN_PG_DRIVER
    finally:
        app.extensions["idempotency"].store.engine.dispose()


def _outside_pip() -> list[str]:
    """A pip that can install into another interpreter's virtualenv: this interpreter's,
    or the machine's ``python3``'s where this virtualenv has none (``make install``
    makes it without pip)."""
    import importlib.util
    import shutil
    import sys

    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    python3 = shutil.which("python3")
    if python3 is None:
        pytest.fail("no pip to install the fresh virtualenv with (no python3 on PATH)")
    return [python3, "-m", "pip"]


#: Run in the fresh virtualenv: a plain postgresql:// URL, a first request and its replay.
_FRESH_APP = """
import sys
from flask import Flask
from flask_idempotency import Idempotency, idempotent
import sqlalchemy

app = Flask(__name__)
app.config.update(IDEMPOTENCY_DATABASE_URI=sys.argv[1], IDEMPOTENCY_TABLE=sys.argv[2],
                  IDEMPOTENCY_CREATE_TABLE=True)

@app.post("/pay")
@idempotent
def pay():
    return {"ok": True}, 201

Idempotency(app)
client = app.test_client()
first = client.post("/pay", headers={"Idempotency-Key": "fresh"})
again = client.post("/pay", headers={"Idempotency-Key": "fresh"})
driver = app.extensions["idempotency"].store.engine.dialect.driver
print(sqlalchemy.__version__, driver, first.status_code, again.status_code,
      again.headers.get("Idempotent-Replayed"))
"""


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.postgres
def test_c51_the_postgresql_extra_alone_serves_a_plain_url(
    pg_database: URL, pg_table: str, tmp_path: Any
) -> None:
    """A fresh virtualenv with only ``.[postgresql]`` (pip picks the SQLAlchemy it picks,
    2.1 today: psycopg 3 for ``postgresql://``) serves a plain URL."""
    import os
    import subprocess
    import venv
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env_dir = tmp_path / "venv"
    # The virtualenv gets no pip of its own (ensurepip is most of a second of CPU per
    # package it unpacks): a pip outside it installs into it with --python (pip >= 22.3),
    # as `make install` does, and compiles no bytecode the one run below does not need.
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    try:
        subprocess.run(
            [*_outside_pip(), "--python", python, "install", "--quiet", "--no-compile",
             f"{root}[postgresql]"],
            check=True, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
        )  # fmt: skip
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"pip install .[postgresql] failed:\n{exc.stdout}\n{exc.stderr}")
    script = tmp_path / "fresh_app.py"
    script.write_text(_FRESH_APP, encoding="utf-8")
    uri = pg_database.set(drivername="postgresql").render_as_string(hide_password=False)
    result = subprocess.run(
        [python, str(script), uri, pg_table],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    version, driver, first, again, replayed = result.stdout.split()
    expected = "psycopg2" if version.startswith("2.0.") else "psycopg"
    assert (driver, first, again, replayed) == (expected, "201", "201", "true"), result.stdout
