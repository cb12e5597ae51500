"""The ``flask idempotency`` command group (CONTRACT C28)."""

from __future__ import annotations

from flask.cli import AppGroup

idempotency_cli = AppGroup("idempotency", help="Maintain the Flask-Idempotency records.")
