"""The apispec plugin: ``IdempotencyPlugin`` (C64).

apispec calls a plugin's ``operation_helper`` for every path a generator adds,
with whatever the generator passed along: apispec-webframeworks' ``FlaskPlugin``
the view (``view=``), flask-smorest the Werkzeug rule (``rule=``), APIFlask only
the path. The view behind each operation is found from whichever is there, the
path through the app's URL map as a last resort.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from apispec import APISpec, BasePlugin
from flask import Flask

from .describe import (
    PROBLEM_SCHEMA_NAME,
    describe_operations,
    problem_schema,
    settings_of,
    the_app,
    views_by_path,
)


class IdempotencyPlugin(BasePlugin):
    """Describes every ``@idempotent`` operation of ``app`` (default: the current app) in an
    apispec ``APISpec``: the key header, the replay header, the problem answers.

    - flask-smorest: ``Api(app, spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})``
    - APIFlask: ``APIFlask(__name__, spec_plugins=[IdempotencyPlugin()])``
    - apispec: ``APISpec(..., plugins=[FlaskPlugin(), IdempotencyPlugin(app)])``

    OpenAPI 3.0 and 3.1 only.
    """

    def __init__(self, app: Flask | None = None) -> None:
        self._app = app
        self._spec: APISpec | None = None

    def init_spec(self, spec: APISpec) -> None:
        super().init_spec(spec)
        if spec.openapi_version.major < 3:
            raise ValueError(
                "IdempotencyPlugin describes OpenAPI 3.0 and 3.1 specs, not"
                f" {spec.openapi_version}: set the generator's OpenAPI version to 3.0.3 or"
                " 3.1.0."
            )
        self._spec = spec

    def operation_helper(
        self,
        path: str | None = None,
        operations: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not operations or self._spec is None:
            return
        app = the_app(self._app)
        view_for = _views(app, path, kwargs)
        spec = self._spec
        described = describe_operations(operations, settings_of(app), view_for, self._resolve)
        if described and PROBLEM_SCHEMA_NAME not in spec.components.schemas:
            spec.components.schema(PROBLEM_SCHEMA_NAME, problem_schema())

    def _resolve(self, name: str) -> dict[str, Any] | None:
        """A response component by name, registered or lazily registered (flask-smorest)."""
        assert self._spec is not None
        components = self._spec.components
        lazy = getattr(components, "responses_lazy", {})  # flask-smorest registers lazily
        found = components.responses.get(name) or lazy.get(name)
        return found if isinstance(found, dict) else None


def _views(app: Flask, path: str | None, kwargs: dict[str, Any]) -> Callable[[str], Any]:
    """The view serving each method of this path, from what the generator passed."""
    view = kwargs.get("view")
    if view is not None:  # apispec-webframeworks' FlaskPlugin
        return lambda method: view
    rule = kwargs.get("rule")
    if rule is not None:  # flask-smorest
        found = app.view_functions.get(rule.endpoint)
        return lambda method: found
    views = views_by_path(app)  # APIFlask, and anything else that passes the path only
    return lambda method: views.get((path or "", method))
