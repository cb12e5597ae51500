"""The one Flask app every benchmark path runs, in-process and under gunicorn.

Two views with the same body: ``/bare`` (never protected: the baseline) and
``/pay`` (``@idempotent`` when our extension is on). ``create_app(mode, ...)``
wires one of:

- ``plain``: no idempotency at all;
- ``ours``: Flask-Idempotency on PostgreSQL, with the Redis tier when a Redis URL is given;
- ``idemkit-redis`` / ``idemkit-pg``: idemkit 1.0.2's WSGI middleware around the
  same Flask app, with its Redis or PostgreSQL backend.

Under gunicorn the same factory reads its arguments from the environment
(``bench.benchapp:from_env()``). Every response names its worker
(``X-Worker-Pid``), so the wake-up benchmark can tell cross-worker wake-ups from
in-process ones. Nothing else is added to any app: the bare route is the baseline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask, Response, jsonify, request

from flask_idempotency import Idempotency, idempotent

PAYMENT = {"id": "pay_123", "amount_cents": 1999, "currency": "EUR", "status": "succeeded"}


def _view() -> tuple[Response, int]:
    """The work both routes do: a small JSON answer, optionally slow (``X-Sleep``).

    ``X-Sleep`` is a header, so it is outside every library's fingerprint: a
    duplicate can carry the same body without sleeping.
    """
    delay = request.headers.get("X-Sleep")
    if delay:
        time.sleep(float(delay))
    return jsonify(PAYMENT), 201


def _bare() -> tuple[Response, int]:
    """The baseline route: never protected."""
    return _view()


def _pay() -> tuple[Response, int]:
    """The protected route; a function of its own, since ``@idempotent`` marks the function."""
    return _view()


def create_app(
    mode: str,
    *,
    database_url: str | None = None,
    redis_url: str | None = None,
    table: str = "idempotency_bench",
    wait: float = 5.0,
) -> Flask:
    """The bench app in ``mode`` (see the module docstring)."""
    app = Flask(__name__)
    app.add_url_rule("/healthz", "healthz", lambda: "ok")
    app.add_url_rule("/bare", "bare", _bare, methods=["POST"])
    if mode == "ours":
        app.config.update(
            IDEMPOTENCY_DATABASE_URI=database_url,
            IDEMPOTENCY_TABLE=table,
            IDEMPOTENCY_WAIT=wait,
            IDEMPOTENCY_CREATE_TABLE=True,
        )
        if redis_url:
            app.config["IDEMPOTENCY_REDIS_URL"] = redis_url
        # What one option costs: ``BENCH_CONFIG='{"IDEMPOTENCY_HEARTBEAT": false}'``.
        app.config.update(json.loads(os.environ.get("BENCH_CONFIG") or "{}"))
        app.add_url_rule("/pay", "pay", idempotent(_pay), methods=["POST"])
        Idempotency(app)
    else:
        app.add_url_rule("/pay", "pay", _pay, methods=["POST"])
        if mode.startswith("idemkit"):
            app.wsgi_app = _idemkit(app.wsgi_app, mode, database_url, redis_url, table, wait)  # type: ignore[method-assign]
        elif mode != "plain":
            raise ValueError(f"unknown bench mode {mode!r}")
    app.wsgi_app = _NameTheWorker(app.wsgi_app)  # type: ignore[method-assign]
    return app


def from_env() -> Flask:
    """The factory gunicorn calls: ``bench.benchapp:from_env()``."""
    return create_app(
        os.environ["BENCH_MODE"],
        database_url=os.environ.get("DATABASE_URL"),
        redis_url=os.environ.get("REDIS_URL") or None,
        table=os.environ.get("BENCH_TABLE", "idempotency_bench"),
        wait=float(os.environ.get("BENCH_WAIT", "5")),
    )


def _idemkit(
    wsgi_app: Any,
    mode: str,
    database_url: str | None,
    redis_url: str | None,
    table: str,
    wait: float,
) -> Any:
    """idemkit's WSGI middleware, configured like our defaults where it can be."""
    from idemkit import HttpConfig, WSGIIdempotencyMiddleware

    if mode == "idemkit-redis":
        from idemkit.backends.redis import RedisBackend

        assert redis_url, "idemkit-redis needs a Redis URL"
        backend: Any = RedisBackend.from_url(redis_url, namespace=table)
    else:
        from idemkit.backends.postgres import PostgresBackend

        assert database_url, "idemkit-pg needs a database URL"
        backend = PostgresBackend.from_url(asyncpg_url(database_url), table=table)
    config = HttpConfig(
        scope_mode="single_tenant",  # like our anonymous scope: no Authorization header
        applicable_methods={"POST", "PATCH"},
        wait_timeout_seconds=wait,
    )
    return WSGIIdempotencyMiddleware(wsgi_app, backend=backend, config=config)


def asyncpg_url(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg2://…`` → ``postgresql://…`` (asyncpg takes no driver suffix)."""
    scheme, rest = sqlalchemy_url.split("://", 1)
    return "postgresql://" + rest if scheme.startswith("postgresql") else sqlalchemy_url


class _NameTheWorker:
    """Outermost WSGI layer: adds ``X-Worker-Pid``, also to answers idemkit sends itself."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        pid = str(os.getpid())  # after a fork the worker's own pid

        def named(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers.append(("X-Worker-Pid", pid))
            return start_response(status, headers, exc_info)

        return self.app(environ, named)
