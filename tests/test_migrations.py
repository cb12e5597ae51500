"""The records table ships as a Flask-Migrate migration and stays in step with the code (C29).

The example app (``example.app:create_app``, ``Idempotency(db=db)``) is run as
the real ``flask`` executable against a brand-new, empty PostgreSQL database.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from .conftest import PG_BASE_URL, service_missing

REPO_ROOT = Path(__file__).resolve().parents[1]
FLASK = Path(sys.executable).with_name("flask")
EXAMPLE = "example.app:create_app"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def empty_pg_database() -> Iterator[str]:
    """A PostgreSQL database with nothing in it, dropped afterwards."""
    base = make_url(PG_BASE_URL)
    try:
        admin = create_engine(
            base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
        )
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        service_missing("PostgreSQL", str(exc))
    name = f"idem_migr_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def flask(
    database_url: str, *args: str, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("IDEMPOTENCY_DATABASE_URI", "REDIS_URL", "IDEMPOTENCY_REDIS_URL", "FLASK_APP")
    }
    env["DATABASE_URL"] = database_url
    env.update(env_extra or {})
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [str(FLASK), "--app", EXAMPLE, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def store_ids(database_url: str) -> list[str]:
    """The ids in the store's identity table (one row, C41)."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [str(i) for i in conn.scalars(text("SELECT id FROM idempotency_keys_store"))]
    finally:
        engine.dispose()


