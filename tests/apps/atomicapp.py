"""A payments app for the transactional-mode proofs (C40), run under gunicorn or in-process.

The protected view writes one business row, ``<IDEM_TABLE>_payments``, through
``db.session``. Its ``idem_key`` column is deliberately not unique: a key that
ran twice leaves two rows, so duplicates can be counted instead of being hidden
by a constraint. Before anything else, the view notes the attempt in
``<IDEM_TABLE>_attempts`` through a separate autocommit engine, and moves that
row's ``phase`` on as it goes (``started`` → ``written`` → ``finishing`` →
``committed``). Those notes are committed at once, so a test sees which worker
runs a request, and after a SIGKILL how far it got, while the view's own
transaction is still open.

``X-Sleep: pre,mid,post`` (seconds; not part of the fingerprint) stretches the
three stretches of the view::

    attempt row (started) · sleep pre · add + flush (written) · sleep mid
    · [ATOMIC=0: db.session.commit()] · (finishing) · sleep post · return 201

With ``ATOMIC=1`` the extension commits the payment and the record together after
the view returns; with ``ATOMIC=0`` the view commits the payment itself, as
typical application code does, and the record is completed separately.

Environment (for ``create_app()`` under gunicorn): ``DATABASE_URL``, ``IDEM_TABLE``,
``IDEM_LEASE``, ``IDEM_WAIT``, ``ATOMIC`` (``1`` or ``0``), ``IDEM_HEARTBEAT`` (``1``
or ``0``; unset: the default), ``IDEM_ISOLATION``, ``IDEM_SCOPE_READS_SESSION``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from flask import Flask, g, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    insert,
    text,
    update,
)

from flask_idempotency import Idempotency, idempotent, signals
from flask_idempotency.store.connect import create_store_engine

#: The stretches of ``X-Sleep``, in order.
SLEEP_STEPS = ("pre", "mid", "post")


def payments_table(metadata: MetaData, records_table: str) -> Table:
    """The business table: one row per execution that committed; ``idem_key`` is not unique."""
    return Table(
        f"{records_table}_payments",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("idem_key", Text, nullable=False),
        Column("amount", Integer, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("created_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    )


def attempts_table(metadata: MetaData, records_table: str) -> Table:
    """Every start of the view, committed at once, with the last phase it reached."""
    return Table(
        f"{records_table}_attempts",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("idem_key", Text, nullable=False),
        Column("pid", Integer, nullable=False),
        Column("phase", Text, nullable=False),
        Column("started_at", DateTime(timezone=True), server_default=func.now(), nullable=False),
    )


def parse_sleep(header: str | None) -> dict[str, float]:
    """``"0.1,0.2,0"`` → ``{"pre": 0.1, "mid": 0.2, "post": 0.0}``; missing parts are 0."""
    values = [float(part) for part in (header or "").split(",") if part.strip()]
    values += [0.0] * (len(SLEEP_STEPS) - len(values))
    return dict(zip(SLEEP_STEPS, values[: len(SLEEP_STEPS)], strict=False))


@dataclasses.dataclass
class AtomicApp:
    """The app and the handles a test needs to add views or look at rows."""

    app: Flask
    db: SQLAlchemy
    idempotency: Idempotency
    payment_model: Any
    attempts: Table
    side_engine: Engine
    #: In-process tests hook here to hold a request at a phase: ``on_phase(key, phase)``.
    on_phase: Callable[[str, str], None] | None = None

    def note(self, attempt_id: int, phase: str, key: str = "") -> None:
        """Move an attempt's phase on, committed at once through the side engine."""
        with self.side_engine.connect() as conn:
            conn.execute(
                update(self.attempts).where(self.attempts.c.id == attempt_id).values(phase=phase)
            )
        if self.on_phase is not None:
            self.on_phase(key, phase)

    def start_attempt(self, key: str) -> int:
        with self.side_engine.connect() as conn:
            return int(
                conn.execute(
                    insert(self.attempts)
                    .values(idem_key=key, pid=os.getpid(), phase="started")
                    .returning(self.attempts.c.id)
                ).scalar_one()
            )

    def dispose(self) -> None:
        with self.app.app_context():
            self.db.engine.dispose()
        self.side_engine.dispose()


