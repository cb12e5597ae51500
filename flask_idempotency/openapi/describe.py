"""What an ``@idempotent`` operation adds to its OpenAPI description, as plain dicts (C64).

Everything here works on the OpenAPI 3.x objects as dicts, the form every
generator hands out in the end, so the apispec plugin and :func:`describe_spec`
share it. Which operations are protected is read from the app itself: the view
behind each path and method, its ``@idempotent`` mark and the app's settings, as
a request to it would be.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flask import Flask, current_app

from ..config import Settings
from ..marks import route_options
from ..misuse import keyed_methods
from ..problems import (
    InvalidKeyProblem,
    KeyReused,
    MissingKey,
    RequestInProgress,
    RequestTooLarge,
    RouteMisconfigured,
    StoreUnavailable,
)
from ..state import EXTENSION_NAME

#: The one schema component every problem answer of the layer refers to.
PROBLEM_SCHEMA_NAME = "IdempotencyProblem"
PROBLEM_MEDIA_TYPE = "application/problem+json"
#: Operations are these keys of a path item (OpenAPI 3.0 and 3.1).
HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})

#: Looks a response up by the name a ``$ref`` (or apispec's bare name) gives it.
Resolve = Callable[[str], "dict[str, Any] | None"]


def problem_schema() -> dict[str, Any]:
    """The ``IdempotencyProblem`` schema: RFC 9457's members plus the layer's ``code``."""
    codes = [
        problem.problem_code
        for problem in (
            MissingKey,
            InvalidKeyProblem,
            RequestInProgress,
            RequestTooLarge,
            KeyReused,
            StoreUnavailable,
            RouteMisconfigured,
        )
    ]
    return {
        "type": "object",
        "description": (
            "An error of the idempotency layer, as an RFC 9457 problem document. `type` is"
            " the problem type base followed by `code`."
        ),
        "properties": {
            "type": {"type": "string", "format": "uri-reference"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            "code": {"type": "string", "enum": codes},
        },
        "required": ["type", "title", "status", "detail", "code"],
    }


def settings_of(app: Flask) -> Settings:
    """The app's settings: the extension's once ``init_app`` ran, else read from its config
    (a spec may be built while blueprints are registered, before ``init_app``)."""
    state = app.extensions.get(EXTENSION_NAME)
    if state is not None:
        return state.settings  # type: ignore[no-any-return]
    return Settings.from_config(app.config)


def the_app(app: Flask | None) -> Flask:
    """``app``, else the current one; a clear error when there is neither."""
    if app is not None:
        return app
    try:
        return current_app._get_current_object()  # type: ignore[attr-defined,no-any-return]
    except RuntimeError:
        raise RuntimeError(
            "flask_idempotency.openapi needs the app: pass it (IdempotencyPlugin(app),"
            " describe_spec(spec, app)) or build the spec inside an app context."
        ) from None


def openapi_path(rule: str) -> str:
    """A Werkzeug rule as an OpenAPI path template: ``/pets/<int:id>`` → ``/pets/{id}``."""
    return re.sub(r"<(?:[^<>:]+:)?([^<>:]+)>", r"{\1}", rule)


def views_by_path(app: Flask) -> dict[tuple[str, str], Callable[..., Any]]:
    """``(OpenAPI path, METHOD)`` → the view function serving it, from the app's URL map."""
    found: dict[tuple[str, str], Callable[..., Any]] = {}
    for rule in app.url_map.iter_rules():
        view = app.view_functions.get(rule.endpoint)
        if view is None:
            continue
        for method in rule.methods or HTTP_METHODS:
            found.setdefault((openapi_path(rule.rule), method.upper()), view)
    return found


def key_required(settings: Settings, view: Callable[..., Any], method: str) -> bool | None:
    """Whether a request with ``method`` to ``view`` must carry a key; ``None`` when the
    layer does not protect it (unmarked, or a method the key does not apply to, C1)."""
    route = route_options(view, method)
    if route is None or method not in keyed_methods(settings, route):
        return None
    return settings.required if route.required is None else route.required


