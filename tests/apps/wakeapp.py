"""``procapp`` with wake-ups by message only: parked duplicates never poll the store.

A duplicate parked in one gunicorn worker can then learn that the original
finished in another worker only through Redis pub/sub; a lost message turns
into a 409 after ``IDEM_WAIT``, never a silent fallback. Every response names
the worker that answered it (``X-Worker-Pid``), replays included, and says
whether the request was parked (``X-Waited``).
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, Response, g

from flask_idempotency import signals
from flask_idempotency.notify import PollSchedule
from flask_idempotency.notify import hub as wakeup
from tests.apps.procapp import create_app as create_procapp

NO_POLLING = 3600.0


def create_app() -> Flask:
    wakeup.PollSchedule = lambda *_, **__: PollSchedule(first=NO_POLLING, cap=NO_POLLING)  # type: ignore[assignment,misc]
    app = create_procapp()

    @signals.request_waited.connect_via(app)
    def note_the_wait(sender: Flask, **extra: Any) -> None:
        g.idempotency_waited = extra["outcome"]

    @app.after_request
    def name_the_worker(response: Response) -> Response:
        response.headers["X-Worker-Pid"] = str(os.getpid())
        waited = g.get("idempotency_waited")
        if waited is not None:
            response.headers["X-Waited"] = waited
        return response

    return app
