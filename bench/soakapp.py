"""The gunicorn app ``bench/soak.py`` drives: an ``@idempotent`` view and a ``once()`` job.

Every execution is appended to a plain file (``SOAK_VIEW_LOG``) with one ``write()`` on
an ``O_APPEND`` descriptor, before and after the work: the kernel has the line as soon
as the call returns, so a SIGKILLed worker never loses one, and neither the store's
database nor Redis sits between the view and its log. The soak counts executions per
key from it.

Environment: ``DATABASE_URL`` (the store, through the soak's cuttable proxy),
``REDIS_URL`` (the soak's private redis-server), ``IDEM_TABLE``, ``IDEM_WAIT``,
``IDEM_LEASE``, ``IDEM_REDIS_TIMEOUT``, ``SOAK_VIEW_LOG``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from flask import Flask, g, has_request_context, jsonify, request

from flask_idempotency import Idempotency, idempotent, signals
from flask_idempotency.jobs import JobInProgress
from flask_idempotency.store import StoreError


def _log_line(*fields: object) -> None:
    """One line, one ``write()``: atomic on an ``O_APPEND`` file, durable across a kill."""
    line = " ".join(str(f) for f in (f"{time.time():.3f}", os.getpid(), *fields)) + "\n"
    fd = os.open(os.environ["SOAK_VIEW_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_REDIS_URL=os.environ["REDIS_URL"],
        IDEMPOTENCY_TABLE=os.environ["IDEM_TABLE"],
        IDEMPOTENCY_WAIT=float(os.environ.get("IDEM_WAIT", "5")),
        IDEMPOTENCY_LEASE=float(os.environ.get("IDEM_LEASE", "10")),
        IDEMPOTENCY_REDIS_SOCKET_TIMEOUT=float(os.environ.get("IDEM_REDIS_TIMEOUT", "0.25")),
    )
    idempotency = Idempotency(app)

    @signals.store_error.connect_via(app)
    def store_failed(sender: Any, **extra: Any) -> None:
        # Evidence for a second execution: the first one's completion was cut off (C14/C15).
        # (Also sent from the lease heartbeat, outside any request.)
        key = "-"
        if has_request_context():
            key = g.get("soak_key") or request.headers.get("Idempotency-Key", "-")
        _log_line("store-error", extra.get("tier"), extra.get("action"), key)

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/work")
    @idempotent
    def work() -> Any:
        body = request.get_json(silent=True) or {}
        key = request.headers.get("Idempotency-Key", "")
        _log_line("view-start", key)
        time.sleep(float(body.get("sleep", 0)))
        _log_line("view-end", key)
        return jsonify(key=key, pid=os.getpid(), at=time.time(), body=body), 201

    @app.post("/job")
    def job() -> Any:
        body = request.get_json(force=True)
        key = str(body["key"])
        g.soak_key = key
        try:
            with idempotency.once(f"soak:{key}", payload={"n": body.get("n")}) as run:
                if run.owned:
                    _log_line("job-start", key)
                    time.sleep(float(body.get("sleep", 0)))
                    _log_line("job-end", key)
                    run.result = {"key": key, "pid": os.getpid(), "at": time.time()}
        except JobInProgress as exc:
            return _problem(409, "job-in-progress", exc.retry_after)
        except StoreError:
            return _problem(503, "store-unavailable", 1)
        return jsonify(owned=run.owned, result=run.result), 200

    return app


def _problem(status: int, code: str, retry_after: float) -> Any:
    response = jsonify(code=code, status=status)
    response.status_code = status
    response.headers["Retry-After"] = str(max(1, round(retry_after)))
    response.content_type = "application/problem+json"
    return response
