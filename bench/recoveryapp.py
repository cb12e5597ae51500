"""The gunicorn app ``bench/redis_recovery.py`` measures: one protected view, and a probe
of each worker's Redis tier.

Every response names its worker (``X-Worker-Pid``) and, for a replay, where it came
from (``X-Replay-Source``: ``cache`` or ``database``). ``GET /tier`` answers, for the
worker that takes it, whether its cache is in its back-off and whether its wake-up
listener is subscribed (it starts the listener on first call). Environment:
``DATABASE_URL``, ``IDEM_TABLE``, ``REDIS_URL``.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Response, g, jsonify

from flask_idempotency import Idempotency, idempotent, signals


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.update(
        IDEMPOTENCY_DATABASE_URI=os.environ["DATABASE_URL"],
        IDEMPOTENCY_TABLE=os.environ["IDEM_TABLE"],
        IDEMPOTENCY_CREATE_TABLE=True,
        IDEMPOTENCY_REDIS_URL=os.environ["REDIS_URL"],
    )
    Idempotency(app)

    @signals.request_replayed.connect_via(app)
    def note_the_source(sender: Flask, **extra: Any) -> None:
        g.replay_source = extra["source"]

    @app.after_request
    def name_the_worker(response: Response) -> Response:
        response.headers["X-Worker-Pid"] = str(os.getpid())
        source = g.get("replay_source")
        if source is not None:
            response.headers["X-Replay-Source"] = source
        return response

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.get("/tier")
    def tier() -> Any:
        state = app.extensions["idempotency"]
        notifier = state.wakeups.channel
        live = notifier.ensure_listening(state.wakeups)
        return jsonify(pid=os.getpid(), down=state.cache.outage.down, live=live)

    @app.post("/pay")
    @idempotent
    def pay() -> Any:
        return jsonify(pid=os.getpid()), 201

    return app