def build_app(
    database_url: str,
    records_table: str,
    *,
    lease: float = 60.0,
    wait: float = 0.0,
    atomic: bool = True,
    config: dict[str, Any] | None = None,
    session_options: dict[str, Any] | None = None,
    isolation_level: str | None = None,
    scope_reads_session: bool = False,
) -> AtomicApp:
    """The payments app; tests add more views to ``.app`` before its first request.

    ``isolation_level`` is the app engine's (``SQLALCHEMY_ENGINE_OPTIONS``);
    ``scope_reads_session`` registers a scope loader that queries ``db.session``
    first, as one loading ``current_user`` from the database does (C43).
    """
    app = Flask(__name__)
    engine_options: dict[str, Any] = {"pool_size": 5, "max_overflow": 5, "pool_timeout": 10}
    if isolation_level is not None:
        engine_options["isolation_level"] = isolation_level
    app.config.update(
        SQLALCHEMY_DATABASE_URI=database_url,
        SQLALCHEMY_ENGINE_OPTIONS=engine_options,
        IDEMPOTENCY_TABLE=records_table,
        IDEMPOTENCY_LEASE=lease,
        IDEMPOTENCY_WAIT=wait,
    )
    app.config.update(config or {})
    db = SQLAlchemy(app, session_options=session_options or {})
    idempotency = Idempotency(app, db=db)
    payments = payments_table(db.metadata, records_table)
    if scope_reads_session:

        @idempotency.scope_loader
        def scope() -> str:
            # Like loading current_user: the session's transaction (and, at REPEATABLE
            # READ or SERIALIZABLE, its snapshot) begins here, before the claim.
            return str(db.session.execute(text("SELECT 'user-1'")).scalar_one())

    class Payment(db.Model):  # type: ignore[name-defined,misc]
        __table__ = payments

    # The side engine commits every statement on its own, outside the view's transaction.
    side_engine = create_store_engine(
        database_url, isolation_level="AUTOCOMMIT", pool_size=2, pool_pre_ping=True
    )
    handles = AtomicApp(
        app, db, idempotency, Payment, attempts_table(MetaData(), records_table), side_engine
    )
    app.extensions["atomicapp"] = handles

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    @app.post("/payments")
    @idempotent(atomic=atomic)
    def create_payment():  # type: ignore[no-untyped-def]
        key = request.headers.get("Idempotency-Key", "")
        body = request.get_json(silent=True) or {}
        sleeps = parse_sleep(request.headers.get("X-Sleep"))
        g.attempt_id = attempt_id = handles.start_attempt(key)
        time.sleep(sleeps["pre"])
        payment = Payment(idem_key=key, amount=int(body.get("amount", 0)), pid=os.getpid())
        db.session.add(payment)
        db.session.flush()  # the id is known; the row is not committed yet
        handles.note(attempt_id, "written", key)
        time.sleep(sleeps["mid"])
        if not atomic:
            db.session.commit()  # typical code: the payment is durable before the record is
        handles.note(attempt_id, "finishing", key)
        time.sleep(sleeps["post"])
        return jsonify(payment_id=payment.id, amount=payment.amount, pid=os.getpid()), 201

    @signals.response_stored.connect_via(app)
    def note_committed(sender: Flask, **extra: Any) -> None:
        """The record is durable (and, in atomic mode, the payment with it)."""
        attempt_id = g.get("attempt_id")
        if attempt_id is not None:
            handles.note(attempt_id, "committed")

    return handles


def create_app() -> Flask:
    """The gunicorn entry point, configured from the environment."""
    config = {}
    if os.environ.get("IDEM_HEARTBEAT"):
        config["IDEMPOTENCY_HEARTBEAT"] = os.environ["IDEM_HEARTBEAT"] == "1"
    return build_app(
        os.environ["DATABASE_URL"],
        os.environ["IDEM_TABLE"],
        lease=float(os.environ.get("IDEM_LEASE", "60")),
        wait=float(os.environ.get("IDEM_WAIT", "0")),
        atomic=os.environ.get("ATOMIC", "1") == "1",
        isolation_level=os.environ.get("IDEM_ISOLATION") or None,
        scope_reads_session=os.environ.get("IDEM_SCOPE_READS_SESSION") == "1",
        config=config,
    ).app
