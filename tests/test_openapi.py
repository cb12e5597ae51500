"""``@idempotent`` operations describe themselves in OpenAPI (issue 35 item 5; CONTRACT C64).

Real flask-smorest, APIFlask and plain apispec apps (the recipes the docs show),
their specs generated as each framework serves them and validated against the
OpenAPI 3.0 and 3.1 schemas with openapi-spec-validator. Every protected
operation gets the key header parameter, the replay header on its success
responses and the 400/409/413/422/503 problem answers with one shared schema;
unprotected operations are left as they were. The answers the spec promises are
the ones the app gives: the layer's problems stay problem+json even where the
framework reshapes every HTTP error (C27).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask import Flask, jsonify
from openapi_spec_validator import OpenAPIV30SpecValidator, OpenAPIV31SpecValidator, validate
from pydantic import BaseModel

from flask_idempotency import Idempotency, IdempotencyProblem, idempotent
from flask_idempotency.openapi import PROBLEM_SCHEMA_NAME, IdempotencyPlugin, describe_spec

VERSIONS = ["3.0.3", "3.1.0"]
PROBLEM_REF = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA_NAME}"}
KEY = {"Idempotency-Key": "key-1"}


def _config(tmp_path: Any, version: str, **extra: Any) -> dict[str, Any]:
    return {
        "TESTING": True,
        "OPENAPI_VERSION": version,
        "IDEMPOTENCY_DATABASE_URI": f"sqlite:///{tmp_path}/openapi.sqlite3",
        "IDEMPOTENCY_CREATE_TABLE": True,
        **extra,
    }


def _valid(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec, validated against the schema of its own OpenAPI version."""
    validator = (
        OpenAPIV31SpecValidator if spec["openapi"].startswith("3.1") else (OpenAPIV30SpecValidator)
    )
    validate(spec, cls=validator)
    return spec


def _served_spec(app: Flask) -> dict[str, Any]:
    response = app.test_client().get("/openapi.json")
    assert response.status_code == 200
    return _valid(response.get_json())


def _assert_described(
    spec: dict[str, Any],
    operation: dict[str, Any],
    *,
    required: bool,
    success: str,
    header: str = "Idempotency-Key",
    replay: str = "Idempotent-Replayed",
    max_length: int = 255,
) -> None:
    [parameter] = [p for p in operation["parameters"] if p.get("name") == header]
    assert parameter["in"] == "header" and parameter["required"] is required
    assert parameter["schema"] == {"type": "string", "minLength": 1, "maxLength": max_length + 2}
    assert "Structured Field string" in parameter["description"]
    assert f"at most {max_length}" in parameter["description"]
    responses = operation["responses"]
    assert replay in responses[success]["headers"]
    assert responses[success]["headers"][replay]["schema"] == {"type": "string", "enum": ["true"]}
    for status in ("400", "409", "413", "422", "503"):
        assert responses[status]["content"]["application/problem+json"]["schema"] == PROBLEM_REF
        assert responses[status]["description"]
    for status in ("409", "503"):
        assert responses[status]["headers"]["Retry-After"]["schema"]["type"] == "integer"
    assert ("missing-key" in responses["400"]["description"]) is required
    problem = spec["components"]["schemas"][PROBLEM_SCHEMA_NAME]
    assert problem["required"] == ["type", "title", "status", "detail", "code"]
    assert {"missing-key", "key-reused", "store-unavailable"} <= set(
        problem["properties"]["code"]["enum"]
    )


def _assert_untouched(operation: dict[str, Any]) -> None:
    text = json.dumps(operation)
    assert "Idempotency-Key" not in text and "Idempotent-Replayed" not in text
    assert PROBLEM_SCHEMA_NAME not in text


