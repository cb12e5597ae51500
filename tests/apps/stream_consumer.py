"""A Redis Streams consumer whose work is ``idempotency.once(..., atomic=True)`` (C50 proof).

``python -m tests.apps.stream_consumer <name>`` reads stream ``orders`` as member
``<name>`` of group ``workers``. Each entry's ``msg`` is a logical message; its
effect is one row in ``<STREAM_TABLE>_effects`` (``msg`` deliberately not unique,
so a duplicate effect would show). Entries another consumer left pending for
1.5 s (it was SIGKILLed) are taken over with XAUTOCLAIM. An entry is acknowledged
only after its work completed or was found completed; one still running
elsewhere stays pending and comes back later.

Counters in Redis for the test: ``deliveries:<msg>`` (every delivery of an entry),
``started:<msg>`` (every time the work began), ``claimed`` (entries XAUTOCLAIMed),
and ``busy:<name>`` while this consumer is inside the work, its effect written (the
test kills it there).
Environment: ``STREAM_REDIS_URL``, ``STREAM_DATABASE_URL``, ``STREAM_TABLE``, and
``STREAM_ATOMIC=0`` for the control run, where the effect commits on its own.
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

import redis
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import Column, Integer, MetaData, String, Table

from flask_idempotency import Idempotency
from flask_idempotency.jobs import JobInProgress

STREAM, GROUP = "orders", "workers"
CLAIM_IDLE_MS = 1500


def main(name: str) -> None:
    table = os.environ["STREAM_TABLE"]
    stats = redis.Redis.from_url(os.environ["STREAM_REDIS_URL"], decode_responses=True)
    db = SQLAlchemy(metadata=MetaData())
    effects = Table(
        f"{table}_effects",
        db.metadata,
        Column("id", Integer, primary_key=True),
        Column("msg", String(32), nullable=False),
        Column("consumer", String(32), nullable=False),
    )
    app = Flask(f"consumer_{name}")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=os.environ["STREAM_DATABASE_URL"],
        IDEMPOTENCY_REDIS_URL=os.environ["STREAM_REDIS_URL"],
        IDEMPOTENCY_TABLE=table,
        IDEMPOTENCY_CREATE_TABLE=True,
    )
    db.init_app(app)
    idempotency = Idempotency(app, db=db)
    with app.app_context():
        db.create_all()
        idempotency.store.engine  # noqa: B018 - create the records table now, not mid-message

    atomic = os.environ.get("STREAM_ATOMIC", "1") == "1"

    @idempotency.once(lambda msg: f"order:{msg}", atomic=atomic, lease=2.0, wait=1.0)
    def apply(msg: str) -> dict[str, Any]:
        stats.incr(f"started:{msg}")
        db.session.execute(effects.insert().values(msg=msg, consumer=name))
        if not atomic:
            db.session.commit()  # the control: the effect commits apart from the record
        # The test SIGKILLs consumers caught here: the effect written and, in the
        # control, committed; the record not completed.
        stats.set(f"busy:{name}", msg)
        time.sleep(random.uniform(0.03, 0.12))  # the rest of the work: room for a SIGKILL
        return {"msg": msg, "by": name}

    def handle(entry_id: str, fields: dict[str, str]) -> None:
        msg = fields["msg"]
        stats.incr(f"deliveries:{msg}")
        try:
            with app.app_context():
                apply(msg)
        except JobInProgress:
            return  # still running elsewhere: leave it pending, it comes back
        finally:
            stats.delete(f"busy:{name}")
        stats.xack(STREAM, GROUP, entry_id)

    stats.set("ready", 1)
    cursor = "0-0"
    while True:
        cursor, claimed, _deleted = stats.xautoclaim(
            STREAM, GROUP, name, min_idle_time=CLAIM_IDLE_MS, start_id=cursor, count=10
        )
        if claimed:
            stats.incrby("claimed", len(claimed))
        for entry_id, fields in claimed:
            if fields:  # None when the entry was deleted
                handle(entry_id, fields)
        batches = stats.xreadgroup(GROUP, name, {STREAM: ">"}, count=5, block=300)
        for _stream, entries in batches or ():
            for entry_id, fields in entries:
                handle(entry_id, fields)


if __name__ == "__main__":
    main(sys.argv[1])
