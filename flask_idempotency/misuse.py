"""Misuse that would otherwise be silent, named when it can first be seen (C56).

A route marked ``@idempotent`` whose methods a key never applies to (a GET-only
route, a PUT route without ``methods=["PUT"]``) runs unprotected on every
request. Only at the app's first request is its set of routes final, so that is
when the layer looks (:func:`warn_unprotectable`, called as it puts itself in
front of the marked views), once per endpoint and app.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from flask import Flask

from .config import SAFE_METHODS, RouteOptions

if TYPE_CHECKING:
    from .state import AppState


def warn_unprotectable(
    app: Flask,
    state: AppState,
    endpoint: str,
    options_for: Callable[[str], RouteOptions | None],
) -> None:
    """Warn when none of ``endpoint``'s methods is one its key applies to.

    ``options_for(method)``: the ``@idempotent`` options a request with that method
    runs under (a class-based view marks handlers one by one), ``None`` if unmarked.
    """
    methods: set[str] = set()
    for rule in app.url_map.iter_rules(endpoint):
        if rule.methods is None:
            return  # a rule for every method: the key's methods among them
        methods |= rule.methods
    marked: list[str] = []
    applies: set[str] = set()
    for method in sorted(methods):
        route = options_for(method)
        if route is None:
            continue
        keyed = state.effective_options(route).methods
        if method in keyed:
            return  # at least one method is protected
        marked.append(method)
        applies |= keyed
    if not marked:
        return
    state.warn_once(
        ("unprotectable", endpoint),
        "idempotency: @idempotent on endpoint %r covers %s, none of which a key applies to"
        " here (%s), so every request to it runs unprotected. Register the route for one of"
        " those methods, or name its method in @idempotent(methods=[...]) or"
        " IDEMPOTENCY_METHODS (%s never can be) (C56).",
        endpoint,
        ", ".join(marked),
        ", ".join(sorted(applies)),
        ", ".join(sorted(SAFE_METHODS)),
    )
