"""A settlement outlives its process (CONTRACT C59, issue 33 item 5).

A process that ends with kept settlements (gunicorn's ``--max-requests``, a graceful
restart, SIGTERM) writes them to the host's spool at exit; the next process of the
app on the host adopts them before its next claim, renews their leases, lands them
and sends their signals. The cells: the exit hands on (PostgreSQL on both drivers
through a cut proxy, and a real ended process on SQLite and MariaDB), a kept release
and the release of an unanswered claim, ``once()`` work, three processes racing for
one spool adopt each file once, a torn file is set aside with a log line, and the
settlement's deadline is kept on one clock. The real deployment (gunicorn workers
recycled during an outage) is tests/deploy/test_recycled_workers.py.

The fault "the process exits with settlements pending", by write and database:

==========================  ==========  ==========  ==========  =====================
write                       psycopg2    psycopg 3   MariaDB     SQLite
==========================  ==========  ==========  ==========  =====================
complete (a view's)         cut proxy   cut proxy   ended proc  ended proc; killed in
                                                                its flush; try under
                                                                way at hand-over
complete (``once()``)       .           .           .           in process
release (a view's)          cut proxy   cut proxy   .           .
release of a claim that     stalled     stalled     .           .
got no reply (C58)          proxy       proxy
==========================  ==========  ==========  ==========  =====================
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from flask import jsonify
from sqlalchemy import func, select

from flask_idempotency import idempotent, process, signals
from flask_idempotency.completion import deferred, heartbeat, inherit, spool
from flask_idempotency.records import COMPLETED, Claim, Identity, StoredResponse
from flask_idempotency.store import StoreError
from tests import test_deferred
from tests.fault_matrix import test_cut_statements
from tests.fault_matrix.test_cut_statements import Cell, TableLock, _waiting_on
from tests.support.gunicorn import REPO_ROOT
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_until
from tests.test_deferred import CutStore, record
from tests.test_lifecycle import KEY, REPLAYED

cut_store = test_deferred.cut_store
proxied_cell = test_cut_statements.proxied_cell


def _lapsed_pg(db: CutStore) -> bool:
    table = db.store_table
    now_ms = func.floor(func.extract("epoch", func.clock_timestamp()) * 1000)
    with db.direct.connect() as conn:
        return bool(conn.execute(select(table.c.lease_expires_at_ms < now_ms)).scalar_one())


def _process_ended() -> None:
    """What this process still keeps after its exit flush is gone with it: a process
    that ended renews and tries nothing more (the cells run in one process)."""
    renewer = heartbeat.renewer()
    with renewer._cond:
        for lease in list(renewer._leases):
            renewer._wait_idle(lease)
            settlement = lease.settlement
            if settlement is None:
                continue
            renewer._leases.discard(lease)
            renewer.pending -= 1
            renewer.pending_bytes -= settlement.size
            lease.settlement, lease.done = None, True
            process.forget_token(lease.claim.lock_token)


def _spooled(root: Path) -> list[Path]:
    return sorted(root.rglob("*.json"))


@pytest.mark.postgres
def test_c59_an_ended_process_hands_its_kept_completion_on_and_the_next_lands_it(
    cut_store: CutStore, tmp_path: Path
) -> None:
    """The store is down when the process ends, and stays down past the lease: the next
    process adopts the completion, a retry there never runs the view again, and the
    completion lands with its promotion and signals (before: dropped at exit; the retry
    ran the view a second time)."""
    root = tmp_path / "spool"
    config = {"IDEMPOTENCY_LEASE": 1, "IDEMPOTENCY_SPOOL_DIR": str(root)}
    calls: list[int] = []

    def pay() -> Any:
        calls.append(1)
        cut_store.proxy.cut()
        return jsonify(run=len(calls)), 201

    ending = cut_store.app(**config)
    cut_store.store_table = ending.extensions["idempotency"].store.table
    ending.post("/pay")(idempotent(pay))
    following = cut_store.app(**config)  # the next process's app (made while the store is up)
    following.post("/pay")(idempotent(pay))
    assert ending.test_client().post("/pay", json={}, headers=KEY).get_json() == {"run": 1}
    assert deferred.pending() == 1
    left = deferred.flush(timeout=0.3)  # the process ends with the store still down
    _process_ended()
    spooled = _spooled(root)
    wait_until(lambda: _lapsed_pg(cut_store), "the ended owner's lease lapsed", within=10)

    stored = record(following, signals.response_stored)
    landed = record(following, signals.settlement_deferred)
    cut_store.proxy.restore()
    retry = following.test_client().post("/pay", json={}, headers=KEY)
    assert calls == [1], f"the view ran again: {retry.status_code} {retry.get_data()!r}"
    assert left == 0 and len(spooled) == 1, (left, spooled)
    wait_until(lambda: cut_store.states() == [COMPLETED], "the completion landed", within=5)
    wait_until(lambda: stored, "response_stored sent by the next process", within=5)
    assert stored[0]["status"] == 201 and stored[0]["route"] == "pay"
    assert [d["outcome"] for d in landed] == ["landed"]
    replay = following.test_client().post("/pay", json={}, headers=KEY)
    assert replay.headers.get(REPLAYED) == "true" and replay.get_json() == {"run": 1}
    assert _spooled(root) == [] and calls == [1]


_ENDING = textwrap.dedent(
    """
    import sys
    from flask import Flask, jsonify
    from flask_idempotency import Idempotency, idempotent
    from flask_idempotency.completion import deferred
    from flask_idempotency.store import StoreError

    url, table, spool_dir, flush_seconds = sys.argv[1:5]
    app = Flask("ending")
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=url,
        IDEMPOTENCY_TABLE=table,
        IDEMPOTENCY_SPOOL_DIR=spool_dir,
        IDEMPOTENCY_LEASE=1,
        IDEMPOTENCY_WAIT=0,
    )
    Idempotency(app)
    store = app.extensions["idempotency"].store

    def refused(*args, **kwargs):
        raise StoreError("the database is failing over")

    store.complete = refused  # every try of the completion fails until this process ends
    deferred.FLUSH_TIMEOUT = float(flush_seconds)

    @app.post("/pay")
    @idempotent
    def pay():
        return jsonify(run="ended process"), 201

    answer = app.test_client().post("/pay", json={}, headers={"Idempotency-Key": "key-1"})
    print(answer.status_code, deferred.pending(), flush=True)
    """
)


@pytest.mark.parametrize("database", ["sqlite", pytest.param("mariadb", marks=pytest.mark.mysql)])
def test_c59_a_process_that_ends_spools_its_settlement_at_exit(
    database: str,
    make_app: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """A real process ends (``atexit``, as gunicorn's workers do) with a completion the
    store refused: the file is in the spool, and the next process lands it with its
    signals; a retry there never runs the view (SQLite, and MariaDB through PyMySQL)."""
    root = tmp_path / "spool"
    table = f"idem_{uuid.uuid4().hex[:12]}"
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    else:
        url = request.getfixturevalue("mysql_url").render_as_string(hide_password=False)
    following, _ = make_app(
        {
            "IDEMPOTENCY_DATABASE_URI": url,
            "IDEMPOTENCY_TABLE": table,
            "IDEMPOTENCY_SPOOL_DIR": str(root),
            "IDEMPOTENCY_LEASE": 1,
            "IDEMPOTENCY_WAIT": 0,
        }
    )
    store = following.extensions["idempotency"].store
    try:
        ended = subprocess.run(
            [sys.executable, "-c", _ENDING, url, table, str(root), "0.3"],
            cwd=REPO_ROOT,
            env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ended.returncode == 0, ended.stderr
        assert ended.stdout.split() == ["201", "1"], ended.stdout
        calls: list[int] = []

        @following.post("/pay")
        @idempotent
        def pay() -> Any:
            calls.append(1)
            return jsonify(run="next process"), 201

        stored = record(following, signals.response_stored)
        with store.engine.connect() as conn:
            expiry = conn.execute(select(store.table.c.lease_expires_at_ms)).scalar_one()
        time.sleep(max(0.0, expiry / 1000 - time.time()) + 0.05)  # its lease lapsed meanwhile
        client = following.test_client()
        with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
            retry = client.post("/pay", json={}, headers=KEY)
        assert calls == [], f"the view ran again: {retry.status_code} {retry.get_data()!r}"
        assert "written to the host's spool" in ended.stderr, ended.stderr
        wait_until(lambda: stored, "response_stored sent by the next process", within=5)
        assert "adopted 1 settlement(s)" in caplog.text
        replay = client.post("/pay", json={}, headers=KEY)
        assert replay.get_json() == {"run": "ended process"} and replay.headers.get(REPLAYED)
        assert _spooled(root) == [] and calls == []
    finally:
        if database == "mariadb":
            for t in (store.table, store.identity_table):
                t.drop(store.engine, checkfirst=True)


def test_c59_a_process_killed_during_its_exit_flush_still_hands_on(
    make_app: Any, tmp_path: Path
) -> None:
    """The exit flush waits up to 10 s; a supervisor may not (gunicorn's graceful
    timeout, Kubernetes' grace period: SIGKILL). The settlement is in the spool before
    the wait begins, as this process's while it lives, and the next process adopts it
    once it is gone (before: written only after the wait, so the kill dropped it)."""
    root = tmp_path / "spool"
    url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    table = "idempotency_keys"
    following, _ = make_app(
        {"IDEMPOTENCY_DATABASE_URI": url, "IDEMPOTENCY_SPOOL_DIR": str(root), "IDEMPOTENCY_WAIT": 0}
    )
    ending = subprocess.Popen(
        [sys.executable, "-c", _ENDING, url, table, str(root), "60"],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert ending.stdout is not None
        assert ending.stdout.readline().split() == ["201", "1"]
        wait_until(lambda: list(root.rglob("*.leaving-*")), "the file, before the wait")
        state = following.extensions["idempotency"]
        assert inherit.pick_up(state, following) == 0  # not while its process lives
    finally:
        ending.kill()  # in the middle of its exit flush
        ending.communicate(timeout=10)  # (closes its pipes)
    calls: list[int] = []

    @following.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        return jsonify(run="next process"), 201

    stored = record(following, signals.response_stored)
    inherit._next_scan.clear()  # look again now, not in a second
    retry = following.test_client().post("/pay", json={}, headers=KEY)
    assert retry.status_code == 409, retry.get_data()  # kept here now: no takeover
    wait_until(lambda: stored, "the handed-on completion landed", within=5)
    replay = following.test_client().post("/pay", json={}, headers=KEY)
    assert replay.get_json() == {"run": "ended process"}
    assert calls == [] and _spooled(root) == [] and not list(root.rglob("*.leaving-*"))


def _handover(n: int) -> spool.Handover:
    ident = Identity("anonymous", f"{n:064x}", "f" * 64, "POST", "/pay")
    return spool.Handover(
        "complete",
        Claim(n, f"token-{n}", 0, "new"),
        ident,
        1.0,
        "pay",
        give_up_at=time.time() + 60,
        response=StoredResponse(201, (("Content-Type", "application/json"),), b"{}"),
    )


_TAKER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from flask_idempotency.completion import spool

    where = Path(sys.argv[1])
    while not (where / "go").exists():
        time.sleep(0.001)
    for handover, claimed in spool.take(where):
        print(handover.claim.lock_token, flush=True)
        spool.remove(claimed)
    """
)


def test_c59_two_processes_racing_for_one_spool_take_each_settlement_once(
    tmp_path: Path,
) -> None:
    """Every file is claimed by a rename, which one of two racing processes wins."""
    where = spool.directory(tmp_path / "spool", "store")
    for n in range(200):
        spool.write(where, _handover(n))
    takers = [
        subprocess.Popen(
            [sys.executable, "-c", _TAKER, str(where)],
            cwd=REPO_ROOT,
            env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    time.sleep(0.5)  # all three started and waiting
    (where / "go").touch()
    taken = [taker.communicate(timeout=60)[0].split() for taker in takers]
    everything = [token for tokens in taken for token in tokens]
    assert sorted(everything) == sorted(f"token-{n}" for n in range(200))
    assert len(set(everything)) == len(everything) == 200
    assert not list(where.glob("*.json"))


def test_c59_a_torn_spool_file_is_set_aside_with_a_log_line(
    make_app: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that does not read back whole is never applied; the whole one beside it is."""
    root = tmp_path / "spool"
    app, _ = make_app({"IDEMPOTENCY_SPOOL_DIR": str(root)})
    state = app.extensions["idempotency"]
    where = deferred.spool_path(state)
    assert where is not None
    where = spool.directory(where.parent, where.name)
    whole = spool.write(where, _handover(1))
    torn = spool.write(where, _handover(2))
    torn.write_bytes(torn.read_bytes()[:-40])  # a copy cut short
    with caplog.at_level(logging.ERROR, logger="flask_idempotency"):
        adopted = inherit.pick_up(state, app)
    assert adopted == 1
    assert "is not whole" in caplog.text and "set aside" in caplog.text
    assert sorted(p.suffix for p in where.iterdir()) == [".torn"]
    assert not whole.exists()
    # The adopted one (its record does not exist here) is fenced: it changes nothing.
    wait_until(lambda: deferred.pending() == 0, "the adopted settlement settled", within=5)


def test_c59_a_settlement_deadline_is_on_the_monotonic_clock(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's start is taken on ``time.perf_counter()``; the renewer compares
    deadlines with ``time.monotonic()``. Where the two clocks differ (the platform may
    run them apart), a deadline mixing them gives a kept completion up at once (before:
    ``gave-up`` on its first retry), or never."""
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() - 10_000.0)
    app, _ = make_app({"IDEMPOTENCY_MAX_RUNTIME": 60})
    store = app.extensions["idempotency"].store
    complete = store.complete
    refusals = [StoreError("failing over"), StoreError("failing over")]

    def refused_twice(*args: Any, **kwargs: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return complete(*args, **kwargs)

    monkeypatch.setattr(store, "complete", refused_twice)
    outcomes = record(app, signals.settlement_deferred)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(ok=True), 201

    assert app.test_client().post("/pay", json={}, headers=KEY).status_code == 201
    wait_until(lambda: deferred.pending() == 0, "the kept completion settled", within=10)
    assert [o["outcome"] for o in outcomes] == ["deferred", "landed"]


def test_c59_spooling_can_be_turned_off(make_app: Any) -> None:
    app, _ = make_app({"IDEMPOTENCY_SPOOL_DIR": False})
    assert deferred.spool_path(app.extensions["idempotency"]) is None
    with pytest.raises(ValueError, match="IDEMPOTENCY_SPOOL_DIR"):
        make_app({"IDEMPOTENCY_SPOOL_DIR": 3})
    memory, _ = make_app({"IDEMPOTENCY_DATABASE_URI": "sqlite://"})
    assert deferred.spool_path(memory.extensions["idempotency"]) is None


def test_c59_a_spool_others_may_write_to_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with pytest.raises(PermissionError, match="others may write"):
        spool.directory(root, "store")


@pytest.mark.postgres
def test_c59_an_ended_process_hands_its_kept_release_on_and_the_next_lands_it(
    cut_store: CutStore, tmp_path: Path
) -> None:
    """A view that answered 503 (its key to be given back) while the database went away:
    the next process deletes the record and sends ``claim_released`` (before: dropped at
    exit, no signal, the key held until its lease lapsed)."""
    root = tmp_path / "spool"
    config = {"IDEMPOTENCY_LEASE": 30, "IDEMPOTENCY_SPOOL_DIR": str(root)}

    def pay() -> Any:
        cut_store.proxy.cut()
        return jsonify(error="try later"), 503

    ending = cut_store.app(**config)
    cut_store.store_table = ending.extensions["idempotency"].store.table
    ending.post("/pay")(idempotent(pay))
    following = cut_store.app(**config)
    following.get("/other")(lambda: "ok")
    assert ending.test_client().post("/pay", json={}, headers=KEY).status_code == 503
    assert deferred.pending() == 1
    deferred.flush(timeout=0.3)
    _process_ended()
    released = record(following, signals.claim_released)
    cut_store.proxy.restore()
    assert inherit.pick_up(following.extensions["idempotency"], following) == 1
    wait_until(lambda: cut_store.states() == [], "the release landed", within=5)
    wait_until(lambda: released, "claim_released sent by the next process", within=5)
    assert released[0]["reason"] == "server-error" and released[0]["status"] == 503


def test_c59_a_once_completion_is_handed_on_too(
    make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``once()`` work whose completion the store refused, its process ended: the next
    process's ``once()`` adopts it before its claim, so the work is not done twice."""
    database = tmp_path / "jobs.sqlite3"
    config = {
        "IDEMPOTENCY_DATABASE_URI": f"sqlite:///{database}",
        "IDEMPOTENCY_SPOOL_DIR": str(tmp_path / "spool"),
        "IDEMPOTENCY_LEASE": 1,
        "IDEMPOTENCY_WAIT": 0,
    }
    ending, ending_ext = make_app(config)
    following, following_ext = make_app(config)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise StoreError("the database is failing over")

    monkeypatch.setattr(ending.extensions["idempotency"].store, "complete", refused)
    runs: list[str] = []
    with ending.app_context(), ending_ext.once("mail:1") as run:
        assert run.owned
        runs.append("ended")
        run.result = {"sent": "by the ended process"}
    assert deferred.pending() == 1
    deferred.flush(timeout=0.3)
    _process_ended()
    time.sleep(1.1)  # its lease lapsed meanwhile
    stored = record(following, signals.response_stored)
    with following.app_context():
        try:
            with following_ext.once("mail:1") as again:
                if again.owned:
                    runs.append("again")
                    again.result = {"sent": "twice"}
        except Exception as exc:  # JobInProgress while the adopted completion lands
            assert type(exc).__name__ == "JobInProgress", exc
        wait_until(lambda: stored, "the adopted completion landed", within=5)
        with following_ext.once("mail:1") as replay:
            assert not replay.owned and replay.result == {"sent": "by the ended process"}
    assert runs == ["ended"]
    assert stored[0]["route"] == "once:once"  # a job named by its default name


@pytest.mark.postgres
def test_c59_the_kept_release_of_an_unanswered_claim_is_handed_on(
    proxied_cell: tuple[Cell, TcpProxy], tmp_path: Path
) -> None:
    """C58's kept release (a claim that got no reply, committed later under a token
    nobody holds) outlives its process: the next one deletes the record, and a retry
    runs the view within moments instead of getting 409 for a lease (before: dropped at
    exit; 409 until the 20 s lease lapsed, with psycopg2, whose cut claim commits)."""
    cell, proxy = proxied_cell
    config = {
        "IDEMPOTENCY_WAIT": 0,
        "IDEMPOTENCY_LEASE": 20,
        "IDEMPOTENCY_SPOOL_DIR": str(tmp_path / "spool"),
    }
    calls: list[int] = []

    def pay() -> Any:
        calls.append(1)
        return jsonify(n=len(calls)), 201

    ending, following = cell.make(config), cell.make(config)
    ending.post("/pay")(idempotent(pay))
    following.post("/pay")(idempotent(pay))
    table = ending.extensions["idempotency"].store.table.name
    lock = TableLock(cell, table)
    lock.start()
    assert lock.locked.wait(10) and lock.error is None, lock.error
    answers: list[Any] = []
    request = threading.Thread(
        target=lambda: answers.append(ending.test_client().post("/pay", json={"a": 1}, headers=KEY))
    )
    request.start()
    wait_until(lambda: _waiting_on(cell.direct, table), "the claim queued on the lock")
    proxy.stall()  # the network goes silent: the claim and its cancel get no reply
    request.join(30)
    assert answers and answers[0].status_code == 503, answers
    assert deferred.pending() == 1
    deferred.flush(timeout=0.3)  # the process ends while the network is silent
    _process_ended()
    lock.release.set()  # the queued claim commits now, on the server (psycopg2)
    lock.join(10)
    proxy.restore()
    client = following.test_client()
    statuses: list[int] = []

    def runs() -> bool:
        statuses.append(client.post("/pay", json={"a": 1}, headers=KEY).status_code)
        return statuses[-1] == 201

    wait_until(runs, "a retry on the next process runs the view", within=8)
    assert calls == [1], statuses


def test_c59_a_try_under_way_when_the_process_hands_on_is_finished_here_once(
    make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit flush hands a settlement on while its try is still on the wire, and
    that try lands: what follows it runs here, once, its spool file is withdrawn, and
    the process's counts stay true (no settlement counted twice out)."""
    root = tmp_path / "spool"
    app, _ = make_app({"IDEMPOTENCY_SPOOL_DIR": str(root)})
    store = app.extensions["idempotency"].store
    complete = store.complete
    tries: list[int] = []
    under_way, go_on = threading.Event(), threading.Event()

    def slow_second_try(*args: Any, **kwargs: Any) -> Any:
        tries.append(1)
        if len(tries) == 1:
            raise StoreError("failing over")
        under_way.set()
        go_on.wait(10)
        return complete(*args, **kwargs)

    monkeypatch.setattr(store, "complete", slow_second_try)
    stored = record(app, signals.response_stored)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(ok=True), 201

    assert app.test_client().post("/pay", json={}, headers=KEY).status_code == 201
    assert under_way.wait(10)
    assert deferred.flush(timeout=0.2) == 0  # handed on while the try is on the wire
    assert len(_spooled(root)) == 1
    go_on.set()
    wait_until(lambda: stored, "what follows the landed try ran here", within=5)
    renewer = heartbeat.renewer()
    wait_until(lambda: renewer.finishing == 0, "its callbacks finished", within=5)
    assert (renewer.pending, renewer.pending_bytes, len(stored)) == (0, 0, 1)
    assert _spooled(root) == []  # withdrawn: no other process tries it
