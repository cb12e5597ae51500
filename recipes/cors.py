"""CORS for browser clients: allow the ``Idempotency-Key`` header, expose the replay marker.

A browser sends ``Idempotency-Key`` on a cross-origin request only if the
preflight allows it, and lets the page's script read ``Idempotent-Replayed``
(and the other headers the layer sets) only if they are exposed. With
Flask-CORS (``pip install flask-cors``) that is two arguments. The layer's own
answers (a replay, a 409 from ``before_request``) pass through Flask-CORS's
``after_request`` like any other response, so they carry the CORS headers too.
"""

from __future__ import annotations

import itertools
from typing import Any

from flask import Flask, request
from flask_cors import CORS

from flask_idempotency import Idempotency, idempotent

idempotency = Idempotency()
order_ids = itertools.count(1)


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(config or {})
    idempotency.init_app(app)
    CORS(
        app,
        origins=["https://shop.example"],
        allow_headers=["Content-Type", "Authorization", "Idempotency-Key"],
        expose_headers=[
            "Idempotent-Replayed",  # true on a replayed response
            "Idempotency-Replay",  # "omitted": the stored body was too large (C33)
            "Idempotency-Unprotected",  # IDEMPOTENCY_FAIL_OPEN answered without the store
            "Retry-After",  # on 409 and 503
            "Location",
        ],
    )

    @app.post("/orders")
    @idempotent(required=True)
    def create_order() -> Any:
        order = {"id": next(order_ids), "items": request.get_json()["items"]}
        return order, 201, {"Location": f"/orders/{order['id']}"}

    return app