def describe_operation(
    operation: dict[str, Any],
    settings: Settings,
    *,
    required: bool,
    ttl: float,
    resolve: Resolve,
) -> None:
    """Add the key parameter, the replay header and the problem answers to ``operation``."""
    _add_key_parameter(operation, settings, required=required, ttl=ttl)
    responses = operation.setdefault("responses", {})
    for code in list(responses):
        if _is_success(code):
            response = _own(responses, code, resolve)
            if response is not None:
                _add_header(response, settings.replay_header, _replay_header(settings))
    for status, description in _problems(settings, required=required):
        response = _problem_response(responses, status, resolve)
        if response is None:
            continue  # the app's own answer for this status could not be read: left as is
        if PROBLEM_MEDIA_TYPE not in response.setdefault("content", {}):
            response["content"][PROBLEM_MEDIA_TYPE] = {
                "schema": {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA_NAME}"}
            }
            own = str(response.get("description") or "").rstrip(". ")
            response["description"] = f"{own}. Or: {description}" if own else description
        if status in (409, 503):
            _add_header(response, "Retry-After", _RETRY_AFTER)


def describe_spec(spec: dict[str, Any], app: Flask | None = None) -> dict[str, Any]:
    """Describe the ``@idempotent`` operations of an OpenAPI 3 spec given as a dict, in
    place, and return it: for a framework that hands out its spec as a dict (an APIFlask
    ``spec_processor``, say). ``app`` defaults to the current app."""
    app = the_app(app)
    version = str(spec.get("openapi", ""))
    if not version.startswith("3."):
        raise ValueError(f"describe_spec documents OpenAPI 3.0 and 3.1, not {version!r}.")
    settings = settings_of(app)
    views = views_by_path(app)
    components = spec.get("components", {})
    described = False
    for path, item in spec.get("paths", {}).items():
        for method, operation in item.items():
            view = views.get((path, method.upper())) if method in HTTP_METHODS else None
            if view is not None and _describe(operation, settings, view, method, components):
                described = True
    if described:
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        schemas.setdefault(PROBLEM_SCHEMA_NAME, problem_schema())
    return spec


def describe_operations(
    operations: Mapping[str, Any],
    settings: Settings,
    view_for: Callable[[str], Callable[..., Any] | None],
    resolve: Resolve,
) -> bool:
    """Describe each protected operation of one path; whether any was."""
    described = False
    for method, operation in operations.items():
        if method not in HTTP_METHODS or not isinstance(operation, dict):
            continue
        view = view_for(method.upper())
        if view is None:
            continue
        required = key_required(settings, view, method.upper())
        if required is not None:
            ttl = _ttl(settings, view, method.upper())
            describe_operation(operation, settings, required=required, ttl=ttl, resolve=resolve)
            described = True
    return described


def _describe(
    operation: Any, settings: Settings, view: Callable[..., Any], method: str, components: Any
) -> bool:
    def resolve(name: str) -> dict[str, Any] | None:
        found = components.get("responses", {}).get(name)
        return found if isinstance(found, dict) else None

    return describe_operations({method: operation}, settings, lambda _m: view, resolve)


def _ttl(settings: Settings, view: Callable[..., Any], method: str) -> float:
    route = route_options(view, method)
    return settings.ttl if route is None or route.ttl is None else route.ttl


# -- the pieces ---------------------------------------------------------------------------

_RETRY_AFTER = {
    "description": "Seconds to wait before sending the same request again.",
    "schema": {"type": "integer", "minimum": 1},
}


def _replay_header(settings: Settings) -> dict[str, Any]:
    return {
        "description": (
            "`true` when this is the stored response of an earlier request with the same"
            f" {settings.header}, replayed instead of running the operation again; absent"
            " on a first execution."
        ),
        "schema": {"type": "string", "enum": ["true"]},
    }


