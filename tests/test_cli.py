"""``flask idempotency …``: prune, stats, show, forget, check, create-table (C28, C30).

Run through ``app.test_cli_runner()`` and as the real ``flask`` executable, against
the session's private PostgreSQL database; the plain batched delete of SQLite
gets one test of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, jsonify, request
from sqlalchemy import func, insert, select, text

from flask_idempotency import Idempotency, cli, idempotent
from flask_idempotency.fingerprint import key_digest
from flask_idempotency.store.clock import db_now_ms
from flask_idempotency.store.maintenance import Maintenance

from .support.gunicorn import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
FLASK = Path(sys.executable).with_name("flask")
ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
DELETED = re.compile(
    r"Deleted (\d+) expired records?(?: in (\d+) batch(?:es)?|: there were none)\."
)

pytestmark = pytest.mark.timeout(120)


# -- helpers ---------------------------------------------------------------------------


def store_of(app: Flask) -> Any:
    return app.extensions["idempotency"].store


def add_record(
    app: Flask,
    *,
    state: str,
    expires_in_ms: int,
    lease_in_ms: int | None = None,
    status: int | None = None,
    body: bytes | None = None,
) -> str:
    """Insert one record with times relative to the database clock; return its digest."""
    store = store_of(app)
    digest = uuid.uuid4().hex * 2
    now = db_now_ms()
    completed = state == "completed"
    values: dict[str, Any] = {
        "key_digest": digest,
        "scope": "anonymous",
        "fingerprint": "f" * 64,
        "method": "POST",
        "path": "/pay",
        "state": state,
        "lock_token": None if completed else uuid.uuid4().hex,
        "created_at_ms": now - 1000,
        "expires_at_ms": now + expires_in_ms,
        "lease_expires_at_ms": None if lease_in_ms is None else now + lease_in_ms,
        "completed_at_ms": now - 500 if completed else None,
        "response_status": status if status is not None else (201 if completed else None),
        "response_headers": "[]" if completed else None,
        "response_body": body if body is not None else (b"{}" if completed else None),
    }
    with store.autocommit.connect() as conn:
        conn.execute(insert(store.table).values(**values))
    return digest


def digests(app: Flask) -> set[str]:
    store = store_of(app)
    with store.autocommit.connect() as conn:
        return set(conn.execute(select(store.table.c.key_digest)).scalars())


def row_count(app: Flask) -> int:
    store = store_of(app)
    with store.autocommit.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(store.table)).scalar_one())


def add_expired_rows(app: Flask, count: int) -> None:
    """``count`` expired completed records in one statement (PostgreSQL)."""
    store = store_of(app)
    table = store.table.name
    with store.autocommit.connect() as conn:
        conn.execute(
            text(
                f"""
                INSERT INTO "{table}" (key_digest, scope, fingerprint, method, path, state,
                                       created_at_ms, expires_at_ms, completed_at_ms,
                                       response_status, response_headers, response_body)
                SELECT lpad(g::text, 64, '0'), 'anonymous', repeat('f', 64), 'POST', '/pay',
                       'completed', now_ms - 100000, now_ms - 1000 - g, now_ms - 99000,
                       201, '[]', '\\x7b7d'::bytea
                  FROM generate_series(1, :count) AS g,
                       (SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)
                          AS now_ms) AS clock
                """
            ),
            {"count": count},
        )


def mixed_table(app: Flask) -> dict[str, str]:
    """One record of each kind prune must tell apart."""
    hour = 3_600_000
    return {
        "expired_completed": add_record(app, state="completed", expires_in_ms=-hour),
        "live_completed": add_record(app, state="completed", expires_in_ms=hour),
        # Past its expiry but its owner is still running: must survive (C21, C28).
        "expired_live_lease": add_record(
            app, state="in_progress", expires_in_ms=-hour, lease_in_ms=hour
        ),
        "expired_lapsed_lease": add_record(
            app, state="in_progress", expires_in_ms=-hour, lease_in_ms=-hour
        ),
        "live_lapsed_lease": add_record(
            app, state="in_progress", expires_in_ms=hour, lease_in_ms=-1000
        ),
    }


def run_flask(
    url: str, table: str, *args: str, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """The real ``flask`` executable, as an operator or a cron job runs it."""
    return subprocess.run(
        [str(FLASK), "--app", "tests.cli_app:create_app", "idempotency", *args],
        cwd=REPO_ROOT,
        env=_flask_env(url, table),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _flask_env(url: str, table: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(IDEMPOTENCY_DATABASE_URI=url, IDEMPOTENCY_TABLE=table, PYTHONPATH=str(REPO_ROOT))
    env.pop("FLASK_APP", None)
    return env


@pytest.fixture
def pg_app(make_pg_app: Any) -> Flask:
    app, _ = make_pg_app()
    return app


@pytest.fixture
def pg_uri(pg_url: Any) -> str:
    return str(pg_url.render_as_string(hide_password=False))


# -- prune -----------------------------------------------------------------------------


def test_c28_prune_deletes_expired_and_spares_live_leases_pg(pg_app: Flask) -> None:
    records = mixed_table(pg_app)
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "prune"])
    assert result.exit_code == 0, result.output
    assert DELETED.search(result.output).group(1) == "2"  # type: ignore[union-attr]
    assert digests(pg_app) == {
        records["live_completed"],
        records["expired_live_lease"],
        records["live_lapsed_lease"],
    }


def test_c28_prune_on_sqlite_uses_the_plain_batched_delete(make_app: Any) -> None:
    app, _ = make_app()
    records = mixed_table(app)
    for _ in range(5):
        add_record(app, state="completed", expires_in_ms=-60_000)
    result = app.test_cli_runner().invoke(args=["idempotency", "prune", "--batch-size", "2"])
    assert result.exit_code == 0, result.output
    match = DELETED.search(result.output)
    assert match is not None and match.groups() == ("7", "4"), result.output
    assert records["expired_live_lease"] in digests(app)
    assert records["expired_completed"] not in digests(app)


def test_c28_prune_says_how_many_in_plain_words(make_app: Any) -> None:
    """Issue 35: it said "Deleted 0 expired records in 1 batches." """
    app, _ = make_app()
    runner = app.test_cli_runner()
    add_record(app, state="completed", expires_in_ms=60_000)  # live: not due
    nothing = runner.invoke(args=["idempotency", "prune"])
    assert nothing.output.strip() == "Deleted 0 expired records: there were none."
    add_record(app, state="completed", expires_in_ms=-60_000)
    one = runner.invoke(args=["idempotency", "prune"])
    assert one.output.strip() == "Deleted 1 expired record in 1 batch."
    for _ in range(3):
        add_record(app, state="completed", expires_in_ms=-60_000)
    three = runner.invoke(args=["idempotency", "prune", "--batch-size", "2"])
    assert three.output.strip() == "Deleted 3 expired records in 2 batches."


def test_c28_prune_dry_run_counts_and_deletes_nothing(pg_app: Flask) -> None:
    mixed_table(pg_app)
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "prune", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "2 expired records would be deleted" in result.output
    assert row_count(pg_app) == 5


def test_c28_prune_works_in_bounded_batches(pg_app: Flask) -> None:
    add_expired_rows(pg_app, 2500)
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "prune", "--batch-size", "1000"])
    assert result.exit_code == 0, result.output
    match = DELETED.search(result.output)
    assert match is not None and match.groups() == ("2500", "3"), result.output
    assert row_count(pg_app) == 0


def test_c28_prune_max_seconds_stops_between_batches(pg_app: Flask) -> None:
    add_expired_rows(pg_app, 50)
    # A budget far smaller than one batch: exactly one batch runs, then it stops.
    result = pg_app.test_cli_runner().invoke(
        args=["idempotency", "prune", "--batch-size", "10", "--max-seconds", "0.000001"]
    )
    assert result.exit_code == 0, result.output
    match = DELETED.search(result.output)
    assert match is not None and match.groups() == ("10", "1"), result.output
    assert "40 expired records remain" in result.output
    assert row_count(pg_app) == 40


def test_c28_prune_reports_progress_in_a_log(
    pg_app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flask_idempotency import cli

    monkeypatch.setattr(cli, "_PROGRESS_EVERY_SECONDS", 0.0)  # a line after every batch
    add_expired_rows(pg_app, 2500)
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "prune", "--batch-size", "1000"])
    assert result.exit_code == 0, result.output
    assert "pruned 1000 of about 2500 expired records" in result.stderr
    assert "pruned 2000 of about 2500 expired records" in result.stderr
    assert "Deleted 2500" in result.stdout and "pruned" not in result.stdout


def test_c28_prune_failing_midway_says_what_it_did_and_exits_1(pg_app: Flask) -> None:
    """A real failure in the second batch: a trigger refuses to delete one row."""
    add_expired_rows(pg_app, 1500)
    table = store_of(pg_app).table.name
    row_in_second_batch = "lpad('300', 64, '0')"  # oldest first: g=1500 … g=300 is the 1201st
    _alter(
        pg_app,
        f"""
        CREATE FUNCTION "{table}_refuse"() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF OLD.key_digest = {row_in_second_batch} THEN
                RAISE EXCEPTION 'refusing to delete this row';
            END IF;
            RETURN OLD;
        END $$;
        CREATE TRIGGER refuse BEFORE DELETE ON {{table}}
            FOR EACH ROW EXECUTE FUNCTION "{table}_refuse"();
        """,
    )
    try:
        result = pg_app.test_cli_runner().invoke(
            args=["idempotency", "prune", "--batch-size", "1000"]
        )
    finally:
        _alter(pg_app, f'DROP TRIGGER refuse ON {{table}}; DROP FUNCTION "{table}_refuse"()')
    assert result.exit_code == 1, result.output
    assert "Deleted 1000 expired records before the error." in result.stderr
    assert "Error: database error: " in result.stderr
    assert "refusing to delete this row" in result.stderr
    assert "Traceback" not in result.output
    assert row_count(pg_app) == 500  # the failed batch rolled back whole


def test_c28_prune_rejects_bad_arguments(pg_app: Flask) -> None:
    runner = pg_app.test_cli_runner()
    for args in (["--batch-size", "0"], ["--batch-size", "many"], ["--max-seconds", "0"]):
        result = runner.invoke(args=["idempotency", "prune", *args])
        assert result.exit_code == 2, (args, result.output)
        assert "Invalid value" in result.output


def test_c28_prune_as_a_real_subprocess(pg_app: Flask, pg_uri: str, pg_table: str) -> None:
    records = mixed_table(pg_app)
    add_expired_rows(pg_app, 3000)
    done = run_flask(pg_uri, pg_table, "prune", "--batch-size", "500")
    assert done.returncode == 0, done.stderr
    assert DELETED.search(done.stdout).groups() == ("3002", "7"), done.stdout  # type: ignore[union-attr]
    assert "Traceback" not in done.stderr
    assert records["expired_live_lease"] in digests(pg_app)
    assert row_count(pg_app) == 3


def test_c28_prune_skips_rows_another_transaction_holds(
    pg_app: Flask, pg_uri: str, pg_table: str
) -> None:
    """A prune never queues behind a locked row: it leaves it for the next run (SKIP LOCKED)."""
    add_expired_rows(pg_app, 300)
    store = store_of(pg_app)
    t = store.table
    with store.engine.connect() as holder, holder.begin():
        held = (
            holder.execute(select(t.c.id).order_by(t.c.expires_at_ms).limit(50).with_for_update())
            .scalars()
            .all()
        )
        assert len(held) == 50
        # A prune that waited for the lock would hit the subprocess timeout.
        done = run_flask(pg_uri, pg_table, "prune", "--batch-size", "100", timeout=60)
        assert done.returncode == 0, done.stderr
        assert DELETED.search(done.stdout).group(1) == "250", done.stdout  # type: ignore[union-attr]
    assert row_count(pg_app) == 50
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "prune"])
    assert DELETED.search(result.output).group(1) == "50", result.output  # type: ignore[union-attr]
    assert row_count(pg_app) == 0


def test_c28_prune_batches_resume_where_the_last_one_ended(pg_app: Flask) -> None:
    """Each batch starts its index scan at the previous batch's last expiry, not at the head."""
    add_expired_rows(pg_app, 30)  # expiries: now - 1000 - g, so g=30 is the oldest
    maintenance = Maintenance(store_of(pg_app))
    first = maintenance.prune_batch(10)
    assert first.deleted == 10 and first.last_expiry is not None
    # Rows older than the cursor are left for the next run, even if prunable.
    older = add_record(pg_app, state="completed", expires_in_ms=-10_000_000)
    second = maintenance.prune_batch(100, from_expiry=first.last_expiry)
    assert second.deleted == 20 and second.last_expiry > first.last_expiry  # type: ignore[operator]
    assert digests(pg_app) == {older}
    assert maintenance.prune_batch(100).deleted == 1


