"""OpenAPI descriptions of ``@idempotent`` operations (C64): the layer's header, replay
marker and answers, in the API's own spec.

An app that documents itself with OpenAPI says nothing, by itself, of what this
layer adds to its marked operations. Switched on, every operation of a marked
route whose method a key applies to gets:

- the key header as a parameter (``IDEMPOTENCY_HEADER``; required where the
  route requires a key), a string of at most ``IDEMPOTENCY_KEY_MAX_LENGTH``
  characters sent as an RFC 9651 Structured Field string (or bare, unless
  ``IDEMPOTENCY_STRICT_HEADER``);
- the replay marker (``IDEMPOTENCY_REPLAY_HEADER``) on its success responses;
- the 400, 409, 413, 422 and 503 answers as ``application/problem+json``, all
  sharing one schema component, ``IdempotencyProblem``, with ``Retry-After`` on
  409 and 503. Where the app documents the same status already (flask-smorest and
  APIFlask both use 422 for validation errors), the problem is added beside it as
  a second media type, and the app's own description is kept.

Two ways in, one code path (:mod:`.describe`):

- :class:`IdempotencyPlugin`, an apispec plugin: for flask-smorest
  (``Api(spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})``), APIFlask
  (``APIFlask(..., spec_plugins=[IdempotencyPlugin()])``) and a plain
  ``apispec.APISpec`` with apispec-webframeworks' ``FlaskPlugin``. Needs apispec.
- :func:`describe_spec`, for a spec that is already a dict (any framework's, or an
  APIFlask ``spec_processor``). Needs nothing.

The core of the package never imports this one (an import contract says so):
documenting an API costs a request nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .describe import PROBLEM_SCHEMA_NAME, describe_spec

if TYPE_CHECKING:
    from .plugin import IdempotencyPlugin

__all__ = ["PROBLEM_SCHEMA_NAME", "IdempotencyPlugin", "describe_spec"]


def __getattr__(name: str) -> Any:
    """``IdempotencyPlugin`` imports apispec: only when asked for, so :func:`describe_spec`
    works without it."""
    if name == "IdempotencyPlugin":
        from .plugin import IdempotencyPlugin

        return IdempotencyPlugin
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
