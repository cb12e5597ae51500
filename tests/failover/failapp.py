"""The gunicorn app the failover test drives.

Its store is the Patroni pair, through a multi-host URL with
``target_session_attrs=read-write``. What the test counts is written to a *file*, never
to a database: an append-only ledger of JSON lines that no failover can lose or delay,
so a run that happened while the store was gone is still counted, and the ledger never
turns the outage into a 500. Events (``t`` is ``time.monotonic()``, one clock for every
process on the host):

- ``claim``: the layer granted a claim (the ``request_executed`` signal, sent before the
  view runs), with ``how`` (new, taken over...);
- ``run-start`` / ``run-end``: the view itself, one ``run`` id per execution;
- ``stored``, ``store-error``, ``lease-lost``, ``released``: how the layer settled the
  request afterwards (diagnostics only: the verdicts use claims and runs).

Environment: ``DATABASE_URL``, ``IDEM_TABLE``, ``IDEM_LEASE``, ``IDEM_WAIT``,
``LEDGER_PATH``.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from flask import Flask, g, has_request_context, jsonify, request

from flask_idempotency import Idempotency, idempotent, signals


class Ledger:
    """One JSON object per line, appended under an exclusive ``flock``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.monotonic(), "event": event, **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line.encode())
        finally:
            os.close(fd)  # closing releases the lock

    def read(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Complete lines from ``offset`` on, and the offset after the last of them."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        lines = data[:end].splitlines()
        return [json.loads(line) for line in lines if line], offset + end


_runs = itertools.count(1)


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=os.environ["IDEM_TABLE"],
        IDEMPOTENCY_LEASE=float(os.environ.get("IDEM_LEASE", "40")),
        IDEMPOTENCY_WAIT=float(os.environ.get("IDEM_WAIT", "5")),
    )
    idempotency = Idempotency(app)
    idempotency.scope_loader(lambda: "failover")  # one tenant; and no start-up warning
    ledger = Ledger(os.environ["LEDGER_PATH"])

    def note(event: str, **fields: Any) -> None:
        key = request.headers.get("Idempotency-Key", "") if has_request_context() else ""
        ledger.append(event, key=key, pid=os.getpid(), run=g.get("failover_run"), **fields)

    @signals.request_executed.connect_via(app)
    def claimed(sender: Any, **extra: Any) -> None:
        note("claim", how=extra.get("how"))

    @signals.response_stored.connect_via(app)
    def stored(sender: Any, **extra: Any) -> None:
        note("stored")

    @signals.store_error.connect_via(app)
    def store_failed(sender: Any, **extra: Any) -> None:
        if extra.get("tier") == "database":
            note("store-error", action=extra.get("action"))

    @signals.lease_lost.connect_via(app)
    def lost(sender: Any, **extra: Any) -> None:
        note("lease-lost", action=extra.get("action"))

    @signals.claim_released.connect_via(app)
    def released(sender: Any, **extra: Any) -> None:
        note("released", reason=extra.get("reason"))

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/orders")
    @idempotent
    def create_order() -> Any:
        body = request.get_json(silent=True) or {}
        g.failover_run = f"{os.getpid()}-{next(_runs)}"
        note("run-start")
        time.sleep(float(body.get("sleep", 0)))
        note("run-end")
        return jsonify(run=g.failover_run, key=body.get("key")), 201

    return app
