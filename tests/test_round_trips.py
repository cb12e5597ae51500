"""Round trips to PostgreSQL per request on the direct path of psycopg2 and psycopg 3
(issues 11, 21).

CONTRACT C8, C9, C14, C26: the claim, the replay and the completion keep their
guarantees while each costs the one statement it needs. Counted at a loopback
proxy: each driver waits for each answer before it sends again, so every read the
proxy forwards from the client is one round trip.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import jsonify
from sqlalchemy.engine import URL

from flask_idempotency import idempotent
from tests.support.tcp_proxy import TcpProxy

from .test_lifecycle import KEY, REPLAYED

pytestmark = pytest.mark.postgres


@pytest.fixture
def counted(pg_url: URL, make_app: Any) -> Iterator[tuple[TcpProxy, Any]]:
    base = pg_url  # each driver in turn (issue 21)
    proxy = TcpProxy(base.host or "127.0.0.1", base.port or 5432).start()
    url = base.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    app, _ = make_app({"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_CREATE_TABLE": True})

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(ok=True), 201

    client = app.test_client()
    assert client.post("/pay", json={"warm": 1}, headers={"Idempotency-Key": "warm"}).status_code
    yield proxy, client
    app.extensions["idempotency"].store.table.drop(
        app.extensions["idempotency"].store.engine, checkfirst=True
    )
    proxy.stop()


def sends(proxy: TcpProxy, request: Any) -> int:
    before = proxy.client_sends
    request()
    return proxy.client_sends - before


def test_i11_c9_c26_replay_from_postgresql_is_one_round_trip(counted) -> None:
    """C9/C26: a replay reads the stored record in the claim's own statement: 1 round trip
    (it was 4: BEGIN, INSERT, SELECT, COMMIT)."""
    proxy, client = counted
    first = client.post("/pay", json={"a": 1}, headers=KEY)
    assert first.status_code == 201
    replays: list[Any] = []
    n = sends(proxy, lambda: replays.append(client.post("/pay", json={"a": 1}, headers=KEY)))
    assert replays[0].status_code == 201 and replays[0].headers.get(REPLAYED) == "true"
    assert n == 1


def test_i11_c8_c14_first_execution_is_two_round_trips(counted) -> None:
    """C8/C14: a first execution is the claim and the fenced completion, each one
    statement that commits itself: 2 round trips (it was 6)."""
    proxy, client = counted
    answers: list[Any] = []
    n = sends(proxy, lambda: answers.append(client.post("/pay", json={"b": 2}, headers=KEY)))
    assert answers[0].status_code == 201 and answers[0].headers.get(REPLAYED) is None
    assert n == 2
