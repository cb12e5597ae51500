"""An app factory for running ``flask idempotency …`` as a real subprocess in tests.

The database and table come from the environment, as they would on a server:
``IDEMPOTENCY_DATABASE_URI`` and ``IDEMPOTENCY_TABLE``.
"""

from __future__ import annotations

import os

from flask import Flask

from flask_idempotency import Idempotency


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["IDEMPOTENCY_DATABASE_URI"] = os.environ["IDEMPOTENCY_DATABASE_URI"]
    app.config["IDEMPOTENCY_TABLE"] = os.environ.get("IDEMPOTENCY_TABLE", "idempotency_keys")
    Idempotency(app)
    return app
