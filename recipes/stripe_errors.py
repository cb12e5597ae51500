"""Stripe-shaped error bodies: the layer's problem+json turned into ``{"error": {...}}``.

Every error of the layer is an :class:`~flask_idempotency.IdempotencyProblem`
(RFC 9457 ``application/problem+json``). An API whose other errors already look
like Stripe's can answer in the same shape: one error handler is enough. Status
codes and ``Retry-After`` stay as they are, and nothing here is ever stored
under a key (C18), so a retry still gets a fresh decision.
"""

from __future__ import annotations

import itertools
from typing import Any

from flask import Flask, request

from flask_idempotency import Idempotency, IdempotencyProblem, idempotent

#: Stripe's error ``type`` for each status the layer answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    409: "idempotency_error",
    422: "idempotency_error",
    503: "api_error",
}

idempotency = Idempotency()
charge_ids = itertools.count(1)


def idempotency_error(exc: IdempotencyProblem) -> Any:
    problem = exc.problem()  # type, title, status, detail, code
    body = {
        "error": {
            "type": ERROR_TYPES.get(exc.code or 400, "api_error"),
            "code": problem["code"].replace("-", "_"),  # key-reused → key_reused
            "message": problem["detail"],
            "doc_url": problem["type"],
        }
    }
    response = exc.get_response()  # keeps Retry-After on 409 and 503
    headers = (
        {"Retry-After": response.headers["Retry-After"]}
        if "Retry-After" in response.headers
        else {}
    )
    return body, response.status_code, headers


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(config or {})
    idempotency.init_app(app)
    app.register_error_handler(IdempotencyProblem, idempotency_error)  # all five problems

    @app.post("/v1/charges")
    @idempotent(required=True)
    def create_charge() -> Any:
        amount = request.form.get("amount", type=int)
        return {"id": f"ch_{next(charge_ids)}", "object": "charge", "amount": amount}

    return app