def tables(database_url: str) -> set[str]:
    engine = create_engine(database_url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_c29_upgrade_on_an_empty_database_creates_a_table_check_accepts(
    empty_pg_database: str,
) -> None:
    assert tables(empty_pg_database) == set()
    before = flask(empty_pg_database, "idempotency", "check")
    assert before.returncode == 1
    # With db= the table belongs in the app's migrations, and the help says so.
    assert "flask db upgrade" in before.stderr and "Traceback" not in before.stderr
    refused = flask(empty_pg_database, "idempotency", "create-table")
    assert refused.returncode == 1 and "belongs in its migrations" in refused.stderr
    assert tables(empty_pg_database) == set()  # nothing created outside the migrations

    upgraded = flask(empty_pg_database, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert {"payments", "idempotency_keys", "idempotency_keys_store", "alembic_version"} <= tables(
        empty_pg_database
    )

    engine = create_engine(empty_pg_database)
    try:
        live = inspect(engine)
        uniques = {
            u["name"]: u["column_names"] for u in live.get_unique_constraints("idempotency_keys")
        }
        indexes = {
            i["name"]: i["column_names"]
            for i in live.get_indexes("idempotency_keys")
            if not i.get("duplicates_constraint")
        }
        defaults = {c["name"]: c["default"] for c in live.get_columns("idempotency_keys")}
    finally:
        engine.dispose()
    assert uniques == {"uq_idempotency_keys_key_digest": ["key_digest"]}
    assert indexes == {"ix_idempotency_keys_expires_at_ms": ["expires_at_ms"]}
    assert defaults["body_omitted"] == "false"

    checked = flask(empty_pg_database, "idempotency", "check")
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith("OK: ")
    assert checked.stderr == ""  # not even a warning


@pytest.mark.postgres
def test_c29_autogenerate_proposes_nothing_once_upgraded(empty_pg_database: str) -> None:
    assert flask(empty_pg_database, "db", "upgrade").returncode == 0
    # `flask db check` is `flask db migrate` without writing a file: it fails on any diff.
    checked = flask(empty_pg_database, "db", "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "No new upgrade operations detected" in checked.stdout + checked.stderr


@pytest.mark.postgres
def test_c29_autogenerate_sees_the_table_on_the_apps_metadata(empty_pg_database: str) -> None:
    """Before any migration, the app's own autogenerate proposes the records table."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from example.app import create_app
    from example.models import db

    app = create_app({"SQLALCHEMY_DATABASE_URI": empty_pg_database})
    with app.app_context():
        assert "idempotency_keys" in db.metadata.tables
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), db.metadata)
        db.engine.dispose()
    added = {d[1].name for d in diff if isinstance(d, tuple) and d[0] == "add_table"}
    assert added == {"payments", "idempotency_keys", "idempotency_keys_store"}


@pytest.mark.postgres
def test_c29_downgrade_removes_the_table_and_check_notices(empty_pg_database: str) -> None:
    assert flask(empty_pg_database, "db", "upgrade").returncode == 0
    downgraded = flask(empty_pg_database, "db", "downgrade", "base")
    assert downgraded.returncode == 0, downgraded.stderr
    assert not {"idempotency_keys", "idempotency_keys_store"} & tables(empty_pg_database)
    checked = flask(empty_pg_database, "idempotency", "check")
    assert checked.returncode == 1
    assert "does not exist" in checked.stderr


#: The revision before the store's identity (issue 26 item 6): a deployment of the release
#: before it has its database here.
BEFORE_IDENTITY = "3c1d2e7a9b40"


@pytest.mark.postgres
@pytest.mark.redis
def test_i26_6_c41_upgrading_an_existing_deployment_writes_its_identity(
    empty_pg_database: str,
) -> None:
    """A database migrated by the release before has no identity: with a Redis tier, `check`
    fails and names the command; `flask db upgrade` (the new revision) writes the identity,
    drawn by the database, and `check` then shows it and the Redis origin it gives."""
    import redis

    from .conftest import REDIS_URL

    probe = redis.Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        probe.ping()
    except redis.RedisError as exc:
        service_missing("Redis", str(exc))
    finally:
        probe.close()
    with_redis = {
        "REDIS_URL": REDIS_URL,
        "FLASK_IDEMPOTENCY_REDIS_PREFIX": f"test-migr-{uuid.uuid4().hex[:8]}",
    }
    assert flask(empty_pg_database, "db", "upgrade", BEFORE_IDENTITY).returncode == 0
    assert "idempotency_keys_store" not in tables(empty_pg_database)
    without_redis = flask(empty_pg_database, "idempotency", "check")
    assert without_redis.returncode == 0, without_redis.stderr  # needed only by a Redis tier
    assert "warning: the table 'idempotency_keys_store'" in without_redis.stderr
    before = flask(empty_pg_database, "idempotency", "check", env_extra=with_redis)
    assert before.returncode == 1, before.stdout + before.stderr
    assert "idempotency_keys_store" in before.stderr and "flask db upgrade" in before.stderr
    assert "Traceback" not in before.stderr

    upgraded = flask(empty_pg_database, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    (store_id,) = store_ids(empty_pg_database)
    checked = flask(empty_pg_database, "idempotency", "check", env_extra=with_redis)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"the store's identity {store_id}" in checked.stdout
    assert "origin: " in checked.stdout
    assert flask(empty_pg_database, "db", "check").returncode == 0


@pytest.mark.postgres
def test_i26_6_c41_an_upgrade_script_draws_each_databases_id_in_that_database(
    empty_pg_database: str,
) -> None:
    """`flask db upgrade --sql` writes one script a DBA may run on several databases: the id
    in it is the database's own random draw, never a literal every copy would share."""
    script = flask(empty_pg_database, "db", "upgrade", "--sql")
    assert script.returncode == 0, script.stderr
    (insert,) = [
        line for line in script.stdout.splitlines() if "INSERT INTO idempotency_keys_store" in line
    ]
    assert "md5(random()" in insert


def test_c29_the_migration_also_runs_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/example.sqlite3"
    assert flask(url, "db", "upgrade").returncode == 0
    checked = flask(url, "idempotency", "check")
    assert checked.returncode == 0, checked.stderr
    assert flask(url, "db", "check").returncode == 0
    (store_id,) = store_ids(url)
    assert len(store_id) == 32 and int(store_id, 16) >= 0
    other = f"sqlite:///{tmp_path}/other.sqlite3"  # another database, the same migration
    assert flask(other, "db", "upgrade").returncode == 0
    assert store_ids(other) != [store_id]


@pytest.fixture
def empty_mysql_database() -> Iterator[str]:
    """A MariaDB database with nothing in it (latin1, MariaDB 10's default), dropped afterwards."""
    from .conftest import MYSQL_BASE_URL

    base = make_url(MYSQL_BASE_URL)
    try:
        admin = create_engine(base, connect_args={"connect_timeout": 3})
        with admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        service_missing("MariaDB", str(exc))
    name = f"idem_migr_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET latin1"))
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


@pytest.mark.mysql
def test_i16_c29_the_migration_runs_on_mariadb_with_longblob_bodies_and_utf8mb4(
    empty_mysql_database: str,
) -> None:
    """C29/C33 on MariaDB: upgrade, `check` and `db check` agree with the code; the body
    column is LONGBLOB and the table utf8mb4; downgrade removes it again."""
    url = empty_mysql_database
    upgraded = flask(url, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    checked = flask(url, "idempotency", "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    autogen = flask(url, "db", "check")
    assert autogen.returncode == 0, autogen.stdout + autogen.stderr
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            column_type, charset = conn.execute(
                text(
                    "SELECT c.DATA_TYPE, t.TABLE_COLLATION FROM information_schema.COLUMNS c"
                    " JOIN information_schema.TABLES t USING (TABLE_SCHEMA, TABLE_NAME)"
                    " WHERE c.TABLE_SCHEMA = DATABASE() AND c.TABLE_NAME = 'idempotency_keys'"
                    " AND c.COLUMN_NAME = 'response_body'"
                )
            ).one()
    finally:
        engine.dispose()
    assert column_type == "longblob" and charset.startswith("utf8mb4")
    assert len(store_ids(url)) == 1
    downgraded = flask(url, "db", "downgrade", "base")
    assert downgraded.returncode == 0, downgraded.stderr
    assert not {"idempotency_keys", "idempotency_keys_store"} & tables(url)


#: The revision before the store's secret (issue 34, C60).
BEFORE_SECRET = "d921ddd355bf"


@pytest.mark.postgres
@pytest.mark.redis
def test_c60_upgrading_a_deployment_adds_the_secret_and_its_first_reader_fills_it(
    empty_pg_database: str,
) -> None:
    """A database migrated by the release before has an identity without a secret: with a
    Redis tier, `check` names the missing column and the fix (the tier would stay off,
    requests served by the database alone); `flask db upgrade` adds the column, empty, and
    the first process that reads the identity fills it with 256 random bits, which no
    command prints; the schema then matches the code (`flask db check`)."""
    import redis

    from .conftest import REDIS_URL

    probe = redis.Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        probe.ping()
    except redis.RedisError as exc:
        service_missing("Redis", str(exc))
    finally:
        probe.close()
    with_redis = {
        "REDIS_URL": REDIS_URL,
        "FLASK_IDEMPOTENCY_REDIS_PREFIX": f"test-migr-{uuid.uuid4().hex[:8]}",
    }
    assert flask(empty_pg_database, "db", "upgrade", BEFORE_SECRET).returncode == 0
    before = flask(empty_pg_database, "idempotency", "check", env_extra=with_redis)
    assert before.returncode == 1, before.stdout + before.stderr
    assert "secret" in before.stderr and "Traceback" not in before.stderr

    upgraded = flask(empty_pg_database, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert secrets_in(empty_pg_database) == [None]  # added empty: no SQL draws it
    checked = flask(empty_pg_database, "idempotency", "check", env_extra=with_redis)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (secret,) = secrets_in(empty_pg_database)  # the first reader (the origin's) filled it
    assert secret is not None and len(secret) == 64 and int(secret, 16) >= 0
    assert secret not in checked.stdout + checked.stderr
    assert flask(empty_pg_database, "db", "check").returncode == 0


def secrets_in(database_url: str) -> list[str | None]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return list(conn.scalars(text("SELECT secret FROM idempotency_keys_store")))
    finally:
        engine.dispose()
