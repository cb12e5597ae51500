"""The private servers the tests start for themselves (issue 23 item 6), tested.

A test that needs a server setting of its own starts a private PostgreSQL or MariaDB
(tests/support/postgres_server.py, tests/support/mariadb_server.py): its own data
directory, port and process, never root, stopped by process id. These tests show each
one is what it says (its port, its directory, its zone, its user), survives a crash
with its data, stops, and leaves the machine's own server exactly as it was: same
process, never restarted. ``make test`` itself never reconfigures or restarts them
either (tools/system-deps.sh).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.conftest import MYSQL_BASE_URL, PG_BASE_URL, service_missing
from tests.support.mariadb_server import MariaDBServer, mariadb_binaries
from tests.support.postgres_server import PostgresServer, postgres_bindir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("Uid:"))
    return int(line.split()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _machine_identity(url: str, query: str) -> object | None:
    """What tells the machine's server apart from a restarted one, or ``None`` when it
    is not reachable (then there is nothing of it to leave alone)."""
    engine = create_engine(make_url(url), connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            return conn.execute(text(query)).one()
    except Exception:
        return None
    finally:
        engine.dispose()


def _machine_postgres() -> object | None:
    return _machine_identity(
        PG_BASE_URL,
        "SELECT pg_postmaster_start_time(), current_setting('data_directory'),"
        " current_setting('max_connections'), inet_server_port()",
    )


def _machine_mariadb() -> tuple[object, ...] | None:
    found = _machine_identity(
        MYSQL_BASE_URL,
        "SELECT UNIX_TIMESTAMP() - VARIABLE_VALUE, @@datadir, @@time_zone, @@port"
        " FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'UPTIME'",
    )
    return None if found is None else tuple(found)  # type: ignore[arg-type]


def _same_started_at(before: tuple[object, ...] | None, after: tuple[object, ...] | None) -> bool:
    """The machine's MariaDB started at the same second (uptime subtracted from now: a
    second of slack for the rounding) with the same settings."""
    if before is None:
        return True
    assert after is not None, "the machine's MariaDB stopped answering"
    return abs(float(before[0]) - float(after[0])) <= 2 and before[1:] == after[1:]  # type: ignore[arg-type]


def test_i23_private_postgresql_is_its_own_cluster_survives_a_crash_and_stops(
    tmp_path: Path,
) -> None:
    if postgres_bindir() is None:
        service_missing("a private PostgreSQL", "initdb / postgres are not installed")
    machine_before = _machine_postgres()
    server = PostgresServer(
        tmp_path / "pg", timezone="Europe/Berlin", settings={"max_connections": "150"}
    )
    try:
        server.start()
        pid = server.pid
        assert pid is not None and server.port != 5432
        engine = create_engine(server.url)
        try:
            with engine.connect() as conn:
                port, datadir, zone, most = conn.execute(
                    text(
                        "SELECT inet_server_port(), current_setting('data_directory'),"
                        " current_setting('TimeZone'), current_setting('max_connections')"
                    )
                ).one()
                conn.execute(text("CREATE TABLE kept (x int)"))
                conn.execute(text("INSERT INTO kept VALUES (7)"))
                conn.commit()
        finally:
            engine.dispose()
        assert port == server.port
        assert Path(datadir) == server.data and server.data.is_relative_to(server.directory)
        assert (zone, most) == ("Europe/Berlin", "150")
        if os.geteuid() == 0:  # PostgreSQL refuses root; so does this helper
            assert _uid_of(pid) != 0

        server.kill()
        assert not _alive(pid)
        with pytest.raises(Exception, match=r"(?i)connect"):
            server.execute("SELECT 1")
        server.restart()
        assert server.pid != pid and server.execute("SELECT x FROM kept") == [(7,)]
        assert server.execute("SHOW port") == [(str(server.port),)]

        last = server.pid
        server.stop()
        assert last is not None and not _alive(last) and server.pid is None
    finally:
        server.stop()
    assert _machine_postgres() == machine_before, "the machine's PostgreSQL changed"


def test_i23_private_mariadb_is_its_own_server_in_its_zone_and_stops(tmp_path: Path) -> None:
    if mariadb_binaries() is None:
        service_missing("a private MariaDB", "mariadbd / mariadb-install-db are not installed")
    machine_before = _machine_mariadb()
    server = MariaDBServer(tmp_path / "mariadb", timezone="Europe/Berlin")
    try:
        server.start()
        pid = server.pid
        assert pid is not None and server.port != 3306
        engine = create_engine(server.url)
        try:
            with engine.connect() as conn:
                port, datadir, socket, zone, system_zone = conn.execute(
                    text("SELECT @@port, @@datadir, @@socket, @@time_zone, @@system_time_zone")
                ).one()
                conn.execute(text("CREATE TABLE kept (x int) ENGINE=InnoDB"))
                conn.execute(text("INSERT INTO kept VALUES (7)"))
                conn.commit()
        finally:
            engine.dispose()
        assert port == server.port and socket == str(server.socket)
        assert Path(datadir) == server.data
        # The host zone it was given, through the default time_zone=SYSTEM.
        assert zone == "SYSTEM" and system_zone in ("CET", "CEST")
        if os.geteuid() == 0:
            assert _uid_of(pid) != 0

        server.restart(crash=True)
        assert not _alive(pid)
        assert server.execute("SELECT x FROM test.kept") == [(7,)]

        last = server.pid
        server.stop()
        assert last is not None and not _alive(last) and server.pid is None
    finally:
        server.stop()
    assert _same_started_at(machine_before, _machine_mariadb()), "the machine's MariaDB changed"


# -- make test leaves the machine's servers alone ------------------------------------------

#: What would reconfigure or restart a server that is not the suite's own.
RECONFIGURES: dict[str, Callable[[str], bool]] = {
    "ALTER SYSTEM": lambda s: "ALTER SYSTEM" in s.upper(),
    "SET GLOBAL": lambda s: "SET GLOBAL" in s.upper(),
    "CONFIG SET / CONFIG REWRITE": lambda s: bool(re.search(r"CONFIG\s+(SET|REWRITE)", s, re.I)),
    "a restart, reload or stop": lambda s: bool(
        re.search(r"\brestart\b|\breload\b|--stop\b|\bshutdown\b", s, re.I)
    ),
    "a write under /etc": lambda s: bool(re.search(r"(>|\btee\b.*)\s*/etc/", s)),
}


def test_i23_system_deps_never_reconfigures_or_restarts_a_machine_server() -> None:
    """tools/system-deps.sh (run by ``make test``) may install packages and start the
    machine's MariaDB or Redis when they are down; it never changes a setting of, or
    restarts, a server that is up (the old ``ALTER SYSTEM SET max_connections`` and
    cluster restart did, on a developer's own database)."""
    script = (ROOT / "tools" / "system-deps.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    found = [name for name, present in RECONFIGURES.items() if present(code)]
    assert not found, f"tools/system-deps.sh: {found}"
