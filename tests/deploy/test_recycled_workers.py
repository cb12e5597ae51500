"""Workers recycled during an outage hand their kept completions on (C59, issue 33.5).

gunicorn with ``--max-requests`` (workers recycled after so many requests, as many
deployments run it) in front of PostgreSQL behind a proxy the test cuts. Four views
end while the database is down: their clients get 201, their completions are kept.
The outage's fast 503s use up each worker's request count, so every worker that keeps
a completion is recycled during the outage; each waits its exit flush and ends. The
outage lasts 16 s with a 2 s lease, so every record's lease has lapsed when the
database answers again. Before C59's spool the ended workers dropped their
completions ("N deferred settlement(s) had not landed…") and a retry after the outage
ran each view again; now the next workers adopt them: 0 views run again, and every
retry is the replay of the answer its client already had.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, Table, create_engine, select
from sqlalchemy.engine import URL

from tests.conftest import driver_url
from tests.support.gunicorn import GunicornServer
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.heavy]

OUTAGE = 16.0
LEASE = 2.0
KEYS = [f"recycled-{n}" for n in range(4)]


def post(url: str, key: str, timeout: float = 30.0) -> tuple[int, dict[str, Any], str]:
    request = urllib.request.Request(
        url + "/work",
        data=b"{}",
        method="POST",
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
            replayed = response.headers.get("Idempotent-Replayed", "")
            return response.status, json.loads(body), replayed
    except urllib.error.HTTPError as exc:
        return exc.code, {}, ""


@pytest.fixture
def rig(pg_database: URL, tmp_path: Path) -> Iterator[dict[str, Any]]:
    base = driver_url(pg_database, "psycopg2")
    proxy = TcpProxy(base.host or "127.0.0.1", base.port or 5432).start()
    table = f"idem_{uuid.uuid4().hex[:12]}"
    url = base.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    direct = create_engine(base)
    yield {"proxy": proxy, "table": table, "url": url, "direct": direct, "tmp": tmp_path}
    proxy.stop()
    with direct.begin() as conn:
        Table(table, MetaData(), autoload_with=conn).drop(conn, checkfirst=True)
    direct.dispose()


def run_cell(rig: dict[str, Any], spool: str) -> dict[str, Any]:
    """The cell; returns what it saw (executions per key, the retries' answers)."""
    proxy: TcpProxy = rig["proxy"]
    exec_log = rig["tmp"] / "executions.log"
    server = GunicornServer(
        "tests.deploy.recycleapp:create_app()",
        env={
            "DATABASE_URL": rig["url"],
            "IDEM_TABLE": rig["table"],
            "IDEM_LEASE": str(LEASE),
            "EXEC_LOG": str(exec_log),
            "SPOOL_DIR": spool,
            "VIEW_SECONDS": "1.0",
        },
        workers=2,
        threads=8,
        extra_args=["--max-requests", "20", "--max-requests-jitter", "4"],
    )
    server.start()
    try:
        # The table exists and every worker has connected before the outage.
        for _ in range(6):
            post(server.url, f"warm-{uuid.uuid4().hex}")
        first_pids = set(server.worker_pids())
        with concurrent.futures.ThreadPoolExecutor(len(KEYS)) as pool:
            firsts = [pool.submit(post, server.url, key) for key in KEYS]
            time.sleep(0.4)  # every view is running: the claims are in
            proxy.cut()
            cut_at = time.monotonic()
            answers = {key: future.result() for key, future in zip(KEYS, firsts, strict=True)}
        assert all(status == 201 for status, _, _ in answers.values()), answers
        # The outage's fast 503s use up the workers' request counts; a trickle after
        # that, as clients keep coming, until the database is back.
        stop = threading.Event()

        def traffic() -> None:
            sent = 0
            while not stop.is_set():
                post(server.url, f"other-{uuid.uuid4().hex}", timeout=20)
                sent += 1
                time.sleep(0.02 if sent < 60 else 0.5)

        trickle = threading.Thread(target=traffic, daemon=True)
        trickle.start()
        time.sleep(max(0.0, cut_at + OUTAGE - time.monotonic()))
        proxy.restore()
        restored_at = time.monotonic()
        recycled = first_pids - set(server.worker_pids())
        table = Table(rig["table"], MetaData(), autoload_with=rig["direct"])

        def settled() -> bool:
            with rig["direct"].connect() as conn:
                return "in_progress" not in set(conn.execute(select(table.c.state)).scalars())

        landed_within = None
        while time.monotonic() - restored_at < 8.0:
            if settled():
                landed_within = time.monotonic() - restored_at
                break
            time.sleep(0.05)
        time.sleep(max(0.0, restored_at + 2.0 - time.monotonic()))  # past a retry step
        stop.set()
        trickle.join(timeout=30)
        retries = {key: post(server.url, key) for key in KEYS}
        runs: dict[str, int] = {}
        for line in exec_log.read_text().splitlines():
            key = line.split()[0]
            if key in KEYS:
                runs[key] = runs.get(key, 0) + 1
        return {
            "answers": answers,
            "retries": retries,
            "runs": runs,
            "recycled": recycled,
            "log": server.log(),
            "landed_within": landed_within,
        }
    finally:
        server.stop()


def test_i33_5_c59_workers_recycled_during_an_outage_run_no_view_again(
    rig: dict[str, Any],
) -> None:
    seen = run_cell(rig, str(rig["tmp"] / "spool"))
    print(
        f"recycled workers: {len(seen['recycled'])}; runs per key: {seen['runs']};"
        f" all settled {seen['landed_within']} s after the database answered"
    )
    assert seen["recycled"], f"no worker was recycled during the outage:\n{seen['log']}"
    assert seen["runs"] == dict.fromkeys(KEYS, 1), (seen["runs"], seen["log"])
    for key in KEYS:
        status, body, replayed = seen["retries"][key]
        assert (status, replayed) == (201, "true"), (key, seen["retries"][key], seen["log"])
        assert body == seen["answers"][key][1], (key, body, seen["answers"][key])
    assert "written to the host's spool" in seen["log"], seen["log"]
    assert "had not landed when this process ended; their keys run again" not in seen["log"]
