"""How a view is marked: what ``@idempotent`` leaves on it, read back per method.

The decorator sets :data:`ROUTE_OPTIONS_ATTR` on the view function (or on a
class-based view's handler method) and returns a guard that refuses to run the
view in an app without the extension (C56), carrying the view under
:data:`GUARDED_ATTR`. The lifecycle reads the marks back when it wraps the views.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config import RouteOptions

#: Attribute ``@idempotent`` sets on a view function.
ROUTE_OPTIONS_ATTR = "__idempotency_options__"
#: On the guard ``@idempotent`` returns: ``(the guard, the view it guards)``; the layer
#: calls the view itself (:func:`unguarded`).
GUARDED_ATTR = "__idempotency_guarded__"
#: Handler methods a class-based view may carry ``@idempotent`` on.
_HANDLER_NAMES = ("get", "post", "put", "patch", "delete", "head", "options", "trace")


def route_options(view: Callable[..., Any], method: str) -> RouteOptions | None:
    """The ``@idempotent`` options of ``view`` for ``method``, if protected."""
    options: RouteOptions | None = getattr(view, ROUTE_OPTIONS_ATTR, None)
    if options is None:
        view_class = getattr(view, "view_class", None)
        if view_class is not None:
            handler = getattr(view_class, method.lower(), None)
            options = getattr(handler, ROUTE_OPTIONS_ATTR, None)
    return options


def marked(view: Callable[..., Any]) -> bool:
    """Whether ``view`` is protected for any method (see :func:`route_options`)."""
    return any(route_options(view, name) is not None for name in _HANDLER_NAMES)


def unguarded(view: Callable[..., Any]) -> Callable[..., Any]:
    """The view ``@idempotent``'s guard stands for when ``view`` is that guard, else ``view``.

    A decorator stacked above ``@idempotent`` (``login_required``, APIFlask's
    ``input``) copies the guard's attributes onto its own wrapper with
    ``functools.wraps``. That wrapper is not the guard: it must run, or the
    decorator's check or argument parsing would be skipped. Its inner guard then
    runs too, at the cost of one look-up.
    """
    guarded = getattr(view, GUARDED_ATTR, None)
    if isinstance(guarded, tuple) and guarded[0] is view:
        return guarded[1]  # type: ignore[no-any-return]
    return view
