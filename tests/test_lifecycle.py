"""The request lifecycle on SQLite (CONTRACT C1, C4, C5, C7, C9, C11, C12, C15–C21, C27, C32, C33).

Every test counts view invocations and looks at the rows in the store: the
contract is about what runs and what is kept, not only about status codes.
Concurrency tests park the original view on an Event and learn that duplicates
are parked from the wake-up hub, so nothing depends on timing.
"""

from __future__ import annotations

import functools
import gc
import gzip
import json
import threading
import time
from typing import Any

import pytest
from flask import (
    Blueprint,
    Flask,
    Response,
    abort,
    jsonify,
    request,
    send_file,
    stream_with_context,
)
from flask.views import MethodView
from sqlalchemy import select
from werkzeug.exceptions import HTTPException

from flask_idempotency import Idempotency, idempotent, release_claim, signals
from flask_idempotency.fingerprint import key_digest, request_fingerprint
from flask_idempotency.records import Claim, Identity
from flask_idempotency.store.clock import db_now_ms
from tests.support.waiting import wait_until as _wait_until

KEY = {"Idempotency-Key": "key-1"}
REPLAYED = "Idempotent-Replayed"
PARK_LIMIT = 20.0  # seconds a test thread may block before the test fails instead of hanging


# -- helpers -----------------------------------------------------------------------------------


def rows(app: Flask) -> list[dict[str, Any]]:
    store = app.extensions["idempotency"].store
    with store.autocommit.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(select(store.table))]


def states(app: Flask) -> list[str]:
    return [row["state"] for row in rows(app)]


def db_now(app: Flask) -> int:
    store = app.extensions["idempotency"].store
    with store.autocommit.connect() as conn:
        return int(conn.execute(select(db_now_ms())).scalar_one())


def wait_for_db_clock(app: Flask, past_ms: int) -> None:
    """Poll the database clock until it is past ``past_ms`` (bounded; no sleep-and-hope)."""
    deadline = time.monotonic() + 30
    while db_now(app) <= past_ms:
        assert time.monotonic() < deadline, "the database clock did not advance"
        time.sleep(0.02)


wait_until = functools.partial(_wait_until, within=PARK_LIMIT)


def parked(app: Flask) -> int:
    return app.extensions["idempotency"].wakeups.parked_count


def assert_problem(response, status: int, code: str) -> dict[str, Any]:
    """C27: RFC 9457 members, our ``code``, and the problem media type."""
    assert response.status_code == status, response.data
    assert response.mimetype == "application/problem+json"
    body = json.loads(response.data)
    assert body["status"] == status
    assert body["code"] == code
    assert body["type"].endswith(code)
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    assert REPLAYED not in response.headers
    return body


class Background:
    """Run a request in a thread and keep its response."""

    def __init__(self, app: Flask, path: str, **kwargs: Any) -> None:
        self.response = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.response = app.test_client().post(path, **kwargs)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self):
        self.thread.join(PARK_LIMIT)
        assert not self.thread.is_alive(), "request thread did not finish"
        if self.error is not None:
            raise self.error
        return self.response


@pytest.fixture
def app_calls(make_app):
    """An app that answers duplicates at once (wait=0), and a list to count calls in."""
    app, ext = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []
    return app, ext, calls


# -- C1: applicability -----------------------------------------------------------------------


def test_c1_other_methods_on_a_protected_view_ignore_the_key(app_calls) -> None:
    app, _, calls = app_calls

    @app.route("/thing", methods=["GET", "PUT", "DELETE", "POST"])
    @idempotent
    def thing():
        calls.append(request.method)
        return jsonify(n=len(calls))

    client = app.test_client()
    for method in ("GET", "PUT", "DELETE", "GET", "PUT", "DELETE"):
        response = client.open("/thing", method=method, headers=KEY)
        assert response.status_code == 200
        assert REPLAYED not in response.headers
    assert calls == ["GET", "PUT", "DELETE"] * 2
    assert rows(app) == []
    client.post("/thing", headers=KEY)
    client.post("/thing", headers=KEY)
    assert calls.count("POST") == 1
    assert states(app) == ["completed"]


def test_c1_unprotected_view_ignores_the_key(app_calls) -> None:
    app, _, calls = app_calls

    @app.post("/plain")
    def plain():
        calls.append("plain")
        return jsonify(n=len(calls)), 201

    client = app.test_client()
    first = client.post("/plain", json={}, headers=KEY)
    second = client.post("/plain", json={}, headers=KEY)
    assert first.json == {"n": 1} and second.json == {"n": 2}
    assert REPLAYED not in second.headers
    assert rows(app) == []


def test_c1_patch_is_protected_by_default(app_calls) -> None:
    app, _, calls = app_calls

    @app.patch("/thing")
    @idempotent
    def thing():
        calls.append("patch")
        return jsonify(n=len(calls))

    client = app.test_client()
    client.patch("/thing", json={"a": 1}, headers=KEY)
    again = client.patch("/thing", json={"a": 1}, headers=KEY)
    assert again.headers.get(REPLAYED) == "true"
    assert calls == ["patch"]


def test_c1_route_methods_override(app_calls) -> None:
    app, _, calls = app_calls

    @app.route("/thing", methods=["POST", "PUT"])
    @idempotent(methods=["PUT"])
    def thing():
        calls.append(request.method)
        return jsonify(n=len(calls))

    client = app.test_client()
    for _ in range(2):
        client.post("/thing", headers=KEY)
        client.put("/thing", headers=KEY)
    assert calls == ["POST", "PUT", "POST"]


# -- C4: required ------------------------------------------------------------------------------


def test_c4_required_without_key_is_400_missing_key(app_calls) -> None:
    app, _, calls = app_calls

    @app.post("/pay")
    @idempotent(required=True)
    def pay():
        calls.append("pay")
        return "ok"

    response = app.test_client().post("/pay", json={})
    assert_problem(response, 400, "missing-key")
    assert calls == []
    assert rows(app) == []


