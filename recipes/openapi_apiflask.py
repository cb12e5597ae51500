"""APIFlask: the ``@idempotent`` operations describe themselves in the OpenAPI spec.

``spec_plugins=[IdempotencyPlugin()]`` is the one line (the plugin finds the app
when APIFlask builds the spec): every operation the layer protects gets the
``Idempotency-Key`` header parameter, the ``Idempotent-Replayed`` response header
and the 400/409/413/422/503 problem answers, in ``/openapi.json`` and on the
docs page (``/docs``). Needs ``pip install apiflask``.
"""

from __future__ import annotations

import itertools
from typing import Any

from apiflask import APIFlask, Schema
from apiflask.fields import Integer, String

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.openapi import IdempotencyPlugin

idempotency = Idempotency()
pet_ids = itertools.count(1)


class PetIn(Schema):
    name = String(required=True)


class PetOut(Schema):
    id = Integer()
    name = String()


def create_app(config: dict[str, Any] | None = None) -> APIFlask:
    app = APIFlask(__name__, title="Pets", version="1", spec_plugins=[IdempotencyPlugin()])
    app.config.update(config or {})
    idempotency.init_app(app)

    @app.get("/pets")
    @app.output(PetOut(many=True))
    def list_pets() -> list[dict[str, Any]]:
        """List the pets"""
        return []

    @app.post("/pets")
    @app.input(PetIn)
    @app.output(PetOut, status_code=201)
    @idempotent(required=True)
    def add_pet(json_data: dict[str, Any]) -> dict[str, Any]:
        """Add a pet: send an Idempotency-Key, and retry with the same key"""
        return {"id": next(pet_ids), **json_data}

    return app
