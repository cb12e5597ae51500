"""The layer's own errors, as RFC 9457 ``application/problem+json`` (CONTRACT C27).

They are Werkzeug ``HTTPException`` subclasses that also derive from the
matching Werkzeug class (``BadRequest``, ``Conflict``, …), so an application can
still catch them with ``@app.errorhandler(409)``, by Werkzeug class, or by ours.
None of them is ever stored under a key (C18).

The base class has no status code of its own (``code = None``): Flask files a
handler under its class's code and looks a raised exception up under the
exception's code and then under "no code", so only a code-less base makes
``@app.errorhandler(IdempotencyProblem)`` see the 409, 422 and 503 as well as
the 400s. Each concrete problem sets its code.
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

from flask import Response, current_app
from werkzeug.exceptions import (
    BadRequest,
    Conflict,
    HTTPException,
    InternalServerError,
    RequestEntityTooLarge,
    ServiceUnavailable,
    UnprocessableEntity,
)

from .config import DEFAULT_PROBLEM_TYPE_BASE

PROBLEM_MIMETYPE = "application/problem+json"


class IdempotencyProblem(HTTPException):
    """Base of every error the idempotency layer answers with; handle it to see them all."""

    code: int | None = None  # see the module docstring: a code here would hide 409/422/503
    problem_code: ClassVar[str] = "idempotency-error"
    title: ClassVar[str] = "Idempotency error"

    def __init__(self, detail: str, *, retry_after: float | None = None) -> None:
        if self.code is None:
            raise TypeError("Raise a concrete problem (MissingKey, KeyReused, …), not the base.")
        super().__init__(description=detail)
        self.detail = detail
        self.retry_after = retry_after

    def problem(self) -> dict[str, Any]:
        """The problem document's members (RFC 9457 §3 plus our ``code``)."""
        return {
            "type": _type_base() + self.problem_code,
            "title": self.title,
            "status": self.code,
            "detail": self.detail,
            "code": self.problem_code,
        }

    def get_response(self, environ: Any = None, scope: Any = None) -> Response:
        response = Response(json.dumps(self.problem()), status=self.code, mimetype=PROBLEM_MIMETYPE)
        if self.retry_after is not None:
            response.headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return response


class MissingKey(IdempotencyProblem, BadRequest):
    code = 400
    problem_code = "missing-key"
    title = "Idempotency-Key is missing"


class InvalidKeyProblem(IdempotencyProblem, BadRequest):
    code = 400
    problem_code = "invalid-key"
    title = "Idempotency-Key is invalid"


class KeyReused(IdempotencyProblem, UnprocessableEntity):
    code = 422
    problem_code = "key-reused"
    title = "Idempotency-Key is already used"


class RequestInProgress(IdempotencyProblem, Conflict):
    code = 409
    problem_code = "request-in-progress"
    title = "A request is outstanding for this Idempotency-Key"


class RequestTooLarge(IdempotencyProblem, RequestEntityTooLarge):
    code = 413
    problem_code = "request-too-large"
    title = "Request body too large for an idempotent request"


# Werkzeug's _RetryAfter types retry_after differently; ours (seconds) is the one used.
class StoreUnavailable(IdempotencyProblem, ServiceUnavailable):  # type: ignore[misc]
    code = 503
    problem_code = "store-unavailable"
    title = "Idempotency store unavailable"


class RouteMisconfigured(IdempotencyProblem, InternalServerError):
    """A marked route whose options clash with the app's settings (``lease`` not shorter
    than ``ttl``…): reported at start-up (C63), and answered with this instead of
    running the view unprotected or failing every route of the app."""

    code = 500
    problem_code = "route-misconfigured"
    title = "The route's idempotency options are misconfigured"


def _type_base() -> str:
    try:
        state = current_app.extensions.get("idempotency")
    except RuntimeError:  # outside an app context, e.g. building docs
        return DEFAULT_PROBLEM_TYPE_BASE
    if state is None:
        return DEFAULT_PROBLEM_TYPE_BASE
    return str(state.settings.problem_type_base)