# -- flask-smorest ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_c64_flask_smorest_spec_describes_the_idempotent_operations(tmp_path, version) -> None:
    from recipes import openapi_smorest

    app = openapi_smorest.create_app(_config(tmp_path, version))
    spec = _served_spec(app)
    assert spec["openapi"] == version
    pets = spec["paths"]["/pets/"]
    _assert_described(spec, pets["post"], required=True, success="201")
    _assert_described(spec, spec["paths"]["/pets/{pet_id}"]["patch"], required=False, success="200")
    _assert_untouched(pets["get"])
    # flask-smorest's own 422 (its validation error) is kept beside the layer's problem.
    unprocessable = pets["post"]["responses"]["422"]
    assert unprocessable["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    assert unprocessable["description"].startswith("Unprocessable Entity. Or: ")
    assert "key-reused" in unprocessable["description"]
    # ... copied in: the component other operations may refer to is left as it was.
    components = json.dumps(spec["components"].get("responses", {}))
    assert "problem+json" not in components


def test_c64_c27_flask_smorest_answers_what_its_spec_says(tmp_path) -> None:
    """flask-smorest reshapes every HTTPException into its own JSON; the layer's problems
    stay problem+json (they were {"code": 400, "status": "Bad Request"})."""
    from recipes import openapi_smorest

    app = openapi_smorest.create_app(_config(tmp_path, "3.1.0"))
    client = app.test_client()
    missing = client.post("/pets/", json={"name": "Rex"})
    assert missing.status_code == 400 and missing.mimetype == "application/problem+json"
    assert missing.get_json()["code"] == "missing-key"
    first = client.post("/pets/", json={"name": "Rex"}, headers=KEY)
    again = client.post("/pets/", json={"name": "Rex"}, headers=KEY)
    assert first.status_code == again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true" and again.json == first.json
    reused = client.post("/pets/", json={"name": "Max"}, headers=KEY)
    assert reused.status_code == 422 and reused.mimetype == "application/problem+json"
    assert reused.get_json()["code"] == "key-reused"
    invalid = client.post("/pets/", json={}, headers={"Idempotency-Key": "key-2"})
    assert invalid.status_code == 422 and invalid.mimetype == "application/json"  # smorest's


# -- APIFlask --------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_c64_apiflask_spec_describes_the_idempotent_operations(tmp_path, version) -> None:
    from recipes import openapi_apiflask

    app = openapi_apiflask.create_app(_config(tmp_path, version))
    spec = _served_spec(app)
    assert spec["openapi"] == version
    pets = spec["paths"]["/pets"]
    _assert_described(spec, pets["post"], required=True, success="201")
    _assert_untouched(pets["get"])
    assert "ValidationError" in json.dumps(pets["post"]["responses"]["422"])  # APIFlask's own


def test_c64_c27_apiflask_answers_what_its_spec_says(tmp_path) -> None:
    """APIFlask reshapes every HTTPException too; and its @app.input sits above
    @idempotent, which the layer used to skip (the view got no body: a 500)."""
    from recipes import openapi_apiflask

    app = openapi_apiflask.create_app(_config(tmp_path, "3.0.3"))
    client = app.test_client()
    missing = client.post("/pets", json={"name": "Rex"})
    assert missing.status_code == 400 and missing.get_json()["code"] == "missing-key"
    first = client.post("/pets", json={"name": "Rex"}, headers=KEY)
    again = client.post("/pets", json={"name": "Rex"}, headers=KEY)
    assert first.status_code == 201, first.get_data(as_text=True)
    assert again.headers["Idempotent-Replayed"] == "true" and again.json == first.json


def test_c64_apiflask_spec_processor_with_describe_spec(tmp_path) -> None:
    """For any spec handed out as a dict: describe_spec, here as APIFlask's spec_processor."""
    from apiflask import APIFlask

    app = APIFlask(__name__, title="Orders", version="1")
    app.config.update(_config(tmp_path, "3.1.0"))
    app.spec_processor(describe_spec)
    Idempotency(app)

    @app.post("/orders/<int:shop>")
    @idempotent
    def order(shop: int):
        return {"shop": shop}, 201

    spec = _served_spec(app)
    _assert_described(spec, spec["paths"]["/orders/{shop}"]["post"], required=False, success="200")


# -- apispec with apispec-webframeworks' FlaskPlugin ------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_c64_plain_apispec_with_the_flask_plugin(tmp_path, version) -> None:
    from apispec import APISpec
    from apispec_webframeworks.flask import FlaskPlugin

    app = Flask(__name__)
    app.config.update(_config(tmp_path, version))

    @app.route("/transfers", methods=["GET", "POST"])
    @idempotent(required=True)
    def transfers():
        """Transfers.
        ---
        get:
          responses:
            200:
              description: the transfers
        post:
          responses:
            201:
              description: the transfer made
        """
        return jsonify(ok=True), 201

    Idempotency(app)
    spec = APISpec("Bank", "1", version, plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    with app.test_request_context():
        spec.path(view=transfers)
    document = _valid(spec.to_dict())
    operations = document["paths"]["/transfers"]
    _assert_described(document, operations["post"], required=True, success="201")
    _assert_untouched(operations["get"])  # GET is never protected (C1)


# -- what the description follows ----------------------------------------------------------


def test_c64_the_configured_names_and_limits_are_the_ones_described(tmp_path) -> None:
    from apiflask import APIFlask

    app = APIFlask(__name__, title="T", version="1", spec_plugins=[IdempotencyPlugin()])
    app.config.update(
        _config(
            tmp_path,
            "3.1.0",
            IDEMPOTENCY_HEADER="X-Request-Key",
            IDEMPOTENCY_REPLAY_HEADER="X-Replayed",
            IDEMPOTENCY_KEY_MAX_LENGTH=64,
            IDEMPOTENCY_STRICT_HEADER=True,
            IDEMPOTENCY_MAX_REQUEST_BYTES=0,
            IDEMPOTENCY_METHODS=["POST", "PUT"],
        )
    )
    Idempotency(app)

    @app.put("/files/<name>")
    @idempotent(ttl=3600)
    def put_file(name: str):
        return {"name": name}

    @app.delete("/files/<name>")
    @idempotent
    def delete_file(name: str):  # DELETE is not among IDEMPOTENCY_METHODS: unprotected
        return {}

    spec = _served_spec(app)
    put = spec["paths"]["/files/{name}"]["put"]
    [parameter] = [p for p in put["parameters"] if p["in"] == "header"]
    assert parameter["name"] == "X-Request-Key" and parameter["schema"]["maxLength"] == 66
    assert (
        "in double quotes" in parameter["description"] and "or bare" not in parameter["description"]
    )
    assert "kept for 1 hour" in parameter["description"]
    assert "X-Replayed" in put["responses"]["200"]["headers"]
    assert "413" not in put["responses"]  # IDEMPOTENCY_MAX_REQUEST_BYTES = 0: never answered
    assert "X-Request-Key" in put["responses"]["409"]["description"]
    assert "X-Request-Key" not in json.dumps(spec["paths"]["/files/{name}"]["delete"])


def test_c64_a_header_the_app_documents_itself_is_not_added_twice(tmp_path) -> None:
    from apispec import APISpec
    from apispec_webframeworks.flask import FlaskPlugin

    app = Flask(__name__)
    app.config.update(_config(tmp_path, "3.0.3"))

    @app.post("/charges")
    @idempotent
    def charge():
        """---
        post:
          parameters:
          - in: header
            name: idempotency-key
            description: ours
            schema: {type: string}
          responses:
            200: {description: charged}
        """
        return "ok"

    Idempotency(app)
    spec = APISpec("Pay", "1", "3.0.3", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    with app.test_request_context():
        spec.path(view=charge)
    [parameter] = _valid(spec.to_dict())["paths"]["/charges"]["post"]["parameters"]
    assert parameter["description"] == "ours"


def test_c64_openapi_2_is_refused_with_the_fix() -> None:
    from apispec import APISpec

    with pytest.raises(ValueError, match=r"OpenAPI 3\.0 and 3\.1.*3\.0\.3"):
        APISpec("Old", "1", "2.0", plugins=[IdempotencyPlugin(Flask(__name__))])
    with pytest.raises(ValueError, match=r"OpenAPI 3\.0 and 3\.1"):
        describe_spec({"swagger": "2.0", "paths": {}}, Flask(__name__))


def test_c64_without_an_app_the_plugin_says_what_it_needs() -> None:
    from apispec import APISpec

    spec = APISpec("T", "1", "3.0.3", plugins=[IdempotencyPlugin()])
    with pytest.raises(RuntimeError, match=r"IdempotencyPlugin\(app\)"):
        spec.path("/x", operations={"post": {"responses": {"200": {"description": "ok"}}}})


def test_c64_a_spec_built_before_init_app_reads_the_config(tmp_path) -> None:
    """flask-smorest adds paths when a blueprint is registered, maybe before init_app."""
    from apispec import APISpec

    app = Flask(__name__)
    app.config.update(_config(tmp_path, "3.0.3", IDEMPOTENCY_HEADER="X-Key"))

    @app.post("/a")
    @idempotent
    def a():
        return "ok"

    spec = APISpec("T", "1", "3.0.3", plugins=[IdempotencyPlugin(app)])
    spec.path("/a", operations={"post": {"responses": {"200": {"description": "ok"}}}})
    [parameter] = _valid(spec.to_dict())["paths"]["/a"]["post"]["parameters"]
    assert parameter["name"] == "X-Key"


# -- the layer's problems in apps with an HTTPException handler (C27) -------------------------


def test_c27_an_app_handler_for_the_problems_wins_before_or_after_init_app(tmp_path) -> None:
    for before in (True, False):
        app = Flask(__name__)
        app.config.update(_config(tmp_path, "3.0.3"))

        def mine(exc: IdempotencyProblem):
            return {"mine": exc.problem()["code"]}, exc.code

        if before:
            app.register_error_handler(IdempotencyProblem, mine)
        Idempotency(app)
        if not before:
            app.register_error_handler(IdempotencyProblem, mine)

        @app.post("/x")
        @idempotent(required=True)
        def x():
            return "ok"

        assert app.test_client().post("/x").json == {"mine": "missing-key"}


# -- frameworks not on apispec: describe_spec on the dict they keep ---------------------------


class Pet(BaseModel):
    name: str


class Shop(BaseModel):
    shop: int


def test_c64_flask_openapi3_with_describe_spec(tmp_path) -> None:
    """flask-openapi3 builds its spec once and keeps the dict (``app.api_doc``): describing
    that dict in place is what its /openapi/openapi.json then serves."""
    from flask_openapi3 import OpenAPI

    app = OpenAPI(__name__)
    app.config.update(_config(tmp_path, "3.1.0"))
    Idempotency(app)

    @app.post("/shops/<int:shop>/pets", responses={201: Pet})
    @idempotent(required=True)
    def add_pet(path: Shop, body: Pet):
        return {"name": body.name}, 201

    describe_spec(app.api_doc, app)
    spec = app.test_client().get("/openapi/openapi.json").get_json()
    if spec["components"].get("securitySchemes", ()) is None:
        del spec["components"]["securitySchemes"]  # flask-openapi3's own: null is invalid
    operation = _valid(spec)["paths"]["/shops/{shop}/pets"]["post"]
    _assert_described(spec, operation, required=True, success="201")
    assert operation["parameters"][0]["name"] == "shop"  # its own path parameter, kept
    client = app.test_client()
    for _ in range(2):
        answer = client.post("/shops/1/pets", json={"name": "Rex"}, headers=KEY)
    assert answer.status_code == 201 and answer.headers["Idempotent-Replayed"] == "true"


def test_c64_spectree_with_describe_spec(tmp_path) -> None:
    """spectree keeps its spec dict too (``api.spec``, built in an app context)."""
    from spectree import Response, SpecTree

    app = Flask(__name__)
    app.config.update(_config(tmp_path, "3.1.0"))
    Idempotency(app)
    api = SpecTree("flask")

    @app.post("/pets")
    @api.validate(json=Pet, resp=Response(HTTP_201=Pet))
    @idempotent
    def add_pet(json: Pet):
        return {"name": json.name}, 201

    api.register(app)
    with app.app_context():
        describe_spec(api.spec, app)
    spec = _valid(app.test_client().get("/apidoc/openapi.json").get_json())
    _assert_described(spec, spec["paths"]["/pets"]["post"], required=False, success="201")


def test_c64_describe_spec_twice_changes_nothing_more_and_leaves_other_specs_alone(
    tmp_path,
) -> None:
    """A spec described again (a framework that rebuilds it, a processor run twice) is the
    same spec; one with no protected operation is left exactly as it was."""
    import copy

    from recipes import openapi_apiflask

    app = openapi_apiflask.create_app(_config(tmp_path, "3.1.0"))
    spec = _served_spec(app)
    with app.app_context():
        again = describe_spec(copy.deepcopy(spec))
    assert again == spec
    plain = {"openapi": "3.0.3", "info": {"title": "t", "version": "1"}, "paths": {}}
    assert describe_spec(copy.deepcopy(plain), app) == plain
