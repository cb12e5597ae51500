"""Settling: the one place that decides how an owner's answer ends up (C15–C19, C40).

The lifecycle hands every owner's response here and nothing else: whether the
route is transactional, and what that means for the commit, is this package's
business, not the request adapter's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Response

from . import plain, transactional
from .ownership import Ownership
from .plain import settle_unfinished

__all__ = ["run_view", "settle", "settle_unfinished"]


def run_view(
    own: Ownership, view: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Run the owner's view: plainly, or in a unit of work that commits with its record."""
    if own.options.atomic:
        return transactional.run(own, view, args, kwargs)
    return view(*args, **kwargs)


def settle(own: Ownership, response: Response) -> Response:
    """Store the owner's answer, or release its claim (C15–C19); the response goes on."""
    if own.settled:  # a transactional view settled itself
        own.stop_heartbeat()
        return response
    own.settled = True
    reason = plain.release_reason(own, response.status_code)
    if reason is not None:
        own.stop_heartbeat()
        plain.release(own, reason, response.status_code)
        return response
    # Storing stops the heartbeat itself, once a streamed body has been read (C44).
    if own.options.atomic:
        return transactional.store(own, response)
    return plain.store(own, response)