def _add_key_parameter(
    operation: dict[str, Any], settings: Settings, *, required: bool, ttl: float
) -> None:
    parameters = operation.setdefault("parameters", [])
    name = settings.header.lower()
    for parameter in parameters:
        if (
            isinstance(parameter, dict)
            and parameter.get("in") == "header"
            and str(parameter.get("name", "")).lower() == name
        ):
            return  # the app documents it itself
    forms = (
        'in double quotes, as an RFC 9651 Structured Field string ("8e03978e-…")'
        if settings.strict_header
        else 'as an RFC 9651 Structured Field string ("8e03978e-…") or bare (8e03978e-…)'
    )
    parameters.append(
        {
            "in": "header",
            "name": settings.header,
            "required": required,
            "description": (
                "Makes a retry of this request safe: the first request with a key runs the"
                " operation; a retry with the same key and the same request gets the stored"
                f" response again, marked `{settings.replay_header}: true`. A new request"
                f" needs a new key (a UUID, say): at most {settings.key_max_length}"
                f" printable ASCII characters, sent {forms}. A key is kept for"
                f" {_duration(ttl)} from its first request."
            ),
            # The limit is on the key; a quoted key's header value adds its two quotes.
            "schema": {"type": "string", "minLength": 1, "maxLength": settings.key_max_length + 2},
        }
    )


def _problems(settings: Settings, *, required: bool) -> Iterable[tuple[int, str]]:
    header = settings.header
    missing = ", or missing (`missing-key`): this operation requires one" if required else ""
    yield 400, f"The {header} header is malformed (`invalid-key`){missing}. Nothing ran."
    yield (
        409,
        f"A request with this {header} is still in progress (`request-in-progress`): send"
        " the same request again after `Retry-After` seconds.",
    )
    if settings.max_request_bytes:
        yield (
            413,
            f"A request with an {header} may send at most {settings.max_request_bytes} bytes"
            " of body (`request-too-large`). Nothing ran.",
        )
    yield (
        422,
        f"This {header} was already used with a different request (`key-reused`): a new"
        " request needs a new key.",
    )
    yield (
        503,
        "The idempotency store is unavailable (`store-unavailable`). Nothing was kept: send"
        " the same request again after `Retry-After` seconds.",
    )


def _is_success(code: Any) -> bool:
    text = str(getattr(code, "value", code)).upper()
    return text.startswith("2") and (text == "2XX" or text.isdigit())


def _find(responses: dict[Any, Any], status: int) -> Any:
    """The key ``responses`` files ``status`` under: ``201``, ``"201"``, an ``HTTPStatus``."""
    for code in responses:
        if str(getattr(code, "value", code)) == str(status):
            return code
    return None


def _own(responses: dict[Any, Any], code: Any, resolve: Resolve) -> dict[str, Any] | None:
    """The response at ``code`` as an object of this operation's own, to add to: a
    referenced one is copied in (the component may serve operations the layer does not
    protect); ``None`` when the reference cannot be read."""
    response = responses[code]
    name = None
    if isinstance(response, str):  # apispec: a component's name, made a $ref later
        name = response
    elif isinstance(response, dict) and "$ref" in response:
        name = str(response["$ref"]).rpartition("/")[2]
    if name is not None:
        response = resolve(name)
    if not isinstance(response, dict):
        return None
    own: dict[str, Any] = copy.deepcopy(response)  # a component, or shared by the framework
    responses[code] = own
    return own


def _problem_response(
    responses: dict[Any, Any], status: int, resolve: Resolve
) -> dict[str, Any] | None:
    code = _find(responses, status)
    if code is None:
        response: dict[str, Any] = {}  # described below, like an added media type
        responses[str(status)] = response  # OpenAPI's own key: a dict's keys stay one type
        return response
    return _own(responses, code, resolve)


def _add_header(response: dict[str, Any], name: str, header: dict[str, Any]) -> None:
    headers = response.setdefault("headers", {})
    if not any(str(existing).lower() == name.lower() for existing in headers):
        headers[name] = copy.deepcopy(header)


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit[:-1] if count == 1 else unit}"
    return f"{seconds:g} seconds"
