"""A write-skew workload for SERIALIZABLE transactional mode (C43), in-process or under gunicorn.

Every customer has two accounts, ``a`` and ``b``; the bank lets one go negative as
long as their sum stays at or above zero. ``POST /withdraw/<level>`` reads both
balances, pauses (``X-Pause`` seconds, not part of the fingerprint), and takes the
amount from one account if the sum allows it: 201, one ledger row. Otherwise it
answers 422 ``insufficient-funds`` (stored too: the key keeps that answer).

Two withdrawals from the two accounts of one customer at the same moment are the
textbook write skew: each reads a sum that allows it, each updates a different
row, and at READ COMMITTED (or REPEATABLE READ, which PostgreSQL implements as
snapshot isolation) both commit and the sum goes negative. At SERIALIZABLE one of
them fails with 40001; with ``retries`` it runs again, sees the other's debit and
answers 422.

Every start of the view is noted in ``<table>_tries`` through an autocommit
engine (with the attempt number within its request), so a test sees retries, and
which worker process runs one, while the view's transaction is still open.

Environment for ``create_app()``: ``DATABASE_URL``, ``IDEM_TABLE``, ``IDEM_LEASE``,
``IDEM_RETRIES``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from flask import Flask, g, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    insert,
    select,
    update,
)

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.store.connect import create_store_engine

#: Routes: the level of the view's transaction, and its retries.
LEVELS = {
    "read-committed": ("READ COMMITTED", 0),
    "repeatable-read": ("REPEATABLE READ", 0),
    "serializable": ("SERIALIZABLE", None),  # retries from IDEM_RETRIES / build_app
}


def tables(metadata: MetaData, records_table: str) -> tuple[Table, Table, Table]:
    accounts = Table(
        f"{records_table}_accounts",
        metadata,
        Column("customer", Integer, primary_key=True),
        Column("name", Text, primary_key=True),
        Column("balance", Integer, nullable=False),
    )
    ledger = Table(
        f"{records_table}_ledger",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("idem_key", Text, nullable=False),  # not unique: a duplicate would show
        Column("customer", Integer, nullable=False),
        Column("name", Text, nullable=False),
        Column("amount", Integer, nullable=False),
    )
    attempts = Table(
        f"{records_table}_tries",
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column("idem_key", Text, nullable=False),
        Column("attempt", Integer, nullable=False),
        Column("pid", Integer, nullable=False),
    )
    return accounts, ledger, attempts


@dataclasses.dataclass
class TransfersApp:
    app: Flask
    db: SQLAlchemy
    accounts: Table
    ledger: Table
    attempts: Table
    side_engine: Engine

    def dispose(self) -> None:
        with self.app.app_context():
            self.db.engine.dispose()
        self.side_engine.dispose()


def build_app(
    database_url: str,
    records_table: str,
    *,
    retries: int = 5,
    lease: float = 60.0,
    config: dict[str, Any] | None = None,
) -> TransfersApp:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=database_url,
        SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 10, "max_overflow": 10, "pool_timeout": 10},
        IDEMPOTENCY_TABLE=records_table,
        IDEMPOTENCY_LEASE=lease,
        IDEMPOTENCY_WAIT=0,
    )
    app.config.update(config or {})
    db = SQLAlchemy(app)
    Idempotency(app, db=db)
    accounts, ledger, attempts = tables(db.metadata, records_table)
    side_engine = create_store_engine(
        database_url, isolation_level="AUTOCOMMIT", pool_size=2, pool_pre_ping=True
    )
    handles = TransfersApp(app, db, accounts, ledger, attempts, side_engine)

    @app.get("/healthz")
    def healthz() -> str:
        return "ok"

    def withdraw() -> Any:
        body = request.get_json()
        customer, name, amount = int(body["customer"]), str(body["account"]), int(body["amount"])
        key = request.headers.get("Idempotency-Key", "")
        g.attempt = g.get("attempt", 0) + 1
        with side_engine.connect() as conn:
            conn.execute(insert(attempts).values(idem_key=key, attempt=g.attempt, pid=os.getpid()))
        total = db.session.execute(
            select(func.sum(accounts.c.balance)).where(accounts.c.customer == customer)
        ).scalar_one()
        time.sleep(float(request.headers.get("X-Pause", "0")))
        if total - amount < 0:
            return jsonify(code="insufficient-funds", total=total, attempt=g.attempt), 422
        db.session.execute(
            update(accounts)
            .where(accounts.c.customer == customer, accounts.c.name == name)
            .values(balance=accounts.c.balance - amount)
        )
        db.session.execute(
            insert(ledger).values(idem_key=key, customer=customer, name=name, amount=amount)
        )
        return jsonify(ok=True, total_before=total, attempt=g.attempt), 201

    def route(level: str, level_retries: int) -> Any:
        def withdraw_view() -> Any:  # one function per route: @idempotent marks the function
            return withdraw()

        return idempotent(atomic=True, isolation=level, retries=level_retries)(withdraw_view)

    for path, (level, level_retries) in LEVELS.items():
        view = route(level, retries if level_retries is None else level_retries)
        app.add_url_rule(f"/withdraw/{path}", f"withdraw_{path}", view, methods=["POST"])
    return handles


def create_tables(handles: TransfersApp, customers: int, balance: int) -> None:
    """The accounts (both at ``balance``), the ledger and the attempts tables."""
    with handles.app.app_context():
        handles.db.metadata.create_all(handles.db.engine)
        with handles.db.engine.begin() as conn:
            conn.execute(
                insert(handles.accounts),
                [
                    {"customer": c, "name": name, "balance": balance}
                    for c in range(customers)
                    for name in ("a", "b")
                ],
            )


def create_app() -> Flask:
    """The gunicorn entry point, configured from the environment."""
    return build_app(
        os.environ["DATABASE_URL"],
        os.environ["IDEM_TABLE"],
        retries=int(os.environ.get("IDEM_RETRIES", "5")),
        lease=float(os.environ.get("IDEM_LEASE", "60")),
    ).app
