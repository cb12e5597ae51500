"""``idempotency.once(key)``: work outside a request, with a request's guarantees (C50).

One execution per key across threads and processes, the stored JSON result for a
duplicate, release on an exception, 422-like refusal of a reused key, leases
taken over after a crash and fenced writes (C8, C9, C13, C14, C17, C7), on the
same table and Redis tier as requests. The multi-process proof with Redis
Streams and SIGKILLed consumers is ``test_c50_stream_consumers_*`` below.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from flask_idempotency import signals
from flask_idempotency.completion import heartbeat
from flask_idempotency.jobs import JobInProgress, JobKeyReused
from flask_idempotency.records import Identity
from tests.conftest import redis_server_binary, service_missing
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]


def _recorder(app: Any) -> dict[str, list[dict[str, Any]]]:
    seen: dict[str, list[dict[str, Any]]] = {}
    for name in (
        "request_executed",
        "request_replayed",
        "lease_taken_over",
        "lease_lost",
        "claim_released",
        "response_stored",
    ):

        def receiver(sender: Any, _name: str = name, **extra: Any) -> None:
            seen.setdefault(_name, []).append(extra)

        getattr(signals, name).connect(receiver, app, weak=False)
    return seen


def test_c50_c9_with_block_runs_once_and_a_duplicate_gets_the_stored_result(make_app) -> None:
    app, ext = make_app()
    runs: list[int] = []
    with app.app_context():
        with ext.once("mail:1") as run:
            assert run.owned
            runs.append(1)
            run.result = {"sent": True, "to": ["a@example.com"]}
        with ext.once("mail:1") as again:
            assert not again.owned
            assert again.result == {"sent": True, "to": ["a@example.com"]}
            assert again.source == "database"
        with ext.once("mail:1", scope="another-tenant") as other:
            assert other.owned  # C5: scopes never share records
            other.result = None
    assert runs == [1]


def test_c50_decorator_with_a_key_template_and_a_key_function(make_app) -> None:
    app, ext = make_app()
    calls: list[tuple[int, str]] = []

    @ext.once("invoice:{invoice_id}")
    def send_invoice(invoice_id: int, channel: str = "mail") -> dict[str, Any]:
        calls.append((invoice_id, channel))
        return {"invoice": invoice_id, "n": len(calls)}

    @ext.once(lambda order: f"ship:{order['id']}", scope="shipping")
    def ship(order: dict[str, Any]) -> int:
        calls.append((order["id"], "ship"))
        return len(calls)

    with app.app_context():
        assert send_invoice(7) == {"invoice": 7, "n": 1}
        assert send_invoice(7) == {"invoice": 7, "n": 1}
        assert send_invoice(invoice_id=8) == {"invoice": 8, "n": 2}
        assert ship({"id": 7}) == 3
        assert ship({"id": 7}) == 3
    assert calls == [(7, "mail"), (8, "mail"), (7, "ship")]
    assert send_invoice.__name__ == "send_invoice"


def test_c50_c17_an_exception_releases_the_key_so_the_next_delivery_runs(make_app) -> None:
    app, ext = make_app()
    seen = _recorder(app)
    attempts: list[int] = []

    @ext.once("flaky")
    def flaky() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("the SMTP server hung up")
        return "ok"

    with app.app_context():
        with pytest.raises(ConnectionError):
            flaky()
        assert flaky() == "ok"
        assert flaky() == "ok"
    assert len(attempts) == 2
    assert [e["reason"] for e in seen["claim_released"]] == ["exception"]


def test_c50_c7_the_same_key_for_other_work_is_refused(make_app) -> None:
    app, ext = make_app()
    with app.app_context():
        with ext.once("k", payload={"amount": 5}) as run:
            run.result = 1
        with pytest.raises(JobKeyReused):
            with ext.once("k", payload={"amount": 6}):
                pytest.fail("the body must not run")
        with pytest.raises(JobKeyReused):
            with ext.once("k", payload={"amount": 5}, name="another-job"):
                pytest.fail("the body must not run")


def test_c50_result_that_is_not_json_releases_and_says_so(make_app) -> None:
    app, ext = make_app()
    with app.app_context():
        with pytest.raises(TypeError, match="JSON-serialisable"):
            with ext.once("obj") as run:
                run.result = object()
        with ext.once("obj") as again:
            assert again.owned  # released, so the work may run again
            again.result = "fine"


def test_c50_bad_arguments_fail_loudly(make_app) -> None:
    app, ext = make_app()
    with pytest.raises(ValueError):
        ext.once("")
    with app.app_context():
        with pytest.raises(ValueError, match="lease"):
            with ext.once("x", ttl=10, lease=20):
                pass
        with pytest.raises(TypeError, match="decorator"):
            with ext.once(lambda: "x"):
                pass
    with pytest.raises(RuntimeError):
        with ext.once("outside an app context"):
            pass


def test_c50_c8_concurrent_consumers_run_once_and_all_get_the_result(make_pg_app) -> None:
    app, ext = make_pg_app({"IDEMPOTENCY_WAIT": 20})
    seen = _recorder(app)
    executions: list[int] = []
    results: list[Any] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(24)

    @ext.once("report:2026-11")
    def build_report() -> dict[str, Any]:
        executions.append(1)
        time.sleep(0.5)
        return {"rows": 1234, "token": uuid.uuid4().hex}

    def consumer() -> None:
        try:
            barrier.wait(10)
            with app.app_context():
                results.append(build_report())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consumer) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(executions) == 1
    assert len(results) == 24 and len({r["token"] for r in results}) == 1
    assert len(seen["request_executed"]) == 1 and len(seen["request_replayed"]) == 23


def test_c50_c8_one_once_object_shared_by_threads_in_with_blocks(make_pg_app) -> None:
    app, ext = make_pg_app({"IDEMPOTENCY_WAIT": 20})
    shared = ext.once("shared-object")
    executions: list[int] = []
    results: list[Any] = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait(10)
        with app.app_context():
            with shared as run:
                if run.owned:
                    executions.append(1)
                    time.sleep(0.3)
                    run.result = "made once"
            results.append(run.result)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert executions == [1] and results == ["made once"] * 8


def test_c50_c11_a_duplicate_that_may_not_wait_gets_job_in_progress(make_pg_app) -> None:
    app, ext = make_pg_app()
    started, finish = threading.Event(), threading.Event()

    def owner() -> None:
        with app.app_context():
            with ext.once("slow", lease=30) as run:
                started.set()
                finish.wait(10)
                run.result = "done"

    thread = threading.Thread(target=owner)
    thread.start()
    started.wait(10)
    with app.app_context():
        with pytest.raises(JobInProgress) as info:
            with ext.once("slow", wait=0):
                pytest.fail("the body must not run")
        assert 0 < info.value.retry_after <= 30
        finish.set()
        thread.join(10)
        with ext.once("slow", wait=0) as run:
            assert run.result == "done"


def test_c50_c13_a_crashed_consumers_claim_is_taken_over_after_its_lease(make_pg_app) -> None:
    app, ext = make_pg_app()
    seen = _recorder(app)
    with app.app_context():
        # A consumer claimed the key and died: its claim is in the table, nobody completes
        # it, and its renewer died with it.
        run = ext.once("crash", lease=1.0)._begin("crash", "once", None)
        assert run.owned and run._lease is not None
        heartbeat.stop(run._lease)
        with pytest.raises(JobInProgress):
            with ext.once("crash", wait=0):
                pass
        time.sleep(1.2)
        with ext.once("crash", lease=5, wait=0) as taker:
            assert taker.owned
            taker.result = "second consumer"
    assert [e["how"] for e in seen["request_executed"]] == ["new", "taken_over"]
    assert len(seen["lease_taken_over"]) == 1


def test_c50_c14_an_owner_that_lost_its_lease_cannot_overwrite_the_new_result(
    make_pg_app, caplog
) -> None:
    """With the heartbeat off (``IDEMPOTENCY_HEARTBEAT=False``), work that overruns its
    lease is taken over; its late completion is fenced."""
    app, ext = make_pg_app({"IDEMPOTENCY_HEARTBEAT": False})
    seen = _recorder(app)
    with app.app_context():
        slow = ext.once("fenced", lease=0.5)
        stale = slow.__enter__()
        time.sleep(0.8)  # its lease lapses while it works
        with ext.once("fenced", lease=10) as new_owner:
            assert new_owner.owned
            new_owner.result = "new owner"
        stale.result = "stale owner"
        with caplog.at_level(logging.WARNING, "flask_idempotency"):
            slow.__exit__(None, None, None)
        assert "taken over" in caplog.text
        with ext.once("fenced") as duplicate:
            assert duplicate.result == "new owner"
    assert [e["action"] for e in seen["lease_lost"]] == ["complete"]


def test_c50_c23_result_is_promoted_to_redis_and_replayed_from_it(make_pg_app) -> None:
    import redis

    from tests.conftest import REDIS_URL

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except Exception as exc:
        service_missing("Redis", str(exc))
    prefix = f"idem-jobs-{uuid.uuid4().hex[:8]}"
    app, ext = make_pg_app({"IDEMPOTENCY_REDIS_URL": REDIS_URL, "IDEMPOTENCY_REDIS_PREFIX": prefix})
    try:
        with app.app_context():
            with ext.once("cached") as run:
                run.result = [1, 2, 3]
            with ext.once("cached") as again:
                assert again.result == [1, 2, 3] and again.source == "cache"
        assert client.keys(f"{prefix}:*")
    finally:
        for name in client.scan_iter(f"{prefix}:*"):
            client.delete(name)
        client.close()


def test_c50_c40_atomic_work_commits_with_the_record_or_not_at_all(
    pg_url, pg_table, tmp_path
) -> None:
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy
    from sqlalchemy import Column, Integer, MetaData, String, Table

    from flask_idempotency import Idempotency

    db = SQLAlchemy(metadata=MetaData())
    effects = Table(
        f"{pg_table}_effects",
        db.metadata,
        Column("id", Integer, primary_key=True),
        Column("msg", String(64)),
    )
    app = Flask("atomic_jobs", instance_path=str(tmp_path))
    app.config.update(
        SQLALCHEMY_DATABASE_URI=pg_url.render_as_string(hide_password=False),
        IDEMPOTENCY_TABLE=pg_table,
    )
    db.init_app(app)
    ext = Idempotency(app, db=db)

    @ext.once("effect:{msg}", atomic=True)
    def apply(msg: str, fail: bool = False) -> str:
        db.session.execute(effects.insert().values(msg=msg))
        if fail:
            raise RuntimeError("crash after the write")
        return msg

    try:
        with app.app_context():
            db.create_all()
            with pytest.raises(RuntimeError):
                apply("a", fail=True)
            assert db.session.execute(text(f"SELECT count(*) FROM {effects.name}")).scalar() == 0
            assert apply("a") == "a"
            assert apply("a") == "a"
            assert db.session.execute(text(f"SELECT count(*) FROM {effects.name}")).scalar() == 1
    finally:
        with app.app_context():
            db.session.remove()
            db.drop_all()
            db.engine.dispose()


def test_c50_records_of_once_live_in_the_requests_table(make_app) -> None:
    app, ext = make_app()
    with app.app_context():
        with ext.once("shared-table") as run:
            run.result = 1
        with ext.store.autocommit.connect() as conn:
            rows = conn.execute(ext.store.table.select()).fetchall()
    assert [(r.method, r.path, r.scope) for r in rows] == [("ONCE", "once", "job:jobs")]
    assert isinstance(rows[0].key_digest, str) and Identity  # named by digest only (C30)


# -- the multi-process proof: Redis Streams, redelivery, SIGKILL --------------------------

CONSUMERS = 4
MESSAGES = 60
KILLS = 10


def _start_consumer(env: dict[str, str], name: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.apps.stream_consumer", name],
            cwd=REPO_ROOT,
            env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.slow
@pytest.mark.heavy
def test_c50_stream_consumers_apply_each_message_once_despite_redelivery_and_kills(
    load_pg_url, pg_table, tmp_path
) -> None:
    """Several consumer processes read one Redis Stream through a consumer group. Every
    message is published two or three times, and consumers are SIGKILLed mid-stream, so
    their pending entries are redelivered to the others by XAUTOCLAIM. Each message's
    effect is a row in PostgreSQL written in ``once(atomic=True)``: exactly one per message.
    """
    effects, started = _stream_run(load_pg_url, pg_table, tmp_path, atomic=True)
    assert effects == dict.fromkeys(range(MESSAGES), 1), "one effect per message"
    assert sum(started.values()) > MESSAGES, "no SIGKILL landed inside the work"


@pytest.mark.slow
@pytest.mark.heavy
def test_c50_stream_control_an_effect_committed_apart_is_duplicated_by_the_kills(
    load_pg_url, pg_table, tmp_path
) -> None:
    """The control: the same run, but the work commits its effect itself and the record
    completes afterwards (``atomic=False``). A SIGKILL between the two leaves an effect
    without a result; the redelivered message runs again. This shows the proof above can
    fail, and why effects in the database belong in ``atomic=True``."""
    effects, _started = _stream_run(load_pg_url, pg_table, tmp_path, atomic=False)
    assert set(effects) == set(range(MESSAGES)), "every message has its effect"
    assert any(count > 1 for count in effects.values()), "no kill landed between the commits"


def _stream_run(
    pg_url: Any, pg_table: str, tmp_path: Path, *, atomic: bool
) -> tuple[dict[int, int], dict[int, int]]:
    """Run the consumers with kills until the stream is drained; effects and starts per msg."""
    import redis

    server = RedisServer(redis_server_binary(), tmp_path / "redis").start()
    engine = create_engine(pg_url)
    consumers: dict[str, subprocess.Popen[bytes]] = {}
    log = tmp_path / "consumers.log"
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        client.xgroup_create("orders", "workers", id="$", mkstream=True)
        rng = random.Random(13)
        entries = [m for m in range(MESSAGES) for _ in range(rng.choice((2, 3)))]
        rng.shuffle(entries)
        env = {
            "STREAM_ATOMIC": "1" if atomic else "0",
            "STREAM_REDIS_URL": server.url,
            "STREAM_DATABASE_URL": pg_url.render_as_string(hide_password=False),
            "STREAM_TABLE": pg_table,
        }
        for i in range(CONSUMERS):
            consumers[f"c{i}"] = _start_consumer(env, f"c{i}", log)
        wait_until(lambda: client.get("ready") is not None, "a consumer up", within=60)
        for message in entries:
            client.xadd("orders", {"msg": str(message)})
        kills = 0
        spawned = CONSUMERS
        while kills < KILLS:
            time.sleep(rng.uniform(0.05, 0.3))
            # Kill a consumer caught inside the work (its effect written; in the control
            # committed too), waiting a while for one, else any one.
            busy: list[str] = []
            waited = time.monotonic() + 3.0
            while not busy and time.monotonic() < waited:
                busy = [n for n in sorted(consumers) if client.get(f"busy:{n}") is not None]
                if not busy:
                    time.sleep(0.005)
            name = rng.choice(busy or sorted(consumers))
            victim = consumers.pop(name)
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            kills += 1
            consumers[f"c{spawned}"] = _start_consumer(env, f"c{spawned}", log)
            spawned += 1

        def drained() -> bool:
            pending = client.xpending("orders", "workers")["pending"]
            group = client.xinfo_groups("orders")[0]
            return pending == 0 and group["lag"] == 0

        wait_until(drained, "every entry acknowledged", within=180, interval=0.2)
        with engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT msg, count(*) FROM {pg_table}_effects GROUP BY msg")
            ).fetchall()
        effects = {int(msg): count for msg, count in rows}
        deliveries = {m: int(client.get(f"deliveries:{m}") or 0) for m in range(MESSAGES)}
        started = {m: int(client.get(f"started:{m}") or 0) for m in range(MESSAGES)}
        claimed = int(client.get("claimed") or 0)
        print(
            f"\nstream run (atomic={atomic}): {len(entries)} entries for {MESSAGES} messages,"
            f" {kills} SIGKILLs, {sum(deliveries.values())} deliveries ({claimed} by"
            f" XAUTOCLAIM), {sum(started.values())} executions started,"
            f" {sum(effects.values())} effects"
        )
        assert all(count >= 2 for count in deliveries.values()), deliveries
        assert claimed > 0, "no entry was redelivered by XAUTOCLAIM"
        return effects, started
    finally:
        for process in consumers.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(10)
        server.stop()
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE IF EXISTS {pg_table}_effects"))
            conn.execute(text(f"DROP TABLE IF EXISTS {pg_table}"))
        engine.dispose()
        print(log.read_text(errors="replace")[-3000:] if log.exists() else "")


def test_c50_in_a_flask_cli_command(make_app) -> None:
    """A CLI command (cron, a one-off backfill) runs its work once per key."""
    import click

    app, ext = make_app()
    ran: list[str] = []

    @app.cli.command("send-digest")
    @click.argument("week")
    def send_digest(week: str) -> None:
        with ext.once(f"digest:{week}", ttl=30 * 86400) as run:
            if run.owned:
                ran.append(week)
                run.result = {"week": week, "sent": 120}
        click.echo(f"sent {run.result['sent']} ({'now' if run.owned else 'earlier'})")

    runner = app.test_cli_runner()
    first = runner.invoke(args=["send-digest", "2026-W47"])
    second = runner.invoke(args=["send-digest", "2026-W47"])
    assert first.exit_code == second.exit_code == 0, (first.output, second.output)
    assert first.output.strip() == "sent 120 (now)"
    assert second.output.strip() == "sent 120 (earlier)"
    assert ran == ["2026-W47"]


def test_c50_c44_work_that_outlasts_its_lease_keeps_the_key(make_pg_app) -> None:
    """A live owner's lease is renewed while its work runs: a duplicate that arrives after
    the first lease would have lapsed still finds it running and never runs it again."""
    app, ext = make_pg_app()
    seen = _recorder(app)
    started, results = threading.Event(), []
    executions: list[int] = []

    @ext.once("long-report", lease=1.0, wait=0)
    def long_report() -> str:
        executions.append(1)
        started.set()
        time.sleep(3.0)  # three leases
        return "built once"

    def owner() -> None:
        with app.app_context():
            results.append(long_report())

    thread = threading.Thread(target=owner)
    thread.start()
    assert started.wait(10)
    time.sleep(1.6)  # past the first lease
    with app.app_context():
        with pytest.raises(JobInProgress):
            long_report()
        time.sleep(0.8)  # past the second
        with pytest.raises(JobInProgress):
            long_report()
    thread.join(20)
    with app.app_context():
        assert long_report() == "built once"
    assert executions == [1] and results == ["built once"]
    assert "lease_taken_over" not in seen


def test_c50_c44_max_runtime_stops_renewals_so_a_hung_owner_lets_go(make_pg_app) -> None:
    """``IDEMPOTENCY_MAX_RUNTIME`` caps renewals; then the key is taken over and the hung
    owner's late completion is fenced (C14)."""
    app, ext = make_pg_app({"IDEMPOTENCY_MAX_RUNTIME": 0.5})
    seen = _recorder(app)
    with app.app_context():
        hung = ext.once("hung", lease=1.0)
        stale = hung.__enter__()
        assert stale.owned
        time.sleep(2.0)  # renewals stopped at 0.5 s; the lease ran out a lease later
        with ext.once("hung", wait=0) as taker:
            assert taker.owned
            taker.result = "taker"
        stale.result = "hung owner"
        hung.__exit__(None, None, None)
        with ext.once("hung") as duplicate:
            assert duplicate.result == "taker"
    assert [e["how"] for e in seen["request_executed"]] == ["new", "taken_over"]
    assert [e["action"] for e in seen["lease_lost"]] == ["complete"]
