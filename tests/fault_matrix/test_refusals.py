"""A completion the database refuses for good is not an outage (C58, C33).

CONTRACT C58, C33, C55.

Before C58 a refusal was filed as an outage: the completion was kept as a settlement,
tried again and refused again, and the view ran a second time once the lease lapsed (or
the key answered 409 for ``IDEMPOTENCY_MAX_RUNTIME``). Now the record completes without
its body, as C33 stores a body over ``IDEMPOTENCY_MAX_BODY_BYTES``, or, where even that
is refused, the key is released; once, never kept.

The matrix (write x fault x database -> outcome):

==========  ===============================  ==================  ===========================
write       fault                            database            outcome
==========  ===============================  ==================  ===========================
complete    body over the packet limit       MariaDB (private,   1 run; replay: body omitted;
            (max_allowed_packet = 1 MiB)     PyMySQL)            nothing kept; never sent
complete    54000 program_limit_exceeded     psycopg2,           1 run; replay: body omitted;
            on the body                      psycopg 3           nothing kept
complete    22003 on any completion          psycopg2,           released once
            (even without the body)          psycopg 3           (``store-refused``), nothing
                                                                 kept; the retry runs the view
complete    an outage (kept), then 54000     psycopg2,           the kept try lands without
            on the body                      psycopg 3           the body; 1 run
once()      54000 on the result              psycopg2,           1 run; result omitted;
                                             psycopg 3           nothing kept
check       max_allowed_packet = 1 MiB       MariaDB (private)   prints the effective limit
==========  ===============================  ==================  ===========================

On PostgreSQL the refusals are raised by the server itself, from a trigger on the test's
private table (the 1 GB field limit is too large to reach in a test).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Response
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from flask_idempotency import idempotent, signals
from flask_idempotency.completion import deferred
from flask_idempotency.records import COMPLETED
from tests.conftest import driver_url, running_mariadb
from tests.support.mariadb_server import MariaDBServer
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until
from tests.test_lifecycle import KEY, REPLAYED, rows
from tests.test_pg_rules import record_signal

#: The lease in these tests: a kept completion's retry would come after it.
LEASE = 1.0

#: The PostgreSQL refusals, raised by the server from a trigger on the records table.
REFUSING_TRIGGER = """
CREATE FUNCTION "{name}_refuse"() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.state = 'completed' AND NEW.response_status = 299 THEN
    RAISE EXCEPTION 'value out of range' USING ERRCODE = '22003';
  END IF;
  IF NEW.state = 'completed' AND length(NEW.response_body) > 1000 THEN
    RAISE EXCEPTION 'body over the limit' USING ERRCODE = '54000';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER "{name}_refuse" BEFORE UPDATE ON "{name}"
  FOR EACH ROW EXECUTE FUNCTION "{name}_refuse"();
