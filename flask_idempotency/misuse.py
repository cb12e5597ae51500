"""Misuse that would otherwise be silent or break the app, named before it bites (C56, C63).

Two things can be wrong with a route marked ``@idempotent`` that no request
needs to show: its options clash with the app's settings (``lease`` not shorter
than ``ttl``, ``isolation=`` without ``atomic``), so its requests cannot be
served; or none of its methods is one a key applies to (a GET-only route, a PUT
route without ``methods=["PUT"]``), so it runs unprotected on every request.

When to say so. Flask has no "the app starts serving" hook: a WSGI server (the
dev server, gunicorn, uWSGI, waitress) imports the app and then only calls it
per request, and ``flask run`` offers no hook either. So the layer looks at the
three moments it has, and says each thing once per app (:meth:`AppState.warn_once`):

- ``init_app``, for the views registered by then (an app that defines its routes
  before it initialises its extensions hears of them at import);
- the app's first request, before it is answered: only then is the set of views
  final (Flask refuses new routes after it), so blueprints registered after
  ``init_app`` (the app-factory order) are seen here;
- ``flask idempotency check``, which lists them all and exits 1 on a clash: the
  deploy step's gate.

None of them raises. ``init_app`` used to raise for a clash, which made the whole
app fail to import (a traceback, and not even ``flask idempotency check`` could
run) for one route's option, or not at all when the route came later; a first
request that raised answered 500 on every route. Now a clashing route answers
its own requests with a problem+json 500 naming the setting (``lifecycle``), and
every other route serves.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from flask import Flask

from .config import SAFE_METHODS, EffectiveOptions, RouteOptions, Settings
from .marks import marked, route_options

if TYPE_CHECKING:
    from .state import AppState


#: Why an atomic route cannot run in an app without ``db=`` (C40).
ATOMIC_NEEDS_DB = (
    "@idempotent(atomic=True) (or IDEMPOTENCY_ATOMIC) needs Idempotency(db=db): the view's"
    " writes and the idempotency record must commit in one database transaction (C40)."
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing wrong with one marked route, as the log and ``check`` say it."""

    endpoint: str
    #: ``True``: its requests answer 500 until fixed; ``False``: it runs unprotected.
    error: bool
    message: str
    #: What :meth:`AppState.warn_once` knows it by.
    what: tuple[Any, ...]


def keyed_methods(settings: Settings, route: RouteOptions) -> frozenset[str]:
    """The methods a key applies to on a route, known even when its options clash."""
    return route.methods if route.methods is not None else settings.methods


def report(app: Flask, state: AppState, views: Mapping[str, Callable[..., Any]]) -> None:
    """Log what is wrong with the marked ones among ``views``, each thing once per app."""
    for finding in findings(app, state.settings, views, has_db=state.has_db):
        state.warn_once(
            finding.what,
            "idempotency: %s",
            finding.message,
            level=logging.ERROR if finding.error else logging.WARNING,
        )


def findings(
    app: Flask, settings: Settings, views: Mapping[str, Callable[..., Any]], *, has_db: bool
) -> list[Finding]:
    """What is wrong with each marked view among ``views`` (endpoint → view function);
    ``has_db``: whether the extension has a Flask-SQLAlchemy ``db`` (atomic mode needs it)."""
    found: list[Finding] = []
    for endpoint, view in list(views.items()):
        if marked(view):
            found += _endpoint_findings(app, settings, endpoint, view, has_db)
    return found


def _endpoint_findings(
    app: Flask, settings: Settings, endpoint: str, view: Callable[..., Any], has_db: bool
) -> list[Finding]:
    methods = _rule_methods(app, endpoint)
    # A view function has one set of options; a class-based view one per handler.
    by_options: dict[int, tuple[RouteOptions, list[str]]] = {}
    for method in sorted(methods if methods is not None else _ANY_METHOD):
        route = route_options(view, method)
        if route is not None:
            by_options.setdefault(id(route), (route, []))[1].append(method)
    found = []
    protected = False
    marked_unkeyed: list[str] = []
    applies: set[str] = set()
    for route, marked_methods in by_options.values():
        keyed = keyed_methods(settings, route)
        answering = [m for m in marked_methods if m in keyed or methods is None]
        protected = protected or bool(answering)
        marked_unkeyed += [m for m in marked_methods if m not in keyed]
        applies |= keyed
        try:
            options = EffectiveOptions.merge(settings, route)
        except ValueError as exc:
            found.append(_clash(endpoint, answering, str(exc)))
        else:
            if options.atomic and not has_db:
                found.append(_clash(endpoint, answering, ATOMIC_NEEDS_DB))
    if not protected and marked_unkeyed:
        found.append(_unprotectable(endpoint, sorted(marked_unkeyed), applies))
    return found


#: A rule for every method: the handler methods a class-based view may mark.
_ANY_METHOD = ("DELETE", "GET", "PATCH", "POST", "PUT")


def _rule_methods(app: Flask, endpoint: str) -> set[str] | None:
    """The methods ``endpoint``'s rules answer; ``None`` when some rule answers every one."""
    methods: set[str] = set()
    try:
        rules: Iterable[Any] = app.url_map.iter_rules(endpoint)
    except KeyError:  # a view function registered without a URL rule: never requested
        return methods
    for rule in rules:
        if rule.methods is None:
            return None
        methods |= rule.methods
    return methods


def _clash(endpoint: str, answering: list[str], why: str) -> Finding:
    where = f"@idempotent on {endpoint!r} ({', '.join(answering) or 'no keyed method'})"
    then = (
        " Until it is fixed, these requests answer 500 route-misconfigured (problem+json)"
        " and run nothing; the app's other routes are not affected (C63)."
        if answering
        else ""
    )
    return Finding(endpoint, True, f"{where}: {why}{then}", ("misconfigured", endpoint, *answering))


def _unprotectable(endpoint: str, marked_methods: list[str], applies: set[str]) -> Finding:
    message = (
        f"@idempotent on endpoint {endpoint!r} covers {', '.join(marked_methods)}, none of"
        f" which a key applies to here ({', '.join(sorted(applies))}), so every request to"
        " it runs unprotected. Register the route for one of those methods, or name its"
        " method in @idempotent(methods=[...]) or IDEMPOTENCY_METHODS"
        f" ({', '.join(sorted(SAFE_METHODS))} never can be) (C56)."
    )
    return Finding(endpoint, False, message, ("unprotectable", endpoint))