def test_c28_concurrent_prunes_delete_each_row_once_threads(pg_app: Flask) -> None:
    total = 20_000
    add_expired_rows(pg_app, total)
    maintenance = Maintenance(store_of(pg_app))
    start = threading.Barrier(4)
    counts: list[int] = []
    errors: list[BaseException] = []

    def prune() -> None:
        deleted = 0
        try:
            start.wait()
            resume_at = None
            while (batch := maintenance.prune_batch(250, from_expiry=resume_at)).deleted > 0:
                deleted += batch.deleted
                resume_at = batch.last_expiry
        except BaseException as exc:
            errors.append(exc)
        counts.append(deleted)

    threads = [threading.Thread(target=prune) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(counts) == total, counts
    assert row_count(pg_app) == 0


def test_c28_two_prune_processes_at_once(pg_app: Flask, pg_uri: str, pg_table: str) -> None:
    total = 40_000
    add_expired_rows(pg_app, total)
    env = _flask_env(pg_uri, pg_table)
    command = [
        str(FLASK),
        "--app",
        "tests.cli_app:create_app",
        "idempotency",
        "prune",
        "--batch-size",
        "200",
        "--pause",
        "0.005",
    ]
    processes = [
        subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=100)
            outputs.append((process.returncode, stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for returncode, _stdout, stderr in outputs:
        assert returncode == 0, stderr
        assert "Traceback" not in stderr
    reported = [int(DELETED.search(stdout).group(1)) for _, stdout, _ in outputs]  # type: ignore[union-attr]
    assert sum(reported) == total, reported
    assert row_count(pg_app) == 0


# -- a store that is down -----------------------------------------------------------------


@pytest.mark.parametrize(
    "command", [["prune"], ["stats"], ["check"], ["show", "k"], ["forget", "k", "--yes"]]
)
def test_c28_database_down_is_one_line_and_exit_1(command: list[str]) -> None:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URI"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    )
    Idempotency(app)
    result = app.test_cli_runner().invoke(args=["idempotency", *command])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: database unavailable: "), result.output
    assert isinstance(result.exception, SystemExit)


def test_c28_database_down_in_a_real_subprocess(pg_table: str) -> None:
    dead = f"postgresql+psycopg2://postgres@127.0.0.1:{free_port()}/nowhere"
    done = run_flask(dead, pg_table, "prune")
    assert done.returncode == 1
    assert done.stderr.startswith("Error: database unavailable: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


# -- stats -----------------------------------------------------------------------------


def test_c28_stats_counts_records_by_state(pg_app: Flask) -> None:
    mixed_table(pg_app)
    runner = pg_app.test_cli_runner()
    result = runner.invoke(args=["idempotency", "stats", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert (stats["total"], stats["completed"], stats["in_progress"]) == (5, 2, 3)
    assert stats["stale_leases"] == 2
    assert stats["prunable"] == 2
    assert stats["oldest_in_progress_created_ms"] < stats["now_ms"]
    text_result = runner.invoke(args=["idempotency", "stats"])
    assert text_result.exit_code == 0
    assert re.search(r"expired, awaiting prune\s+2", text_result.output)
    assert re.search(r"with a lapsed lease\s+2", text_result.output)
    assert ISO_UTC.search(text_result.output)


# -- show / forget -----------------------------------------------------------------------


@pytest.fixture
def payments_app(make_pg_app: Any) -> tuple[Flask, list[int]]:
    """A protected view whose scope is the ``X-Tenant`` header, and a count of its runs."""
    app, ext = make_pg_app({"SECRET_KEY": "cli-tests"})
    calls: list[int] = []

    @ext.scope_loader
    def tenant() -> str | None:
        return request.headers.get("X-Tenant")

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        return jsonify(receipt="secret-receipt-42", n=len(calls)), 201

    return app, calls


def test_c28_show_names_the_record_by_key_and_scope(payments_app: tuple[Flask, list[int]]) -> None:
    app, _ = payments_app
    client = app.test_client()
    first = client.post(
        "/pay", json={"a": 1}, headers={"Idempotency-Key": "order-1", "X-Tenant": "acme"}
    )
    assert first.status_code == 201
    runner = app.test_cli_runner()

    shown = runner.invoke(args=["idempotency", "show", "order-1", "--scope", "acme"])
    assert shown.exit_code == 0, shown.output
    assert re.search(r"state\s+completed", shown.output)
    assert re.search(r"status\s+201", shown.output)
    assert re.search(rf"body\s+{len(first.data)} bytes", shown.output)
    assert len(ISO_UTC.findall(shown.output)) >= 3  # created, expires, completed
    assert "secret-receipt-42" not in shown.output  # the body only on request
    assert key_digest("scope:acme", "order-1") in shown.output

    with_body = runner.invoke(args=["idempotency", "show", "order-1", "--scope", "acme", "--body"])
    assert with_body.exit_code == 0
    assert "secret-receipt-42" in with_body.output

    # The header's structured-field form names the same key (C2).
    quoted = runner.invoke(args=["idempotency", "show", '"order-1"', "--scope", "acme"])
    assert quoted.exit_code == 0

    other_scope = runner.invoke(args=["idempotency", "show", "order-1", "--scope", "globex"])
    assert other_scope.exit_code == 1
    assert "no record for that key in scope 'globex'" in other_scope.output

    prefix = key_digest("scope:acme", "order-1")[:16]
    by_digest = runner.invoke(args=["idempotency", "show", prefix, "--digest"])
    assert by_digest.exit_code == 0 and "scope:acme" in by_digest.output


def test_c28_show_default_scopes(payments_app: tuple[Flask, list[int]]) -> None:
    app, _ = payments_app
    client = app.test_client()
    client.post("/pay", json={"a": 2}, headers={"Idempotency-Key": "anon-1"})
    client.post(
        "/pay", json={"a": 3}, headers={"Idempotency-Key": "auth-1", "Authorization": "Bearer t0k"}
    )
    runner = app.test_cli_runner()
    assert runner.invoke(args=["idempotency", "show", "anon-1"]).exit_code == 0
    assert runner.invoke(args=["idempotency", "show", "auth-1"]).exit_code == 1
    shown = runner.invoke(args=["idempotency", "show", "auth-1", "--authorization", "Bearer t0k"])
    assert shown.exit_code == 0, shown.output
    assert "scope          auth-hmac:" in shown.output
    assert "t0k" not in shown.output


def test_i26_5_c30_show_reads_the_authorization_header_off_the_command_line(
    payments_app: tuple[Flask, list[int]],
) -> None:
    """``--authorization -`` reads the header from stdin (or a hidden prompt), so the
    credential stays out of the shell's history and the process list."""
    app, _ = payments_app
    app.test_client().post(
        "/pay", json={"a": 3}, headers={"Idempotency-Key": "auth-2", "Authorization": "Bearer s3"}
    )
    runner = app.test_cli_runner()
    shown = runner.invoke(
        args=["idempotency", "show", "auth-2", "--authorization", "-"], input="Bearer s3\n"
    )
    assert shown.exit_code == 0, shown.output
    assert "scope          auth-hmac:" in shown.output and "Bearer s3" not in shown.output
    empty = runner.invoke(args=["idempotency", "show", "auth-2", "--authorization", "-"], input="")
    assert empty.exit_code == 2


def test_c63_show_without_a_scope_secret_uses_the_stores_own(make_app: Any) -> None:
    """C63: with no secret configured, the Authorization scope is keyed by the store's
    own secret, which ``show`` reads from the store as a request does: it names the
    record, and prints neither the header nor the secret."""
    app, _ = make_app()

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return {"ok": True}, 201

    headers = {"Idempotency-Key": "k", "Authorization": "Bearer x"}
    assert app.test_client().post("/pay", json={}, headers=headers).status_code == 201
    result = app.test_cli_runner().invoke(
        args=["idempotency", "show", "k", "--authorization", "Bearer x"]
    )
    assert result.exit_code == 0, result.output
    assert "scope          auth-hmac:" in result.output and "Bearer x" not in result.output
    secret = app.extensions["idempotency"].store.identity().secret.decode()
    assert secret not in result.output


def test_c28_show_and_forget_reject_bad_arguments(payments_app: tuple[Flask, list[int]]) -> None:
    app, _ = payments_app
    runner = app.test_cli_runner()
    for args in (
        ["show", "a,b"],
        ["show", "k", "--scope", "x", "--authorization", "y"],
        ["show", "zz", "--digest"],
        ["forget", ""],
    ):
        result = runner.invoke(args=["idempotency", *args])
        assert result.exit_code == 2, (args, result.output)


def test_c28_show_in_progress_record_has_its_lease(pg_app: Flask) -> None:
    digest = add_record(pg_app, state="in_progress", expires_in_ms=60_000, lease_in_ms=30_000)
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "show", digest, "--digest"])
    assert result.exit_code == 0, result.output
    assert re.search(r"state\s+in_progress", result.output)
    assert re.search(r"lease until\s+\S+Z \(in ", result.output)
    assert "status" not in result.output


def test_c28_forget_asks_first_then_the_key_runs_again(
    payments_app: tuple[Flask, list[int]],
) -> None:
    app, calls = payments_app
    client = app.test_client()
    headers = {"Idempotency-Key": "order-9", "X-Tenant": "acme"}
    client.post("/pay", json={"a": 1}, headers=headers)
    replay = client.post("/pay", json={"a": 1}, headers=headers)
    assert replay.headers.get("Idempotent-Replayed") == "true" and len(calls) == 1
    runner = app.test_cli_runner()

    declined = runner.invoke(
        args=["idempotency", "forget", "order-9", "--scope", "acme"], input="n\n"
    )
    assert declined.exit_code == 1 and "Aborted" in declined.output
    assert key_digest("scope:acme", "order-9") in digests(app)

    confirmed = runner.invoke(
        args=["idempotency", "forget", "order-9", "--scope", "acme"], input="y\n"
    )
    assert confirmed.exit_code == 0, confirmed.output
    assert "Forgot the record" in confirmed.output
    assert key_digest("scope:acme", "order-9") not in digests(app)

    again = client.post("/pay", json={"a": 1}, headers=headers)
    assert again.status_code == 201 and "Idempotent-Replayed" not in again.headers
    assert len(calls) == 2

    skipped = runner.invoke(args=["idempotency", "forget", "order-9", "--scope", "acme", "--yes"])
    assert skipped.exit_code == 0 and "Forgot the record" in skipped.output
    missing = runner.invoke(args=["idempotency", "forget", "order-9", "--scope", "acme", "--yes"])
    assert missing.exit_code == 1 and "no record" in missing.output


def test_i26_3_c28_show_names_a_default_scope_of_a_subdomain_route_by_its_host(
    make_app: Any,
) -> None:
    """Issue 26 item 3: the default scope of a route with a subdomain carries the host,
    so ``show`` and ``forget`` take it as ``--host``."""
    app, _ = make_app({"SERVER_NAME": "example.com", "SECRET_KEY": "cli-test"})
    app.subdomain_matching = True

    @app.post("/orders", subdomain="<tenant>")
    @idempotent
    def orders(tenant: str) -> Any:
        return jsonify(tenant=tenant), 201

    client = app.test_client()
    for headers in ({}, {"Authorization": "Bearer t0k"}):
        answer = client.post(
            "/orders",
            base_url="http://ACME.example.com",
            json={},
            headers={"Idempotency-Key": "o-1", **headers},
        )
        assert answer.status_code == 201
    runner = app.test_cli_runner()
    show = ["idempotency", "show", "o-1"]
    assert runner.invoke(args=show).exit_code == 1  # not the host-less anonymous scope
    shown = runner.invoke(args=[*show, "--host", "acme.example.com"])
    assert shown.exit_code == 0, shown.output
    assert "scope          anonymous@acme.example.com" in shown.output
    with_auth = [*show, "--host", "acme.example.com", "--authorization", "Bearer t0k"]
    assert runner.invoke(args=with_auth).exit_code == 0
    assert runner.invoke(args=[*show, "--host", "globex.example.com"]).exit_code == 1
    for wrong in (["--scope", "acme"], ["--digest"]):
        refused = runner.invoke(args=[*show, "--host", "acme.example.com", *wrong])
        assert refused.exit_code == 2, refused.output
    forgot = runner.invoke(
        args=["idempotency", "forget", "o-1", "--host", "acme.example.com", "--yes"]
    )
    assert forgot.exit_code == 0 and "Forgot the record" in forgot.output


def test_c28_forget_warns_about_a_request_in_flight(pg_app: Flask) -> None:
    digest = add_record(pg_app, state="in_progress", expires_in_ms=60_000, lease_in_ms=30_000)
    result = pg_app.test_cli_runner().invoke(
        args=["idempotency", "forget", digest, "--digest", "--yes"]
    )
    assert result.exit_code == 0, result.output
    assert "a request holds this key right now" in result.output
    assert digest not in digests(pg_app)


# -- check / create-table ---------------------------------------------------------------------


def _alter(app: Flask, statement: str) -> None:
    store = store_of(app)
    with store.autocommit.connect() as conn:
        conn.execute(text(statement.format(table=f'"{store.table.name}"')))


def test_c28_check_accepts_the_table_the_code_defines(pg_app: Flask) -> None:
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK: ")


def test_c28_check_fails_on_a_missing_column(pg_app: Flask) -> None:
    _alter(pg_app, "ALTER TABLE {table} DROP COLUMN body_omitted")
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert result.exit_code == 1, result.output
    assert "missing column body_omitted" in result.output
    assert "does not match" in result.output


def test_c28_check_fails_on_a_wrong_type_and_a_missing_unique_key(pg_app: Flask) -> None:
    table = store_of(pg_app).table.name
    _alter(pg_app, "ALTER TABLE {table} ALTER COLUMN lock_token TYPE varchar(8)")
    _alter(pg_app, f'ALTER TABLE {{table}} DROP CONSTRAINT "uq_{table}_key_digest"')
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert result.exit_code == 1, result.output
    assert "column lock_token is VARCHAR(8), expected VARCHAR(32)" in result.output
    assert "no unique constraint or unique index on key_digest" in result.output


def test_c28_check_names_types_as_postgresql_does(pg_app: Flask) -> None:
    """Issue 35: it called the body's BYTEA a BLOB (SQLAlchemy's generic name)."""
    _alter(pg_app, "ALTER TABLE {table} ALTER COLUMN response_body TYPE text")
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert result.exit_code == 1, result.output
    assert "column response_body is TEXT, expected BYTEA" in result.output
    _alter(pg_app, "ALTER TABLE {table} DROP COLUMN response_body")
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert "missing column response_body (BYTEA)" in result.output
    assert "BLOB" not in result.output


def test_c28_check_only_warns_about_the_prune_index(pg_app: Flask) -> None:
    table = store_of(pg_app).table.name
    _alter(pg_app, f'DROP INDEX "ix_{table}_expires_at_ms"')
    _alter(pg_app, "ALTER TABLE {table} ADD COLUMN note text")
    result = pg_app.test_cli_runner().invoke(args=["idempotency", "check"])
    assert result.exit_code == 0, result.output
    assert "warning: no index starting with expires_at_ms" in result.output
    assert "warning: unexpected column note" in result.output


def test_c28_missing_table_says_how_to_create_it(pg_app: Flask) -> None:
    store_of(pg_app).table.drop(store_of(pg_app).engine)
    runner = pg_app.test_cli_runner()
    for command in (["check"], ["prune"], ["stats"]):
        result = runner.invoke(args=["idempotency", *command])
        assert result.exit_code == 1, result.output
        assert "does not exist" in result.output
        assert "flask idempotency create-table" in result.output
    ddl = runner.invoke(args=["idempotency", "create-table", "--sql"])
    assert ddl.exit_code == 0 and "CREATE TABLE" in ddl.output and "CREATE INDEX" in ddl.output
    # Nothing so far created the table behind the operator's back.
    assert not Maintenance(store_of(pg_app)).table_exists()
    created = runner.invoke(args=["idempotency", "create-table"])
    assert created.exit_code == 0 and "Created" in created.output
    assert runner.invoke(args=["idempotency", "check"]).exit_code == 0
    again = runner.invoke(args=["idempotency", "create-table"])
    assert again.exit_code == 0 and "already exists" in again.output


def test_c28_forget_drops_the_redis_copy_too(make_pg_app: Any) -> None:
    """Forgotten means forgotten: a copy left in Redis would keep replaying (C22)."""
    import redis

    from .conftest import REDIS_URL, service_missing

    probe = redis.Redis.from_url(REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        probe.ping()
    except redis.RedisError as exc:
        service_missing("Redis", str(exc))
    prefix = f"test-cli-{uuid.uuid4().hex[:8]}"
    app, _ = make_pg_app({"IDEMPOTENCY_REDIS_URL": REDIS_URL, "IDEMPOTENCY_REDIS_PREFIX": prefix})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        calls.append(1)
        return jsonify(n=len(calls)), 201

    try:
        client = app.test_client()
        headers = {"Idempotency-Key": "cached-1"}
        client.post("/pay", json={}, headers=headers)
        assert list(probe.scan_iter(match=f"{prefix}*"))  # promoted to Redis
        forgot = app.test_cli_runner().invoke(args=["idempotency", "forget", "cached-1", "--yes"])
        assert forgot.exit_code == 0, forgot.output
        again = client.post("/pay", json={}, headers=headers)
        assert "Idempotent-Replayed" not in again.headers
        assert len(calls) == 2
    finally:
        for name in probe.scan_iter(match=f"{prefix}*"):
            probe.delete(name)
        probe.close()


def test_i9_12_c45_create_table_under_db_says_what_to_run_instead(tmp_path: Path) -> None:
    """C29/C45: with db= the table belongs to the app's migrations; the refusal names them,
    and the alternatives for an app without Flask-Migrate."""
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("cli_db_app")
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path}/app.sqlite3"
    db = SQLAlchemy(app)
    Idempotency(app, db=db)
    result = app.test_cli_runner().invoke(args=["idempotency", "create-table"])
    assert result.exit_code == 1, result.output
    for fix in ("flask db migrate", "flask db upgrade", "db.create_all()", "create-table --sql"):
        assert fix in result.output


# -- issue 26 item 8: nothing a client sent reaches the operator's terminal raw -----------------

#: An OSC sequence that retitles the terminal, as a client can put it in a path.
OSC = "\x1b]0;pwned\x07"


@pytest.fixture
def notes_app(make_app: Any) -> Flask:
    """A protected view whose path, scope and answer come from the client."""
    app, ext = make_app()

    @ext.scope_loader
    def from_body() -> str | None:
        return (request.get_json(silent=True) or {}).get("tenant")

    @app.post("/notes/<path:name>")
    @idempotent
    def note(name: str) -> Any:
        body = (request.get_json(silent=True) or {}).get("text", "").encode("utf-8")
        return body + b"\n\xff\r" + OSC.encode(), 201, {"Content-Type": "text/plain"}

    return app


def _show(app: Flask, *args: str) -> Any:
    return app.test_cli_runner().invoke(args=["idempotency", "show", *args])


def test_i26_8_c28_show_escapes_control_characters_of_the_stored_request(
    notes_app: Flask,
) -> None:
    answer = notes_app.test_client().post(
        "/notes/%1B%5D0;pwned%07",
        json={"tenant": "acme\x1b[2J\u202e"},
        headers={"Idempotency-Key": "n-1"},
    )
    assert answer.status_code == 201
    shown = _show(notes_app, "n-1", "--scope", "acme\x1b[2J\u202e")
    assert shown.exit_code == 0, shown.output
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in shown.output
    assert "request        POST /notes/\\x1b]0;pwned\\x07" in shown.output
    assert "scope          scope:acme\\x1b[2J\\u202e" in shown.output
    forgot = notes_app.test_cli_runner().invoke(
        args=["idempotency", "forget", "n-1", "--scope", "acme\x1b[2J\u202e", "--yes"]
    )
    assert forgot.exit_code == 0 and "\x1b" not in forgot.output


def test_i26_8_c28_show_body_on_a_terminal_is_a_safe_rendering(
    notes_app: Flask, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--body`` to a terminal escapes what a terminal would act on (newlines and
    tabs stay); piped, or with ``--raw``, it writes the stored bytes as they are."""
    notes_app.test_client().post(
        "/notes/a", json={"text": "line 1\n\tline 2 \\x1b"}, headers={"Idempotency-Key": "n-2"}
    )
    stored = b"line 1\n\tline 2 \\x1b\n\xff\r" + OSC.encode()
    piped = _show(notes_app, "n-2", "--body")
    assert piped.exit_code == 0 and piped.stdout_bytes.endswith(stored + b"\n")

    monkeypatch.setattr(cli, "_stdout_is_terminal", lambda: True, raising=False)
    shown = _show(notes_app, "n-2", "--body")
    assert shown.exit_code == 0, shown.output
    assert not set(shown.output) & {"\x1b", "\x07", "\r", "\udcff"}
    rendered = "line 1\n\tline 2 \\\\x1b\n\\xff\\x0d\\x1b]0;pwned\\x07\n"
    assert shown.output.endswith("\n\n" + rendered), shown.output
    raw = _show(notes_app, "n-2", "--body", "--raw")
    assert raw.exit_code == 0 and raw.stdout_bytes.endswith(stored + b"\n")
    assert _show(notes_app, "n-2", "--raw").exit_code == 2  # --raw goes with --body


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("/orders/é/日本/🙂", "/orders/é/日本/🙂"),  # letters and symbols stay
        ("a\\x1b", "a\\\\x1b"),  # a backslash is doubled: escapes are unambiguous
        ("\x1b[2J\x07\x00\x7f", "\\x1b[2J\\x07\\x00\\x7f"),  # C0 and DEL
        ("\x9b31m\x85", "\\u009b31m\\u0085"),  # C1: CSI, NEL
        ("\u202eevil\u2066\u200b\ufeff", "\\u202eevil\\u2066\\u200b\\ufeff"),  # format
        ("a\u2028b\u2029c", "a\\u2028b\\u2029c"),  # line and paragraph separators
        ("\udcff", "\\xff"),  # a byte that was not UTF-8
        ("a\nb\tc\rd", "a\\x0ab\\x09c\\x0dd"),
    ],
)
def test_i26_8_c28_printable_escapes_what_a_terminal_acts_on(text: str, shown: str) -> None:
    assert cli.printable(text) == shown


def test_i26_8_c28_printable_keeps_a_bodys_lines_when_asked() -> None:
    assert cli.printable("a\nb\tc\rd", keep_lines=True) == "a\nb\tc\\x0dd"