"""


def counting_app(make_app: Any, url: str, config: dict[str, Any] | None = None) -> Any:
    app, _ = make_app(
        {
            "IDEMPOTENCY_DATABASE_URI": url,
            "IDEMPOTENCY_TABLE": f"idem_{uuid.uuid4().hex[:12]}",
            "IDEMPOTENCY_LEASE": LEASE,
            "IDEMPOTENCY_WAIT": 0,
            **(config or {}),
        }
    )
    app.calls = []  # type: ignore[attr-defined]

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        app.calls.append(1)  # type: ignore[attr-defined]
        size = int(app.config.get("TEST_BODY", 10))
        status = int(app.config.get("TEST_STATUS", 201))
        app.config.get("TEST_AFTER_VIEW", lambda: None)()
        return Response(b"x" * size, status=status, mimetype="application/octet-stream")

    return app


def drop(app: Any) -> None:
    store = app.extensions["idempotency"].store
    for t in (store.table, store.identity_table):
        t.drop(store.engine, checkfirst=True)


@pytest.fixture(params=["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
def refusing_pg(request: Any, make_app: Any) -> Iterator[Any]:
    """An app on PostgreSQL whose table refuses (see :data:`REFUSING_TRIGGER`)."""
    url = driver_url(request.getfixturevalue("pg_database"), request.param)
    app = counting_app(make_app, url.render_as_string(hide_password=False))
    name = app.extensions["idempotency"].store.table.name
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(REFUSING_TRIGGER.format(name=name))
    try:
        yield app
    finally:
        drop(app)
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP FUNCTION IF EXISTS "{name}_refuse"()')
        engine.dispose()


def assert_completed_without_body(app: Any, status: int, size: int) -> None:
    """One run, the answer stored without its body, nothing kept, and a replay after the
    lease serves the omitted-body answer (C33)."""
    deferrals = record_signal(app, signals.settlement_deferred)
    client = app.test_client()
    first = client.post("/pay", headers=KEY)
    assert first.status_code == status and len(first.data) == size
    assert deferrals == [] and deferred.pending() == 0, deferrals
    (row,) = rows(app)
    assert row["state"] == COMPLETED and row["body_omitted"], row
    time.sleep(LEASE * 1.5)  # a kept completion's lease would have lapsed by now
    second = client.post("/pay", headers=KEY)
    assert second.status_code == status, second.get_data(as_text=True)
    assert second.headers.get(REPLAYED) == "true"
    assert second.headers.get("Idempotency-Replay") == "omitted"
    assert app.calls == [1]


@pytest.mark.postgres
def test_c58_c33_a_body_postgresql_refuses_completes_without_it(refusing_pg: Any) -> None:
    """C58/C33: the completion is refused with 54000: stored without its body, once."""
    app = refusing_pg
    app.config["TEST_BODY"] = 2000
    assert_completed_without_body(app, 201, 2000)


@pytest.mark.postgres
def test_c58_a_completion_refused_even_without_its_body_releases_the_key(
    refusing_pg: Any,
) -> None:
    """C58: every completion refused (22003): the key is released once (``claim_released``
    ``store-refused``), nothing is kept, and the retry runs the view."""
    app = refusing_pg
    app.config["TEST_STATUS"] = 299
    released = record_signal(app, signals.claim_released)
    deferrals = record_signal(app, signals.settlement_deferred)
    client = app.test_client()
    assert client.post("/pay", headers=KEY).status_code == 299
    assert [r["reason"] for r in released] == ["store-refused"]
    assert deferrals == [] and deferred.pending() == 0
    assert rows(app) == []
    assert client.post("/pay", headers=KEY).status_code == 299
    assert app.calls == [1, 1]


# -- MariaDB: max_allowed_packet ----------------------------------------------------------


@pytest.fixture(scope="module")
def small_packet_mariadb(tmp_path_factory: Any) -> Iterator[MariaDBServer]:
    """A private MariaDB with ``max_allowed_packet`` = 1 MiB (the machine's is left as is)."""
    directory = tmp_path_factory.mktemp("mariadb-packet")
    with running_mariadb(directory, options=("--max-allowed-packet=1M",)) as server:
        yield server


@pytest.mark.mysql
@pytest.mark.slow
def test_c58_c33_a_body_over_max_allowed_packet_completes_without_it(
    small_packet_mariadb: MariaDBServer, make_app: Any
) -> None:
    """C58/C33: a 2 MiB response on a server taking 1 MiB packets: stored without its
    body (never sent: before C58 the server reset the connection, the completion was
    kept, and the key ran again or answered 409), replayed as omitted, one run."""
    app = counting_app(
        make_app, small_packet_mariadb.url, {"IDEMPOTENCY_MAX_BODY_BYTES": 8 * 1024 * 1024}
    )
    app.config["TEST_BODY"] = 2 * 1024 * 1024
    try:
        store = app.extensions["idempotency"].store
        assert store.largest_body() == (1024 * 1024 - 64 * 1024) // 2
        assert_completed_without_body(app, 201, 2 * 1024 * 1024)
    finally:
        drop(app)


@pytest.mark.mysql
@pytest.mark.slow
def test_c58_check_shows_the_effective_body_limit(
    small_packet_mariadb: MariaDBServer, make_app: Any
) -> None:
    """C58: ``flask idempotency check`` says the largest body stored with its response,
    and that the server's ``max_allowed_packet`` sets it here."""
    app = counting_app(
        make_app, small_packet_mariadb.url, {"IDEMPOTENCY_MAX_BODY_BYTES": 8 * 1024 * 1024}
    )
    try:
        result = app.test_cli_runner().invoke(args=["idempotency", "check"])
        assert result.exit_code == 0, result.output
        assert (
            "Stored bodies: up to 491,520 bytes, the most this database takes in one"
            " completion (IDEMPOTENCY_MAX_BODY_BYTES is 8,388,608)"
        ) in result.output
    finally:
        drop(app)


@pytest.mark.postgres
def test_c58_c33_once_work_whose_result_postgresql_refuses_completes_without_it(
    refusing_pg: Any,
) -> None:
    """C58/C33 for ``once()``: the result's completion is refused (54000): stored without
    the result, once, nothing kept; a duplicate finds the work done (result omitted)."""
    app = refusing_pg
    ext = app.extensions["idempotency"].extension
    deferrals = record_signal(app, signals.settlement_deferred)
    runs: list[int] = []
    with app.app_context():
        with ext.once("mail:1") as run:
            assert run.owned
            runs.append(1)
            run.result = "x" * 2000
        assert deferrals == [] and deferred.pending() == 0, deferrals
        time.sleep(LEASE * 1.5)
        with ext.once("mail:1") as again:
            assert not again.owned
            assert again.result_omitted
    assert runs == [1]


# -- a kept completion (an outage first) that the database then refuses ------------------


@pytest.fixture(params=["psycopg2", "psycopg"], ids=["psycopg2", "psycopg3"])
def proxied_refusing_pg(request: Any, make_app: Any) -> Iterator[tuple[Any, TcpProxy]]:
    """:func:`refusing_pg` reached through a loopback proxy that can go silent."""
    direct = driver_url(request.getfixturevalue("pg_database"), request.param)
    proxy = TcpProxy(direct.host or "127.0.0.1", direct.port or 5432).start()
    routed = direct.set(host="127.0.0.1", port=proxy.port)
    app = counting_app(
        make_app, routed.render_as_string(hide_password=False), {"IDEMPOTENCY_LEASE": 20}
    )
    store = app.extensions["idempotency"].store
    store.statement_deadline = 0.5
    name = store.table.name
    engine = create_engine(direct, poolclass=NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(REFUSING_TRIGGER.format(name=name))
    try:
        yield app, proxy
    finally:
        proxy.restore()
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{name}"')
            conn.exec_driver_sql(f'DROP TABLE IF EXISTS "{store.identity_table.name}"')
            conn.exec_driver_sql(f'DROP FUNCTION IF EXISTS "{name}_refuse"()')
        engine.dispose()
        proxy.stop()


@pytest.mark.postgres
def test_c58_a_kept_completion_the_database_then_refuses_lands_without_its_body(
    proxied_refusing_pg: tuple[Any, TcpProxy],
) -> None:
    """C58/C55: the completion meets an outage (the network silent past the deadline) and
    is kept; once the network is back the database refuses it (54000). The kept try
    stores it without its body and lands, instead of being refused again until
    ``IDEMPOTENCY_MAX_RUNTIME``; one run, the replay serves the omitted-body answer."""
    app, proxy = proxied_refusing_pg
    app.config["TEST_BODY"] = 2000
    deferrals = record_signal(app, signals.settlement_deferred)
    client = app.test_client()
    app.config["TEST_AFTER_VIEW"] = proxy.stall  # the completion gets no reply: kept (C55)
    first = client.post("/pay", headers=KEY)
    assert first.status_code == 201 and len(first.data) == 2000
    assert [d["outcome"] for d in deferrals] == ["deferred"]
    proxy.restore()
    wait_until(
        lambda: any(d["outcome"] != "deferred" for d in deferrals),
        "the kept completion settled",
        within=15,
    )
    assert [d["outcome"] for d in deferrals] == ["deferred", "landed"]
    second = client.post("/pay", headers=KEY)
    assert second.status_code == 201
    assert second.headers.get("Idempotency-Replay") == "omitted"
    assert app.calls == [1]
