"""Idempotency keys for server-rendered HTML forms (CONTRACT C49).

A browser cannot send an ``Idempotency-Key`` header, but it sends back every
field of the form it was given. ``{{ idempotency_key_field() }}`` renders a
hidden input holding a fresh random key, so each rendering of the form is one
logical submission: a double-clicked "Pay" button, or the back button and a
resubmit of the page the browser kept, post the same key and get the first
answer again (with Post/Redirect/Get, the same redirect to the same
confirmation page). Rendering the form again gives a new key: a new order.

The key field and Flask-WTF's CSRF token are left out of the fingerprint: they
say nothing about what was ordered, and the CSRF token is re-signed on every
rendering, so with a key of the app's own choosing (``idempotency_key_field(key=
cart.id)``) a resubmit from a re-rendered page still matches its first request.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flask import current_app
from markupsafe import Markup, escape

from .keys import InvalidKey, parse_key

if TYPE_CHECKING:
    from .config import Settings

#: Bodies a browser form sends.
FORM_MIMETYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})
#: Flask-WTF's CSRF field when ``WTF_CSRF_FIELD_NAME`` is not set.
DEFAULT_CSRF_FIELD = "csrf_token"


def new_form_key() -> str:
    """A fresh, unguessable key: 192 random bits, URL-safe (a valid bare key, C2)."""
    return secrets.token_urlsafe(24)


def idempotency_key_field(key: str | None = None) -> Markup:
    """The hidden ``<input>`` carrying a form's idempotency key (a Jinja global).

    Without ``key`` each call makes a fresh random one: call it once per
    rendered form. Pass a key of your own (an order or cart id, say) to make
    every rendering of the form the same submission.
    """
    state = current_app.extensions.get("idempotency")
    if state is None:
        raise RuntimeError(
            "idempotency_key_field() needs Flask-Idempotency registered on this app"
            " (Idempotency(app) or init_app)."
        )
    name = state.settings.form_field
    value = new_form_key() if key is None else str(key)
    return Markup('<input type="hidden" name="{}" value="{}">').format(escape(name), escape(value))


def key_in_form(fields: Any, settings: Settings) -> str | None:
    """The key in the form field ``IDEMPOTENCY_FORM_FIELD``, or ``None`` without one.

    ``fields``: the form's fields (a ``MultiDict``), as :func:`.request_body.form`
    parsed them, once, through the cap; the fingerprint and the view reuse that
    parse (C31).
    """
    values = fields.getlist(settings.form_field)
    if not values:
        return None
    name = settings.form_field
    if len(values) > 1:
        raise InvalidKey(f"The form field {name!r} was sent more than once.")
    try:
        return parse_key(values, strict=False, max_length=settings.key_max_length)
    except InvalidKey as exc:
        raise InvalidKey(f"The form field {name!r}: {exc}") from None


def omitted_fields(settings: Settings, config: Mapping[str, Any] | None = None) -> frozenset[str]:
    """Form fields the fingerprint leaves out: the key's own and the CSRF token.

    ``config``: the app's config, when the caller has the app (saves a context look-up).
    """
    if config is None:
        config = current_app.config
    csrf = config.get("WTF_CSRF_FIELD_NAME", DEFAULT_CSRF_FIELD)
    return _omitted(settings.form_field, csrf if isinstance(csrf, str) else DEFAULT_CSRF_FIELD)


@functools.lru_cache(maxsize=16)
def _omitted(form_field: str, csrf_field: str) -> frozenset[str]:
    return frozenset({form_field, csrf_field})
