"""The store's connection rules without a server: URLs, error lines, the statement deadline.

CONTRACT C25, C55 (issue 25 items 2 and 5). The same rules against real servers:
tests/test_pg_ha.py.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from flask import Flask
from sqlalchemy import event
from sqlalchemy.engine import make_url

from flask_idempotency import Idempotency
from flask_idempotency.store.connect import create_store_engine, store_url
from flask_idempotency.store.deadline import Deadline, Watchdog
from flask_idempotency.store.errors import describe, is_read_only


@pytest.mark.parametrize(
    "uri",
    [
        "postgresql+psycopg2://u:pw@/db?host=h1:5432&host=h2:5433&target_session_attrs=read-write",
        "postgresql+psycopg2://u:pw@/db?host=h1:5432,h2:5433&target_session_attrs=read-write",
        "postgresql+psycopg://u:pw@/db?host=h1,h2&port=5432,5433&target_session_attrs=read-write",
    ],
    ids=["repeated", "comma", "lists"],
)
def test_i25_2_every_multi_host_form_gives_libpq_the_same_hosts_and_ports(uri: str) -> None:
    engine = create_store_engine(uri)
    _, params = engine.dialect.create_connect_args(engine.url)
    assert (params["host"], params["port"]) == ("h1,h2", "5432,5433")
    assert params["target_session_attrs"] == "read-write"
    assert (params["user"], params["password"], params["dbname"]) == ("u", "pw", "db")


def test_i25_2_c56_libpqs_hosts_in_the_host_part_fail_init_app_showing_the_query_form() -> None:
    """SQLAlchemy cannot parse ``postgresql://h1:5432,h2:5433/db``; the error says how to
    write it instead of only that it is no URL."""
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URI"] = (
        "postgresql+psycopg2://u:pw@h1:5432,h2:5433/db?target_session_attrs=read-write"
    )
    with pytest.raises(ValueError, match="IDEMPOTENCY_DATABASE_URI") as raised:
        Idempotency(app)
    assert "?host=h1:5432&host=h2:5432" in str(raised.value)
    assert "pw" not in str(raised.value).replace("psycopg2", "")


def test_i25_2_single_host_and_other_databases_are_left_alone() -> None:
    for uri in (
        "postgresql+psycopg2://u@h:5432/db",
        "postgresql+psycopg2://u@/db?host=/run/postgresql",
        "mysql+pymysql://u@h/db?host=x,y:1",
        "sqlite:///idem.sqlite3",
    ):
        assert store_url(uri) == make_url(uri)


class Captured(Exception):
    """Raised by the ``do_connect`` listener: the arguments were seen, no need to connect."""


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
def test_i25_5_store_engines_carry_tcp_limits_on_both_drivers(driver: str) -> None:
    pytest.importorskip(driver)
    engine = create_store_engine(f"postgresql+{driver}://u@127.0.0.1:1/db")
    seen: dict[str, Any] = {}

    def capture(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        seen.update(cparams)
        raise Captured

    event.listen(engine, "do_connect", capture)
    with pytest.raises(Captured):
        engine.connect()
    assert seen["connect_timeout"] == 3
    assert (seen["keepalives"], seen["keepalives_idle"]) == (1, 30)
    assert seen["tcp_user_timeout"] == 5000  # both drivers' libpq here is >= 12
    engine.dispose()


class OperationalError(Exception):
    """Stands in for a driver's error class (only its name and message are read)."""


def test_i25_2_the_error_line_names_every_host_each_driver_tried() -> None:
    libpq = (
        'connection to server at "127.0.0.1", port 6001 failed: Connection refused\n'
        "\tIs the server running on that host and accepting TCP/IP connections?\n"
        'connection to server at "127.0.0.1", port 6002 failed: session is read-only\n'
    )
    psycopg3 = (
        'connection failed: connection to server at "127.0.0.1", port 6002 failed: session'
        " is read-only\nMultiple connection attempts failed. All failures were:\n- host:"
        " '127.0.0.1', port: '6001', hostaddr: '127.0.0.1': connection failed: connection to"
        ' server at "127.0.0.1", port 6001 failed: Connection refused\n\tIs the server running'
        " on that host and accepting TCP/IP connections?\n- host: '127.0.0.1', port: '6002',"
        " hostaddr: '127.0.0.1': connection failed: connection to server at \"127.0.0.1\","
        " port 6002 failed: session is read-only"
    )
    expected = (
        'OperationalError: connection to server at "127.0.0.1", port 6001 failed: Connection'
        ' refused; connection to server at "127.0.0.1", port 6002 failed: session is read-only'
    )
    assert describe(OperationalError(libpq)) == expected
    assert describe(OperationalError(psycopg3)) == expected


def test_c30_the_error_line_never_carries_a_servers_detail() -> None:
    message = 'duplicate key value violates unique constraint "k"\nDETAIL:  Key (k)=(secret).\n'
    assert describe(OperationalError(message)) == (
        'OperationalError: duplicate key value violates unique constraint "k"'
    )


def test_i25_2_read_only_is_sqlstate_25006() -> None:
    class ReadOnly(Exception):
        pgcode = "25006"

    assert is_read_only(ReadOnly())
    assert not is_read_only(OperationalError("x"))


class Peer:
    """One end of a socket pair, shown to the watchdog as a driver's connection."""

    def __init__(self) -> None:
        self.mine, self.theirs = socket.socketpair()

    def fileno(self) -> int:
        return self.mine.fileno()

    def close(self) -> None:
        self.mine.close()
        self.theirs.close()


def test_i25_5_a_late_statement_has_its_socket_shut_down_every_time() -> None:
    """Past its deadline a watched socket is shut down (the driver reads end-of-file); one
    unwatched in time never is; and the watchdog serves statements after idling."""
    dog = Watchdog()
    for _ in range(3):  # the thread sleeps with nothing to watch between rounds
        late, quick = Peer(), Peer()
        try:
            slow, fast = Deadline(0.2), Deadline(0.2)
            assert dog.watch(slow, late) and dog.watch(fast, quick)
            dog.unwatch(fast)
            late.mine.settimeout(5)
            started = time.monotonic()
            assert late.mine.recv(1) == b""  # shut down: end of file
            assert 0.1 < time.monotonic() - started < 4
            assert slow.fired and not fast.fired
            quick.theirs.sendall(b"x")
            assert quick.mine.recv(1) == b"x"  # still open
            dog.unwatch(slow)
            time.sleep(0.3)
        finally:
            late.close()
            quick.close()
    assert dog.fired == 3


def test_i25_5_a_connection_without_a_socket_is_not_watched() -> None:
    assert not Watchdog().watch(Deadline(1.0), object())
