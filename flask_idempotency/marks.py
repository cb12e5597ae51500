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
#: On the guard ``@idempotent`` returns: the view it guards, which the layer calls itself.
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
