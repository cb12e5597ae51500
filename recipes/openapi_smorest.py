"""flask-smorest: the ``@idempotent`` operations describe themselves in the OpenAPI spec.

``IdempotencyPlugin(app)`` among the spec's plugins is the one line: every
operation the layer protects gets the ``Idempotency-Key`` header parameter, the
``Idempotent-Replayed`` response header and the 400/409/413/422/503 problem
answers, in ``/openapi.json`` and on the Swagger UI page (``/docs``).
Needs ``pip install flask-smorest`` (it brings apispec).
"""

from __future__ import annotations

import itertools
from typing import Any

import marshmallow as ma
from flask import Flask
from flask.views import MethodView
from flask_smorest import Api, Blueprint

from flask_idempotency import Idempotency, idempotent
from flask_idempotency.openapi import IdempotencyPlugin

idempotency = Idempotency()
blp = Blueprint("pets", __name__, url_prefix="/pets", description="Pets for adoption")
pet_ids = itertools.count(1)


class PetSchema(ma.Schema):
    id = ma.fields.Integer(dump_only=True)
    name = ma.fields.String(required=True)


@blp.route("/")
class Pets(MethodView):
    @blp.response(200, PetSchema(many=True))
    def get(self) -> list[dict[str, Any]]:
        """List the pets"""
        return []

    @idempotent(required=True)
    @blp.arguments(PetSchema)
    @blp.response(201, PetSchema)
    def post(self, pet: dict[str, Any]) -> dict[str, Any]:
        """Add a pet: send an Idempotency-Key, and retry with the same key"""
        return {"id": next(pet_ids), **pet}


@blp.route("/<int:pet_id>", methods=["PATCH"])
@idempotent
@blp.arguments(PetSchema)
@blp.response(200, PetSchema)
def rename_pet(pet: dict[str, Any], pet_id: int) -> dict[str, Any]:
    """Rename a pet"""
    return {"id": pet_id, **pet}


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(
        API_TITLE="Pets",
        API_VERSION="1",
        OPENAPI_VERSION="3.1.0",
        OPENAPI_URL_PREFIX="/",
        OPENAPI_SWAGGER_UI_PATH="/docs",
        OPENAPI_SWAGGER_UI_URL="https://cdn.jsdelivr.net/npm/swagger-ui-dist/",
    )
    app.config.update(config or {})
    idempotency.init_app(app)
    api = Api(app, spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})
    api.register_blueprint(blp)
    return app
