"""Which database driver a URL needs, checked when the app starts (C51).

SQLAlchemy picks the driver of a URL that names none: ``postgresql://`` is psycopg2
on SQLAlchemy 2.0 and psycopg 3 on 2.1; ``mysql://`` is mysqlclient (``MySQLdb``).
Without this check a missing driver shows only at the first protected request, as a
500 (``No module named 'psycopg'``); here it fails ``init_app``, naming the driver,
the extra that installs it and the URL forms that name a driver explicitly.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

#: SQLAlchemy's driver name -> (what it is called, the package to install, the
#: Flask-Idempotency extra that installs it).
_DRIVERS = {
    ("postgresql", "psycopg2"): ("psycopg2", "psycopg2-binary", "postgresql"),
    ("postgresql", "psycopg"): (
        "psycopg 3 (the 'psycopg' package)",
        "psycopg[binary]",
        "postgresql",
    ),
    ("mysql", "mysqldb"): ("mysqlclient (MySQLdb)", "mysqlclient", "mysqlclient"),
    ("mysql", "pymysql"): ("PyMySQL", "PyMySQL", "mysql"),
    ("mariadb", "mysqldb"): ("mysqlclient (MySQLdb)", "mysqlclient", "mysqlclient"),
    ("mariadb", "pymysql"): ("PyMySQL", "PyMySQL", "mysql"),
}

#: The URL forms that name each backend's supported drivers, and the extra of each.
_EXPLICIT = {
    "postgresql": "postgresql+psycopg2:// or postgresql+psycopg:// (extra 'postgresql')",
    "mysql": "mysql+pymysql:// (extra 'mysql') or mysql+mysqldb:// (extra 'mysqlclient')",
    "mariadb": "mariadb+pymysql:// (extra 'mysql') or mariadb+mysqldb:// (extra 'mysqlclient')",
}


class MissingDriver(RuntimeError):
    """The database driver ``IDEMPOTENCY_DATABASE_URI`` needs is not installed."""


def check_driver(uri: Any, setting: str = "IDEMPOTENCY_DATABASE_URI") -> None:
    """Raise :class:`MissingDriver` when the driver SQLAlchemy picks for ``uri`` cannot be
    imported. Imports the driver (as the first request would), opens no connection.
    ``setting``: where the URL came from, for the message (``SQLALCHEMY_DATABASE_URI``
    on the Flask-SQLAlchemy path)."""
    if uri is None:
        return
    try:
        url = make_url(uri)
        dialect = url.get_dialect()
    except (ArgumentError, NoSuchModuleError):
        return  # not ours to judge: create_engine reports a malformed URL or unknown dialect
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        backend = url.get_backend_name()
        name, package, extra = _DRIVERS.get((backend, dialect.driver), (dialect.driver, None, None))
        # The package by its own name: Flask-Idempotency is on no index yet, so
        # installing the package's extra by name would not work; the extra is named too.
        install = (
            f"pip install '{package}' (Flask-Idempotency's extra '{extra}')"
            if package
            else f"install the {dialect.driver} package"
        )
        how = url.drivername
        named = "+" in how
        picked = "names" if named else f"leaves to SQLAlchemy, which picks {dialect.driver} for it"
        explicit = _EXPLICIT.get(backend)
        raise MissingDriver(
            f"{setting} ({how}://…) {picked}; the driver {name} is not installed"
            f" ({exc}). Install it: {install}"
            + (f"; or name an installed driver in the URL: {explicit}." if explicit else ".")
        ) from exc
