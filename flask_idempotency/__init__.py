"""Flask-Idempotency: safe retries for mutating endpoints with the Idempotency-Key header.

from flask_idempotency import Idempotency, idempotent

idempotency = Idempotency(app)

@app.post("/payments")
@idempotent
def create_payment(): ...
"""

from __future__ import annotations

from importlib import metadata as _metadata

from . import signals
from .config import ConfigVars
from .decorators import current_key_digest, idempotent, release_claim
from .extension import Idempotency
from .problems import (
    IdempotencyProblem,
    InvalidKeyProblem,
    KeyReused,
    MissingKey,
    RequestInProgress,
    RequestTooLarge,
    RouteMisconfigured,
    StoreUnavailable,
)

try:  # one source for the version: the installed package's metadata (setup.cfg)
    __version__ = _metadata.version("Flask-Idempotency")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ConfigVars",
    "Idempotency",
    "IdempotencyProblem",
    "InvalidKeyProblem",
    "KeyReused",
    "MissingKey",
    "RequestInProgress",
    "RequestTooLarge",
    "RouteMisconfigured",
    "StoreUnavailable",
    "current_key_digest",
    "idempotent",
    "release_claim",
    "signals",
]
