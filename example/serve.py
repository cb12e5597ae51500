"""Run the payments example: ``python -m example.serve --port 5000`` (what ``make run`` does).

It prepares the database (Flask-Migrate's ``upgrade`` when the repository has
migrations, else ``create_all``), prints a few curl commands to try, then serves
on the threaded Werkzeug server so duplicate requests really overlap.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import flask_migrate
from flask import Flask
from sqlalchemy import inspect
from sqlalchemy.exc import DBAPIError
from werkzeug.serving import run_simple

from flask_idempotency import signals

from .app import MIGRATIONS_DIR, create_app
from .models import db

log = logging.getLogger("example")


def prepare_database(app: Flask) -> str:
    """Bring the schema up to date and say how: ``"migrations"`` or ``"create_all"``."""
    with app.app_context():
        if not os.path.exists(os.path.join(MIGRATIONS_DIR, "env.py")):
            db.create_all()
            return "create_all"
        with _logging_restored():
            tables = set(inspect(db.engine).get_table_names())
            if "payments" in tables and "alembic_version" not in tables:
                # Created by create_all before the repository had migrations: adopt it.
                flask_migrate.stamp(directory=MIGRATIONS_DIR)
            flask_migrate.upgrade(directory=MIGRATIONS_DIR)
        return "migrations"


@contextmanager
def _logging_restored() -> Iterator[None]:
    """Undo what Alembic's ``env.py`` does to logging in this process.

    Its ``fileConfig`` swaps the root handlers and disables every logger the ini
    file does not name, ``flask_idempotency`` included: its warnings (store down,
    lease lost) would vanish for the rest of the process.
    """
    manager = logging.Logger.manager
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    before = {
        name: (logger.disabled, logger.level)
        for name, logger in manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in root_handlers:
                root.removeHandler(handler)
                handler.close()
        for handler in root_handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(root_level)
        for name, (disabled, level) in before.items():
            logger = manager.loggerDict[name]
            if isinstance(logger, logging.Logger):
                logger.disabled = disabled
                logger.setLevel(level)


def log_decisions(app: Flask) -> None:
    """Print one line per idempotency decision, so the terminal shows what happened."""
    decisions = {
        signals.request_executed: "executed (first request, view runs)",
        signals.request_replayed: "replayed the stored response",
        signals.request_waited: "waited for the in-flight original",
        signals.request_conflict: "409: original still in flight",
        signals.key_mismatch: "422: key reused with another request",
        signals.claim_released: "released the key (response not stored)",
        signals.response_stored: "stored the response",
        signals.store_error: "store error",
    }
    for signal, text in decisions.items():

        def receiver(sender: Any, _text: str = text, **extra: Any) -> None:
            detail = {k: v for k, v in extra.items() if k in ("how", "source", "reason", "status")}
            suffix = " " + " ".join(f"{k}={v}" for k, v in detail.items()) if detail else ""
            log.info("idempotency key#%s: %s%s", extra["key_digest"][:12], _text, suffix)

        signal.connect(receiver, app, weak=False)


def try_it(base: str) -> str:
    """The curl session printed at start-up."""
    post = (
        f"curl -i -X POST {base}/payments -H 'Content-Type: application/json' "
        "-H 'X-Account: acme' -H 'Idempotency-Key: order-1001' "
    )
    return "\n".join(
        [
            "Try it (in another terminal):",
            "",
            "  # 1. Charge 19.99 EUR. The key makes retrying this request safe:",
            f'  {post}-d \'{{"amount_cents": 1999, "currency": "EUR"}}\'',
            "",
            "  # 2. The very same request again: the first answer comes back,",
            "  #    marked 'Idempotent-Replayed: true'; no second payment is made.",
            f'  {post}-d \'{{"amount_cents": 1999, "currency": "EUR"}}\'',
            "",
            "  # 3. The same key with another body is a client bug: 422 key-reused.",
            f'  {post}-d \'{{"amount_cents": 5000, "currency": "EUR"}}\'',
            "",
            "  # 4. There is exactly one payment:",
            f"  curl -s {base}/payments",
            "",
            "  Set GATEWAY_LATENCY=3 to make each charge slow, then send 2. while 1. is",
            "  still running: the duplicate waits and gets the replay.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the Flask-Idempotency payments example.")
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default: %(default)s)"
    )
    parser.add_argument("--port", type=int, default=5000, help="port (default: %(default)s)")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        app = create_app()
    except (ValueError, RuntimeError) as exc:  # a setting or a driver: say which, no traceback
        raise SystemExit(f"The example cannot start: {exc}") from None
    logging.getLogger("example").setLevel(logging.INFO)
    try:
        how = prepare_database(app)
    except DBAPIError as exc:  # the server is down, the database missing, access refused
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        where = _without_password(app.config["SQLALCHEMY_DATABASE_URI"])
        raise SystemExit(f"The example cannot reach its database {where}: {reason}") from None
    redis_url = app.config.get("IDEMPOTENCY_REDIS_URL")
    print(f"Database: {_without_password(app.config['SQLALCHEMY_DATABASE_URI'])} (schema: {how})")
    print(f"Redis:    {_without_password(redis_url) if redis_url else 'none (durable tier only)'}")
    print(f"Gateway latency: {app.config['GATEWAY_LATENCY']}s (GATEWAY_LATENCY)")
    print()
    print(try_it(f"http://{args.host}:{args.port}"), flush=True)
    log_decisions(app)
    run_simple(args.host, args.port, app, threaded=True, use_reloader=False)


def _without_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # only for display; a Redis URL need not parse as a SQLAlchemy URL
        return url.split("@")[-1] if "@" in url else url


if __name__ == "__main__":
    main()