def test_c4_required_by_config(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_REQUIRED": True})

    @app.post("/pay")
    @idempotent
    def pay():
        return "ok"

    @app.post("/optional")
    @idempotent(required=False)
    def optional():
        return "ok"

    assert_problem(app.test_client().post("/pay"), 400, "missing-key")
    assert app.test_client().post("/optional").status_code == 200


def test_c4_not_required_without_key_runs_unprotected(app_calls) -> None:
    app, _, calls = app_calls

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return jsonify(n=len(calls))

    client = app.test_client()
    first = client.post("/pay", json={})
    second = client.post("/pay", json={})
    assert (first.json, second.json) == ({"n": 1}, {"n": 2})
    assert REPLAYED not in second.headers
    assert rows(app) == []


# -- C5: scope ---------------------------------------------------------------------------------


def test_c5_scope_loader_never_replays_across_scopes(make_app) -> None:
    app, ext = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[str] = []

    @ext.scope_loader
    def tenant() -> str | None:
        return request.headers.get("X-Tenant")

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(request.headers.get("X-Tenant", "-"))
        return jsonify(tenant=calls[-1], n=len(calls))

    client = app.test_client()
    a = client.post("/pay", json={}, headers={**KEY, "X-Tenant": "a"})
    b = client.post("/pay", json={}, headers={**KEY, "X-Tenant": "b"})
    a2 = client.post("/pay", json={}, headers={**KEY, "X-Tenant": "a"})
    b2 = client.post("/pay", json={}, headers={**KEY, "X-Tenant": "b"})
    assert calls == ["a", "b"]
    assert a.json["tenant"] == "a" and b.json["tenant"] == "b"
    assert a2.data == a.data and b2.data == b.data
    assert a2.headers.get(REPLAYED) == b2.headers.get(REPLAYED) == "true"
    assert len(rows(app)) == 2
    # A different body in scope b does not collide with scope a's record (and vice versa).
    c = client.post("/pay", json={"x": 1}, headers={**KEY, "X-Tenant": "c"})
    assert c.status_code == 200


def test_c5_default_scope_is_the_authorization_header(app_calls) -> None:
    app, _, calls = app_calls
    app.config["SECRET_KEY"] = "lifecycle-tests"  # the digest's key (issue 26 item 5)

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(request.headers.get("Authorization", "anon"))
        return jsonify(n=len(calls))

    client = app.test_client()
    alice = {**KEY, "Authorization": "Bearer alice"}
    bob = {**KEY, "Authorization": "Bearer bob"}
    client.post("/pay", json={}, headers=alice)
    client.post("/pay", json={}, headers=bob)
    assert client.post("/pay", json={}, headers=alice).headers.get(REPLAYED) == "true"
    client.post("/pay", json={}, headers=KEY)
    assert client.post("/pay", json={}, headers=KEY).headers.get(REPLAYED) == "true"
    assert calls == ["Bearer alice", "Bearer bob", "anon"]
    scopes = {row["scope"] for row in rows(app)}
    assert "anonymous" in scopes and len(scopes) == 3
    assert not any("alice" in s or "bob" in s for s in scopes), "scope stores a digest only"


def test_c5_scope_loader_returning_none_falls_back_to_default(make_app) -> None:
    app, ext = make_app()
    ext.scope_loader(lambda: None)

    @app.post("/pay")
    @idempotent
    def pay():
        return "ok"

    app.test_client().post("/pay", headers=KEY)
    assert [row["scope"] for row in rows(app)] == ["anonymous"]


# -- C7: mismatch -------------------------------------------------------------------------------


def test_c7_different_body_is_422_and_the_record_is_untouched(app_calls) -> None:
    app, _, calls = app_calls

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return jsonify(amount=request.json["amount"]), 201

    client = app.test_client()
    first = client.post("/pay", json={"amount": 1}, headers=KEY)
    before = rows(app)
    mismatch = client.post("/pay", json={"amount": 2}, headers=KEY)
    assert_problem(mismatch, 422, "key-reused")
    assert rows(app) == before
    retry = client.post("/pay", json={"amount": 1}, headers=KEY)
    assert retry.status_code == 201
    assert retry.data == first.data
    assert retry.headers.get(REPLAYED) == "true"
    assert calls == ["pay"]


def test_c7_reuse_across_routes_query_and_method_is_422(app_calls) -> None:
    app, _, calls = app_calls

    @app.route("/a", methods=["POST", "PATCH"])
    @idempotent
    def route_a():
        calls.append("a")
        return "a"

    @app.post("/b")
    @idempotent
    def route_b():
        calls.append("b")
        return "b"

    client = app.test_client()
    assert client.post("/a", json={}, headers=KEY).status_code == 200
    assert_problem(client.post("/b", json={}, headers=KEY), 422, "key-reused")
    assert_problem(client.post("/a?x=1", json={}, headers=KEY), 422, "key-reused")
    assert_problem(client.patch("/a", json={}, headers=KEY), 422, "key-reused")
    assert calls == ["a"]
    assert client.post("/a", json={}, headers=KEY).headers.get(REPLAYED) == "true"


# -- C9: replay ---------------------------------------------------------------------------------


def test_c9_replay_status_body_and_allow_listed_headers(app_calls) -> None:
    app, _, calls = app_calls

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        response = Response(b'{"id": 7,  "odd spacing": true}\n', status=201)
        response.headers["Content-Type"] = "application/vnd.pay+json; charset=utf-8"
        response.headers["Location"] = "/payments/7"
        response.headers["ETag"] = '"v1"'
        response.headers["Last-Modified"] = "Wed, 21 Oct 2015 07:28:00 GMT"
        response.headers["Content-Language"] = "de"
        response.headers["X-Request-Id"] = f"req-{len(calls)}"
        response.set_cookie("session", "secret")
        return response

    client = app.test_client()
    first = client.post("/pay", json={}, headers=KEY)
    assert REPLAYED not in first.headers
    assert "Set-Cookie" in first.headers
    replayed = client.post("/pay", json={}, headers=KEY)
    assert replayed.status_code == 201
    assert replayed.data == first.data
    assert replayed.headers.get(REPLAYED) == "true"
    for name in ("Content-Type", "Location", "ETag", "Last-Modified", "Content-Language"):
        assert replayed.headers.get(name) == first.headers.get(name), name
    assert "Set-Cookie" not in replayed.headers
    assert "X-Request-Id" not in replayed.headers
    assert calls == ["pay"]


def test_c62_a_replay_keeps_the_caching_semantics_of_the_original(app_calls) -> None:
    """C62: ``Cache-Control``, ``Vary``, ``Expires`` and ``Content-Disposition`` are stored
    and replayed by default: a ``no-store`` answer (a private receipt, say) is never
    replayed without it, where a shared cache could keep it."""
    app, _, calls = app_calls

    @app.post("/receipt")
    @idempotent
    def receipt():
        calls.append("receipt")
        response = Response(b"receipt 7", status=201, mimetype="application/pdf")
        response.headers["Cache-Control"] = "no-store, private"
        response.headers["Vary"] = "Authorization, Accept-Language"
        response.headers["Expires"] = "0"
        response.headers["Content-Disposition"] = 'attachment; filename="receipt-7.pdf"'
        return response

    client = app.test_client()
    first = client.post("/receipt", json={}, headers=KEY)
    replayed = client.post("/receipt", json={}, headers=KEY)
    assert replayed.headers.get(REPLAYED) == "true" and calls == ["receipt"]
    for name in ("Cache-Control", "Vary", "Expires", "Content-Disposition"):
        assert replayed.headers.get(name) == first.headers.get(name), name


def test_c9_compressed_body_replays_with_its_content_encoding(app_calls) -> None:
    """A compression hook in after_request: the layer stores the view's own response and
    the hook compresses the first answer and the replay alike, so both carry the same
    gzip bytes with their Content-Encoding (the hook runs once on each, never twice)."""
    app, _, calls = app_calls

    @app.after_request
    def compress(response: Response) -> Response:
        if "Content-Encoding" in response.headers:  # as Flask-Compress does
            return response
        response.set_data(gzip.compress(response.get_data(), mtime=0))
        response.headers["Content-Encoding"] = "gzip"
        return response

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return jsonify(paid=True), 201

    client = app.test_client()
    first = client.post("/pay", headers=KEY)
    again = client.post("/pay", headers=KEY)
    assert json.loads(gzip.decompress(first.data)) == {"paid": True}
    assert again.headers.get(REPLAYED) == "true" and calls == ["pay"]
    assert again.headers.get("Content-Encoding") == "gzip"
    assert again.data == first.data
    assert json.loads(gzip.decompress(again.data)) == {"paid": True}


def test_c9_configured_replay_headers_and_header_name(make_app) -> None:
    app, _ = make_app(
        {
            "IDEMPOTENCY_REPLAY_HEADERS": ["Content-Type", "X-Request-Cost"],
            "IDEMPOTENCY_REPLAY_HEADER": "X-Replayed",
        }
    )

    @app.post("/pay")
    @idempotent
    def pay():
        return "ok", 200, {"X-Request-Cost": "3", "ETag": '"e"'}

    client = app.test_client()
    client.post("/pay", headers=KEY)
    again = client.post("/pay", headers=KEY)
    assert again.headers.get("X-Replayed") == "true"
    assert REPLAYED not in again.headers
    assert again.headers.get("X-Request-Cost") == "3"
    assert "ETag" not in again.headers


def test_c9_replay_without_content_type_adds_none(app_calls) -> None:
    app, _, _ = app_calls

    @app.post("/pay")
    @idempotent
    def pay():
        response = Response(b"raw", status=200)
        del response.headers["Content-Type"]
        return response

    client = app.test_client()
    client.post("/pay", headers=KEY)
    again = client.post("/pay", headers=KEY)
    assert again.data == b"raw"
    assert "Content-Type" not in again.headers


# -- C11, C12: in flight -------------------------------------------------------------------------


def blocking_view(app: Flask, calls: list[str], **options: Any):
    """A protected view whose first call parks until ``release`` is set."""
    entered, release = threading.Event(), threading.Event()
    first_status: list[int] = [201]

    @app.post("/slow")
    @idempotent(**options)
    def slow():
        calls.append("slow")
        if len(calls) == 1:
            entered.set()
            assert release.wait(PARK_LIMIT)
            return jsonify(n=1), first_status[0]
        return jsonify(n=len(calls)), 201

    return entered, release, first_status


def test_c8_parallel_first_requests_execute_once(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_WAIT": PARK_LIMIT})
    calls: list[str] = []
    lock = threading.Lock()

    @app.post("/pay")
    @idempotent
    def pay():
        with lock:
            calls.append("pay")
        return jsonify(n=len(calls)), 201

    racers = 10
    barrier = threading.Barrier(racers)
    responses: list[Any] = []

    def race() -> None:
        client = app.test_client()
        barrier.wait(PARK_LIMIT)
        responses.append(client.post("/pay", json={"a": 1}, headers=KEY))

    threads = [threading.Thread(target=race, daemon=True) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PARK_LIMIT * 2)
    assert len(responses) == racers
    assert calls == ["pay"]
    assert all(r.status_code == 201 and r.data == responses[0].data for r in responses)
    assert sum(REPLAYED not in r.headers for r in responses) == 1


def test_c11_in_flight_duplicate_with_wait_0_is_409(app_calls) -> None:
    app, _, calls = app_calls
    entered, release, _ = blocking_view(app, calls)
    original = Background(app, "/slow", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    duplicate = app.test_client().post("/slow", json={"a": 1}, headers=KEY)
    assert_problem(duplicate, 409, "request-in-progress")
    assert int(duplicate.headers["Retry-After"]) >= 1
    assert states(app) == ["in_progress"], "a 409 is never stored (C18)"
    release.set()
    first = original.result()
    assert first.status_code == 201
    replay = app.test_client().post("/slow", json={"a": 1}, headers=KEY)
    assert replay.headers.get(REPLAYED) == "true" and replay.data == first.data
    assert calls == ["slow"]


def test_c7_mismatch_while_in_flight_is_422_not_409(app_calls) -> None:
    app, _, calls = app_calls
    entered, release, _ = blocking_view(app, calls, wait=10)
    original = Background(app, "/slow", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    mismatch = app.test_client().post("/slow", json={"a": 2}, headers=KEY)
    assert_problem(mismatch, 422, "key-reused")
    assert parked(app) == 0
    release.set()
    assert original.result().status_code == 201
    assert calls == ["slow"]


def test_c10_duplicate_with_wait_gets_the_replay(app_calls) -> None:
    app, _, calls = app_calls
    entered, release, _ = blocking_view(app, calls, wait=PARK_LIMIT)
    original = Background(app, "/slow", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    duplicate = Background(app, "/slow", json={"a": 1}, headers=KEY)
    wait_until(lambda: parked(app) == 1, "the duplicate to park")
    release.set()
    first, second = original.result(), duplicate.result()
    assert first.status_code == second.status_code == 201
    assert REPLAYED not in first.headers
    assert second.headers.get(REPLAYED) == "true"
    assert second.data == first.data
    assert calls == ["slow"]


def test_c11_wait_that_runs_out_is_409(app_calls) -> None:
    app, _, calls = app_calls
    waited = []
    signals.request_waited.connect(lambda sender, **kw: waited.append(kw), app, weak=False)
    entered, release, _ = blocking_view(app, calls, wait=0.2)
    original = Background(app, "/slow", json={}, headers=KEY)
    try:
        assert entered.wait(PARK_LIMIT)
        late = app.test_client().post("/slow", json={}, headers=KEY)
        assert_problem(late, 409, "request-in-progress")
        assert int(late.headers["Retry-After"]) >= 1
        assert [w["outcome"] for w in waited] == ["record"]
        assert waited[0]["waited"] > 0
    finally:
        release.set()
    assert original.result().status_code == 201


def test_c11_too_many_parked_requests_answer_409_at_once(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_WAIT": PARK_LIMIT, "IDEMPOTENCY_MAX_WAITERS": 0})
    calls: list[str] = []
    entered, release, _ = blocking_view(app, calls)
    original = Background(app, "/slow", json={}, headers=KEY)
    try:
        assert entered.wait(PARK_LIMIT)
        response = app.test_client().post("/slow", json={}, headers=KEY)
        assert_problem(response, 409, "request-in-progress")
        assert states(app) == ["in_progress"], "answered while the original still runs"
    finally:
        release.set()
    assert original.result().status_code == 201


def test_c12_release_while_waiters_park_lets_exactly_one_rerun(app_calls) -> None:
    app, _, calls = app_calls
    entered, release, first_status = blocking_view(app, calls, wait=PARK_LIMIT)
    first_status[0] = 500  # the original fails: its claim is released (C17, C20)
    original = Background(app, "/slow", json={"a": 1}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    waiters = [Background(app, "/slow", json={"a": 1}, headers=KEY) for _ in range(3)]
    wait_until(lambda: parked(app) == 3, "three duplicates to park")
    release.set()
    assert original.result().status_code == 500
    results = [w.result() for w in waiters]
    executed = [r for r in results if REPLAYED not in r.headers]
    replayed = [r for r in results if r.headers.get(REPLAYED) == "true"]
    assert len(calls) == 2, "exactly one waiter re-executes"
    assert len(executed) == 1 and executed[0].status_code == 201
    assert len(replayed) == 2
    assert all(r.data == executed[0].data for r in replayed)
    assert states(app) == ["completed"]


# -- C15: every exit path ends stored or released --------------------------------------------


def exit_path_app(make_app, config: dict | None = None):
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0, **(config or {})})
    calls: list[str] = []
    return app, calls


def run_twice(app: Flask, path: str, **kwargs: Any):
    client = app.test_client()
    return client.post(path, headers=KEY, **kwargs), client.post(path, headers=KEY, **kwargs)


def test_c15_normal_return_is_stored(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/ok")
    @idempotent
    def ok():
        calls.append("ok")
        return "done", 200

    first, second = run_twice(app, "/ok")
    assert states(app) == ["completed"]
    assert REPLAYED not in first.headers
    assert second.headers.get(REPLAYED) == "true" and calls == ["ok"]


@pytest.mark.parametrize("status", [400, 404, 410, 422])  # 401/403: test_request_limits
def test_c15_c16_abort_4xx_is_stored_and_replayed(make_app, status: int) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/fail")
    @idempotent
    def fail():
        calls.append("fail")
        abort(status)

    first, second = run_twice(app, "/fail")
    assert first.status_code == second.status_code == status
    assert second.data == first.data
    assert second.headers.get(REPLAYED) == "true"
    assert calls == ["fail"]
    assert states(app) == ["completed"]


@pytest.mark.parametrize("status", [301, 302, 303, 307])
def test_c16_redirects_are_stored_with_location(make_app, status: int) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/go")
    @idempotent
    def go():
        calls.append("go")
        return Response("", status=status, headers={"Location": "/payments/9"})

    first, second = run_twice(app, "/go")
    assert second.status_code == status
    assert second.headers["Location"] == first.headers["Location"]
    assert calls == ["go"]


@pytest.mark.parametrize("status", [408, 409, 423, 425, 429])
def test_c16_transient_statuses_release(make_app, status: int) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/busy")
    @idempotent
    def busy():
        calls.append("busy")
        return jsonify(try_again=True), status

    first, second = run_twice(app, "/busy")
    assert first.status_code == second.status_code == status
    assert REPLAYED not in second.headers
    assert calls == ["busy", "busy"]
    assert rows(app) == []


@pytest.mark.parametrize("how", ["abort", "return"])
@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_c17_server_errors_release(make_app, status: int, how: str) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/boom")
    @idempotent
    def boom():
        calls.append("boom")
        if how == "abort":
            abort(status)
        return "broken", status

    first, second = run_twice(app, "/boom")
    assert first.status_code == second.status_code == status
    assert REPLAYED not in second.headers
    assert calls == ["boom", "boom"]
    assert rows(app) == []


def test_c17_store_server_errors_keeps_5xx(make_app) -> None:
    app, calls = exit_path_app(make_app, {"IDEMPOTENCY_STORE_SERVER_ERRORS": True})

    @app.post("/boom")
    @idempotent
    def boom():
        calls.append("boom")
        return "broken", 500

    first, second = run_twice(app, "/boom")
    assert second.status_code == 500 and second.headers.get(REPLAYED) == "true"
    assert second.data == first.data
    assert calls == ["boom"]
    assert states(app) == ["completed"]


def test_c17_store_server_errors_per_route(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/sticky")
    @idempotent(store_server_errors=True)
    def sticky():
        calls.append("sticky")
        return "broken", 502

    _, second = run_twice(app, "/sticky")
    assert second.headers.get(REPLAYED) == "true" and calls == ["sticky"]


def test_c17_exceptions_still_release_with_store_server_errors(make_app) -> None:
    app, calls = exit_path_app(
        make_app, {"IDEMPOTENCY_STORE_SERVER_ERRORS": True, "TESTING": False}
    )

    @app.post("/crash")
    @idempotent
    def crash():
        calls.append("crash")
        raise RuntimeError("bug")

    first, second = run_twice(app, "/crash")
    assert first.status_code == second.status_code == 500
    assert calls == ["crash", "crash"]
    assert rows(app) == []


def test_c15_uncaught_exception_propagating_releases(make_app) -> None:
    app, calls = exit_path_app(make_app)
    assert app.config["TESTING"] and app.config.get("PROPAGATE_EXCEPTIONS") is None

    @app.post("/crash")
    @idempotent
    def crash():
        calls.append("crash")
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")
        return "recovered", 201

    client = app.test_client()
    with pytest.raises(RuntimeError, match="first attempt"):
        client.post("/crash", headers=KEY)
    assert rows(app) == []
    retry = client.post("/crash", headers=KEY)
    assert retry.status_code == 201 and REPLAYED not in retry.headers
    assert calls == ["crash", "crash"]
    assert states(app) == ["completed"]


def test_c15_uncaught_exception_in_production_releases(make_app) -> None:
    app, calls = exit_path_app(make_app, {"TESTING": False, "PROPAGATE_EXCEPTIONS": False})

    @app.post("/crash")
    @idempotent
    def crash():
        calls.append("crash")
        raise KeyError("oops")

    first, second = run_twice(app, "/crash")
    assert first.status_code == second.status_code == 500
    assert calls == ["crash", "crash"]
    assert rows(app) == []


def test_c15_exception_turned_into_a_response_by_an_error_handler(make_app) -> None:
    """A handled exception is an ordinary response: a 4xx is stored, a 5xx released."""
    app, calls = exit_path_app(make_app, {"TESTING": False})

    @app.errorhandler(LookupError)
    def not_found(exc):
        return jsonify(error="missing"), 404

    @app.errorhandler(ArithmeticError)
    def unavailable(exc):
        return jsonify(error="later"), 503

    @app.post("/lookup")
    @idempotent
    def lookup():
        calls.append("lookup")
        raise KeyError("nope")

    @app.post("/divide")
    @idempotent
    def divide():
        calls.append("divide")
        raise ZeroDivisionError

    client = app.test_client()
    for _ in range(2):
        assert client.post("/lookup", headers={"Idempotency-Key": "l"}).status_code == 404
        assert client.post("/divide", headers={"Idempotency-Key": "d"}).status_code == 503
    assert calls.count("lookup") == 1
    assert calls.count("divide") == 2
    assert states(app) == ["completed"]


def test_c15_c32_streamed_response_is_stored_and_replayed(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/stream")
    @idempotent
    def stream():
        calls.append("stream")

        def generate():
            for i in range(50):
                yield f"chunk {i};".encode()
            yield bytes(range(256))

        return Response(generate(), status=201, mimetype="application/octet-stream")

    first, second = run_twice(app, "/stream")
    expected = b"".join(f"chunk {i};".encode() for i in range(50)) + bytes(range(256))
    assert first.data == expected
    assert second.data == expected and second.status_code == 201
    assert second.headers.get(REPLAYED) == "true"
    assert calls == ["stream"]
    assert states(app) == ["completed"]


def test_c32_stream_with_context_is_stored(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/stream")
    @idempotent
    def stream():
        calls.append("stream")

        @stream_with_context
        def generate():
            yield request.path.encode()
            yield b"!"

        return Response(generate())

    first, second = run_twice(app, "/stream")
    assert first.data == second.data == b"/stream!"
    assert calls == ["stream"]


def test_c15_stream_that_fails_while_buffered_releases(make_app) -> None:
    app, calls = exit_path_app(make_app, {"TESTING": False})

    @app.post("/broken-stream")
    @idempotent
    def broken_stream():
        calls.append("stream")

        def generate():
            yield b"partial"
            raise RuntimeError("the source went away")

        return Response(generate())

    client = app.test_client()
    first = client.post("/broken-stream", headers=KEY)
    assert first.status_code == 500
    assert "in_progress" not in states(app)
    client.post("/broken-stream", headers=KEY)
    assert calls == ["stream", "stream"]


class ClosableBody:
    """A response body that records whether the server closed it (WSGI requires it)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.closed = False

    def __iter__(self):
        return iter(self.chunks)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("limit", [10_000, 5])
def test_c32_buffered_body_is_still_closed(make_app, limit: int) -> None:
    """Buffering a streamed body must not skip its ``close()`` (files, DB cursors)."""
    app, _ = exit_path_app(make_app, {"IDEMPOTENCY_MAX_BODY_BYTES": limit})
    bodies: list[ClosableBody] = []

    @app.post("/iter")
    @idempotent
    def iterable():
        bodies.append(ClosableBody([b"abc", b"def"]))
        return Response(bodies[-1])

    first, second = run_twice(app, "/iter")
    assert first.data == b"abcdef"
    first.close()  # what a WSGI server does when the response is sent
    assert second.headers.get(REPLAYED) == "true"
    assert len(bodies) == 1 and bodies[0].closed


def test_c32_send_file_is_stored_replayed_and_closed(make_app, tmp_path) -> None:
    app, calls = exit_path_app(make_app)
    data = tmp_path / "report.bin"
    data.write_bytes(bytes(range(256)) * 100)

    @app.post("/report")
    @idempotent
    def report():
        calls.append("report")
        return send_file(str(data), mimetype="application/octet-stream")

    first, second = run_twice(app, "/report")
    assert first.data == second.data == data.read_bytes()
    assert second.headers.get(REPLAYED) == "true"
    assert second.headers["Content-Type"] == "application/octet-stream"
    assert calls == ["report"]
    gc.collect()  # an unclosed file would warn now, inside this test (warnings are errors)


@pytest.mark.parametrize("streamed", [False, True])
def test_c33_oversized_response_completes_with_body_omitted(make_app, streamed: bool) -> None:
    app, calls = exit_path_app(make_app, {"IDEMPOTENCY_MAX_BODY_BYTES": 1000})
    body = bytes(range(256)) * 20  # 5120 bytes

    @app.post("/big")
    @idempotent
    def big():
        calls.append("big")
        payload = (body[i : i + 100] for i in range(0, len(body), 100)) if streamed else body
        return Response(
            payload, status=201, headers={"ETag": '"big"'}, mimetype="application/octet-stream"
        )

    first, second = run_twice(app, "/big")
    assert first.status_code == 201 and first.data == body, "the first client gets it all"
    assert second.status_code == 201
    assert second.data == b""
    assert second.headers.get(REPLAYED) == "true"
    assert second.headers.get("Idempotency-Replay") == "omitted"
    assert second.headers.get("ETag") == '"big"'
    assert calls == ["big"], "an oversized body never causes a re-execution"
    (row,) = rows(app)
    assert row["state"] == "completed" and row["body_omitted"]


def test_c33_body_at_the_limit_is_stored_whole(make_app) -> None:
    app, _ = exit_path_app(make_app, {"IDEMPOTENCY_MAX_BODY_BYTES": 1000})

    @app.post("/edge")
    @idempotent
    def edge():
        return b"x" * 1000

    first, second = run_twice(app, "/edge")
    assert second.data == first.data == b"x" * 1000
    assert "Idempotency-Replay" not in second.headers


def test_r48_rejection_by_a_later_hook_is_not_stored(make_app) -> None:
    app, calls = exit_path_app(make_app, {"TESTING": False})

    @app.before_request
    def csrf():
        if request.method == "POST" and request.headers.get("X-CSRF") != "ok":
            abort(403)

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return "paid", 201

    client = app.test_client()
    assert client.post("/pay", headers=KEY).status_code == 403
    retry = client.post("/pay", headers={**KEY, "X-CSRF": "ok"})
    assert retry.status_code == 201, "the view never ran, so nothing may have been stored"
    assert calls == ["pay"]


# -- C18, C19 ------------------------------------------------------------------------------------


def test_c18_layer_errors_are_never_stored(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/pay")
    @idempotent(required=True)
    def pay():
        calls.append("pay")
        return "paid", 201

    client = app.test_client()
    assert_problem(client.post("/pay", json={}), 400, "missing-key")
    assert_problem(
        client.post("/pay", json={}, headers={"Idempotency-Key": '"bad'}), 400, "invalid-key"
    )
    assert rows(app) == []
    client.post("/pay", json={"a": 1}, headers=KEY)
    stored = rows(app)
    assert_problem(client.post("/pay", json={"a": 2}, headers=KEY), 422, "key-reused")
    assert rows(app) == stored
    assert calls == ["pay"]


def test_c19_release_claim_sends_but_does_not_store(make_app) -> None:
    app, calls = exit_path_app(make_app)
    results: list[bool] = []

    @app.post("/validate")
    @idempotent
    def validate():
        calls.append("validate")
        if len(calls) == 1:
            results.append(release_claim())
            return jsonify(error="fix the amount"), 400
        return jsonify(ok=True), 201

    client = app.test_client()
    first = client.post("/validate", json={}, headers=KEY)
    assert first.status_code == 400 and first.json == {"error": "fix the amount"}
    assert results == [True]
    assert rows(app) == []
    second = client.post("/validate", json={}, headers=KEY)
    assert second.status_code == 201 and REPLAYED not in second.headers
    assert calls == ["validate", "validate"]


def test_c19_release_claim_without_a_claim_is_false(make_app) -> None:
    app, _ = exit_path_app(make_app)
    results: list[bool] = []

    @app.post("/plain")
    def plain():
        results.append(release_claim())
        return "ok"

    @app.post("/protected")
    @idempotent
    def protected():
        results.append(release_claim())
        return "ok"

    client = app.test_client()
    client.post("/plain", headers=KEY)
    client.post("/protected")  # no key: no claim
    assert results == [False, False]


# -- C21: expiry ----------------------------------------------------------------------------------


def test_c21_expired_record_runs_again_and_accepts_a_new_body(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/short")
    @idempotent(ttl=1, lease=0.5)
    def short():
        calls.append(json.dumps(request.json))
        return jsonify(n=len(calls)), 201

    client = app.test_client()
    first = client.post("/short", json={"a": 1}, headers=KEY)
    (row,) = rows(app)
    # No replay check here: on a loaded machine a second may already have passed.
    wait_for_db_clock(app, row["expires_at_ms"])
    again = client.post("/short", json={"a": 1}, headers=KEY)
    assert again.status_code == 201 and REPLAYED not in again.headers
    assert again.json == {"n": 2} and first.json == {"n": 1}
    wait_for_db_clock(app, rows(app)[0]["expires_at_ms"])
    different = client.post("/short", json={"a": 2}, headers=KEY)
    assert different.status_code == 201, "after expiry a new body is a new request, not 422"
    assert len(calls) == 3
    assert len(rows(app)) == 1


def test_c21_replay_does_not_extend_life(make_app) -> None:
    app, calls = exit_path_app(make_app)

    @app.post("/pay")
    @idempotent(ttl=3600)
    def pay():
        calls.append("pay")
        return "paid", 201

    client = app.test_client()
    client.post("/pay", headers=KEY)
    (before,) = rows(app)
    assert before["expires_at_ms"] - before["created_at_ms"] == 3600 * 1000
    for _ in range(3):
        assert client.post("/pay", headers=KEY).headers.get(REPLAYED) == "true"
    (after,) = rows(app)
    assert (after["created_at_ms"], after["expires_at_ms"]) == (
        before["created_at_ms"],
        before["expires_at_ms"],
    )
    assert calls == ["pay"]


def test_c21_in_progress_with_live_lease_is_not_expired(make_app) -> None:
    """Seed an in-progress claim past its expiry whose lease still holds: no one may run."""
    app, calls = exit_path_app(make_app)

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return "paid"

    with app.test_request_context("/pay", method="POST", json={"a": 1}, headers=KEY):
        ident = Identity(
            "anonymous",
            key_digest("anonymous", "key-1"),
            request_fingerprint(request),
            "POST",
            "/pay",
        )
    store = app.extensions["idempotency"].store
    claim = store.acquire(ident, ttl=0.05, lease=60)
    assert isinstance(claim, Claim)
    wait_for_db_clock(app, claim.expires_at_ms)
    response = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert_problem(response, 409, "request-in-progress")
    other = app.test_client().post("/pay", json={"a": 2}, headers=KEY)
    assert_problem(other, 422, "key-reused")
    assert calls == []
    assert rows(app)[0]["lock_token"] == claim.lock_token


def test_c13_lapsed_lease_is_taken_over_through_the_app(make_app) -> None:
    app, calls = exit_path_app(make_app)
    executed: list[dict] = []
    signals.request_executed.connect(lambda sender, **kw: executed.append(kw), app, weak=False)

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return "paid", 201

    with app.test_request_context("/pay", method="POST", json={"a": 1}, headers=KEY):
        ident = Identity(
            "anonymous",
            key_digest("anonymous", "key-1"),
            request_fingerprint(request),
            "POST",
            "/pay",
        )
    store = app.extensions["idempotency"].store
    crashed = store.acquire(ident, ttl=3600, lease=0.05)
    wait_for_db_clock(app, rows(app)[0]["lease_expires_at_ms"])
    response = app.test_client().post("/pay", json={"a": 1}, headers=KEY)
    assert response.status_code == 201 and calls == ["pay"]
    assert [e["how"] for e in executed] == ["taken_over"]
    assert store.complete(crashed, store.get(ident.key_digest).response) is None


# -- C27: problem details --------------------------------------------------------------------------


def test_c27_store_unavailable_is_503_problem(tmp_path) -> None:
    app = Flask("down", instance_path=str(tmp_path / "inst"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/missing/dir/db.sqlite3"
    Idempotency(app)
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return "paid"

    response = app.test_client().post("/pay", headers=KEY)
    assert_problem(response, 503, "store-unavailable")
    assert int(response.headers["Retry-After"]) >= 1
    assert calls == []
    app.extensions["idempotency"].store.engine.dispose()


def test_c25_fail_open_runs_unprotected_and_says_so(tmp_path) -> None:
    app = Flask("down_open", instance_path=str(tmp_path / "inst"))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/missing/dir/db.sqlite3"
    app.config["IDEMPOTENCY_FAIL_OPEN"] = True
    Idempotency(app)
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return "paid", 201

    @app.post("/unprotected")
    def unprotected():
        return "ok"

    client = app.test_client()
    for _ in range(2):
        response = client.post("/pay", headers=KEY)
        assert response.status_code == 201
        assert response.headers.get("Idempotency-Unprotected") == "store-unavailable"
    assert calls == ["pay", "pay"]
    untouched = client.post("/unprotected", headers=KEY)
    assert "Idempotency-Unprotected" not in untouched.headers
    app.extensions["idempotency"].store.engine.dispose()


def test_c27_problem_type_base_is_configurable(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_PROBLEM_TYPE_BASE": "https://api.example.com/errors"})

    @app.post("/pay")
    @idempotent(required=True)
    def pay():
        return "ok"

    body = assert_problem(app.test_client().post("/pay"), 400, "missing-key")
    assert body["type"] == "https://api.example.com/errors/missing-key"


def test_c27_problems_are_http_exceptions_an_app_can_handle(make_app) -> None:
    app, _ = make_app()

    @app.errorhandler(400)
    def custom(exc: HTTPException):
        return jsonify(custom=exc.code), 400

    @app.post("/pay")
    @idempotent(required=True)
    def pay():
        return "ok"

    @app.errorhandler(422)
    def custom_422(exc: HTTPException):
        return jsonify(custom=exc.code), 422

    client = app.test_client()
    assert client.post("/pay").json == {"custom": 400}
    client.post("/pay", json={"a": 1}, headers=KEY)
    assert client.post("/pay", json={"a": 2}, headers=KEY).json == {"custom": 422}


def test_c27_problems_can_be_handled_by_class(make_app) -> None:
    from flask_idempotency import IdempotencyProblem

    app, _ = make_app()

    @app.errorhandler(IdempotencyProblem)
    def by_class(exc: IdempotencyProblem):
        return jsonify(problem=exc.problem()["code"]), exc.code

    @app.post("/pay")
    @idempotent(required=True)
    def pay():
        return "ok"

    assert app.test_client().post("/pay").json == {"problem": "missing-key"}


# -- wiring: blueprints, factories, route options, signals ---------------------------------------

factory_bp = Blueprint("payments", __name__)
factory_ext = Idempotency()
factory_calls: list[str] = []


@factory_bp.post("/bp/pay")
@idempotent(required=True, wait=0)
def bp_pay():
    factory_calls.append(request.host)
    return jsonify(n=len(factory_calls)), 201


def create_app(tmp_path, name: str) -> Flask:
    app = Flask(name, instance_path=str(tmp_path / name))
    app.config["IDEMPOTENCY_DATABASE_URI"] = f"sqlite:///{tmp_path}/{name}.sqlite3"
    app.register_blueprint(factory_bp)
    factory_ext.init_app(app)
    app.extensions["idempotency"].store.create_table()
    return app


def test_blueprint_and_app_factory_with_decorator_before_init_app(tmp_path) -> None:
    factory_calls.clear()
    apps = [create_app(tmp_path, "one"), create_app(tmp_path, "two")]
    try:
        for app in apps:
            client = app.test_client()
            assert_problem(client.post("/bp/pay", json={}), 400, "missing-key")
            first = client.post("/bp/pay", json={}, headers=KEY)
            again = client.post("/bp/pay", json={}, headers=KEY)
            assert first.status_code == 201 and first.json == {"n": len(factory_calls)}
            assert again.headers.get(REPLAYED) == "true"
        assert len(factory_calls) == 2, "each app has its own store"
        with apps[0].app_context():
            assert factory_ext.store is apps[0].extensions["idempotency"].store
    finally:
        for app in apps:
            app.extensions["idempotency"].store.engine.dispose()


def test_class_based_view_with_decorators(make_app) -> None:
    app, _ = make_app()
    calls: list[str] = []

    class Payments(MethodView):
        decorators = (idempotent(required=True),)

        def post(self):
            calls.append("post")
            return jsonify(n=len(calls)), 201

    app.add_url_rule("/payments", view_func=Payments.as_view("payments"))
    client = app.test_client()
    assert_problem(client.post("/payments"), 400, "missing-key")
    client.post("/payments", headers=KEY)
    assert client.post("/payments", headers=KEY).headers.get(REPLAYED) == "true"
    assert calls == ["post"]


def test_idempotent_on_a_method_view_method_protects_it(make_app) -> None:
    app, _ = make_app()
    calls: list[str] = []

    class Refunds(MethodView):
        @idempotent
        def post(self):
            calls.append("post")
            return jsonify(n=len(calls)), 201

    app.add_url_rule("/refunds", view_func=Refunds.as_view("refunds"))
    client = app.test_client()
    client.post("/refunds", headers=KEY)
    assert client.post("/refunds", headers=KEY).headers.get(REPLAYED) == "true"
    assert calls == ["post"]


def test_route_options_override_config(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_WAIT": 30, "IDEMPOTENCY_REQUIRED": False})
    calls: list[str] = []
    entered, release, _ = blocking_view(app, calls, wait=0, required=True)
    assert_problem(app.test_client().post("/slow", json={}), 400, "missing-key")
    original = Background(app, "/slow", json={}, headers=KEY)
    assert entered.wait(PARK_LIMIT)
    assert_problem(
        app.test_client().post("/slow", json={}, headers=KEY), 409, "request-in-progress"
    )  # wait=0 on the route beats the app's 30 s
    release.set()
    assert original.result().status_code == 201


def test_signals_fire_with_digests_not_keys(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    seen: list[tuple[str, dict]] = []
    for name in (
        "request_executed",
        "request_replayed",
        "key_mismatch",
        "claim_released",
        "response_stored",
    ):
        signal = getattr(signals, name)
        signal.connect(lambda sender, _name=name, **kw: seen.append((_name, kw)), app, weak=False)

    @app.post("/pay")
    @idempotent
    def pay():
        return "ok", 201 if request.json["ok"] else 500

    client = app.test_client()
    client.post("/pay", json={"ok": True}, headers=KEY)
    client.post("/pay", json={"ok": True}, headers=KEY)
    client.post("/pay", json={"ok": False}, headers=KEY)
    client.post("/pay", json={"ok": False}, headers={"Idempotency-Key": "other"})
    names = [name for name, _ in seen]
    assert names == [
        "request_executed",
        "response_stored",
        "request_replayed",
        "key_mismatch",
        "request_executed",
        "claim_released",
    ]
    digest = key_digest("anonymous", "key-1")
    assert seen[0][1]["key_digest"] == digest
    assert seen[2][1]["source"] == "database" and seen[2][1]["status"] == 201
    assert seen[5][1]["reason"] == "server-error"
    for _, extra in seen:
        assert "key-1" not in json.dumps(extra, default=str)
        assert extra["route"] == "pay"
        assert extra["duration"] >= 0
