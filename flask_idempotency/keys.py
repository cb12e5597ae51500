"""Parsing the ``Idempotency-Key`` request header (CONTRACT C2–C3).

The draft the header is modelled on makes its value an RFC 9651 String
(``"8e03978e-…"``), yet nearly every client in the wild sends the bare value
(``8e03978e-…``). We accept both by default and treat them as the same key;
``IDEMPOTENCY_STRICT_HEADER`` keeps only the structured form and answers a bare
key with 400 ``invalid-key`` naming the form it wants (a bare key read as "no
key" would run the view unprotected).
"""

from __future__ import annotations

import re
import string

_LCALPHA = frozenset(string.ascii_lowercase)
_DIGITS = frozenset(string.digits)
_ALPHA = frozenset(string.ascii_letters)
_KEY_CHARS = _LCALPHA | _DIGITS | frozenset("_-.*")
_TCHAR = _ALPHA | _DIGITS | frozenset("!#$%&'*+-.^_`|~")
_TOKEN_CHARS = _TCHAR | frozenset(":/")
_BASE64 = _ALPHA | _DIGITS | frozenset("+/=")
#: A bare (legacy) key: printable ASCII without the characters that would make it
#: ambiguous as a structured field: ``"`` ``\\`` ``,`` ``;`` (and no space).
_BARE_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - frozenset('"\\,;')
#: The two forms nearly every key comes in, each matched by one regular expression
#: (issue 11: a character loop in Python cost a replay up to 10 µs): a bare key of the
#: characters above, and a non-empty quoted string of printable ASCII without escapes
#: or parameters. Anything else, and every error, goes through :func:`_parse_field`.
_PLAIN_BARE_KEY = re.compile(r"[!#-+\--:<-\[\]-~]+")
_PLAIN_QUOTED_KEY = re.compile(r'"([ !#-\[\]-~]*)"')


class InvalidKey(ValueError):
    """The header is present but its value cannot be a key (C3); ``str()`` says why."""


#: Why a field holding a comma outside a quoted string is refused. A WSGI server joins
#: repeated header lines into one value with commas (gunicorn and Werkzeug's server use
#: ``,``, Werkzeug's test client ``, ``), so two lines and a list look the same here.
SENT_TWICE = (
    "The Idempotency-Key header was sent more than once, or as a comma-separated list"
    " (servers join repeated header lines with commas). Send exactly one key; a key that"
    ' itself holds a comma must be sent as a quoted string, "a,b".'
)
#: What strict mode (``IDEMPOTENCY_STRICT_HEADER``) wants instead of a bare key.
QUOTED_ONLY = (
    "This server accepts the Idempotency-Key only as a structured-field string: send it"
    ' in double quotes, "key" (for example Idempotency-Key: "8e03978e-40d5-43e8-bc93-…").'
)
_ASCII_ONLY = (
    "The Idempotency-Key may hold only printable ASCII characters (no control characters,"
    " tabs or non-ASCII text), in any form: encode other text first (hex or base64url, say)."
)


def parse_key(values: list[str], *, strict: bool = False, max_length: int = 255) -> str | None:
    """Return the key carried by the header's field lines, or ``None`` if absent.

    ``values`` are the raw field lines of the header (several lines are an error,
    never a choice between them). Raises :class:`InvalidKey` for a value that is
    present but unusable, with a message that tells the client what to send. In
    strict mode a bare key is such a value: answering 400 beats running the view
    unprotected, which is what treating it as absent would do.
    """
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKey(SENT_TWICE)
    field = values[0].strip(" \t")
    if _PLAIN_BARE_KEY.fullmatch(field) is not None:
        if strict:
            raise InvalidKey(QUOTED_ONLY)
        key = field
    else:
        quoted = _PLAIN_QUOTED_KEY.fullmatch(field)
        key = quoted.group(1) if quoted is not None else ""
        if not key:
            key = _parse_field(field, strict=strict)
    if len(key) > max_length:
        raise InvalidKey(f"The Idempotency-Key is longer than {max_length} characters.")
    return key


def _parse_field(field: str, *, strict: bool) -> str:
    """The key in one field value, character by character; the two plain forms
    :func:`parse_key` matches with one regular expression each give the same key here."""
    if _has_list_comma(field):
        raise InvalidKey(SENT_TWICE)
    if not field.startswith('"'):
        if strict and field:
            raise InvalidKey(QUOTED_ONLY)
        key = _parse_bare(field)
    else:
        key = _parse_item(field)
    if not key:
        raise InvalidKey("The Idempotency-Key is empty.")
    return key


def _has_list_comma(field: str) -> bool:
    """Whether ``field`` has a comma outside a quoted string: two values, not one key."""
    quoted = escaped = False
    for char in field:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == "," and not quoted:
            return True
    return False


def _parse_bare(field: str) -> str:
    if not field:
        raise InvalidKey("The Idempotency-Key is empty.")
    for char in field:
        if char not in _BARE_KEY_CHARS:
            if not " " <= char <= "~":
                raise InvalidKey(_ASCII_ONLY)
            raise InvalidKey(
                "A bare Idempotency-Key cannot hold spaces, double quotes, backslashes or"
                ' semicolons; send such a key as a quoted string, "…", with \\" and \\\\'
                " escaped."
            )
    return field


class _Cursor:
    """A position in the field value; every parse step moves it forward."""

    __slots__ = ("pos", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        char = self.peek()
        self.pos += 1
        return char

    def done(self) -> bool:
        return self.pos >= len(self.text)


def _parse_item(field: str) -> str:
    """Parse an sf-item whose bare item must be a String; return the unescaped string."""
    cursor = _Cursor(field)
    key = _parse_string(cursor)
    _skip_parameters(cursor)
    if not cursor.done():
        raise InvalidKey("The Idempotency-Key must be a single quoted string; found more after it.")
    return key


def _parse_string(cursor: _Cursor) -> str:
    """RFC 9651 §4.2.5: a quoted string of printable ASCII with ``\\"`` and ``\\\\``."""
    if cursor.take() != '"':
        raise InvalidKey("The Idempotency-Key must start with a double quote.")
    out: list[str] = []
    while not cursor.done():
        char = cursor.take()
        if char == "\\":
            if cursor.done():
                break
            escaped = cursor.take()
            if escaped not in '"\\':
                raise InvalidKey(
                    'The Idempotency-Key has a backslash escape other than \\" or \\\\.'
                )
            out.append(escaped)
        elif char == '"':
            return "".join(out)
        elif not " " <= char <= "~":
            raise InvalidKey(_ASCII_ONLY)
        else:
            out.append(char)
    raise InvalidKey("The Idempotency-Key has no closing double quote.")


def _skip_parameters(cursor: _Cursor) -> None:
    """Validate and ignore ``;key=value`` parameters (the draft defines none)."""
    while cursor.peek() == ";":
        cursor.take()
        while cursor.peek() == " ":
            cursor.take()
        _parse_param_key(cursor)
        if cursor.peek() == "=":
            cursor.take()
            _skip_bare_item(cursor)


def _parse_param_key(cursor: _Cursor) -> None:
    first = cursor.take()
    if first not in _LCALPHA and first != "*":
        raise InvalidKey("The Idempotency-Key has a malformed parameter.")
    while cursor.peek() and cursor.peek() in _KEY_CHARS:
        cursor.take()


def _skip_bare_item(cursor: _Cursor) -> None:
    """Consume one bare item of any RFC 9651 type, validating its form."""
    char = cursor.peek()
    if char == '"':
        _parse_string(cursor)
    elif char == "-" or char in _DIGITS:
        _skip_number(cursor)
    elif char == "?":
        cursor.take()
        if cursor.take() not in ("0", "1"):
            raise InvalidKey("The Idempotency-Key has a malformed boolean parameter.")
    elif char == ":":
        cursor.take()
        while cursor.peek() and cursor.peek() in _BASE64:
            cursor.take()
        if cursor.take() != ":":
            raise InvalidKey("The Idempotency-Key has a malformed byte-sequence parameter.")
    elif char == "@":
        cursor.take()
        _skip_number(cursor, allow_decimal=False)
    elif char == "%":
        cursor.take()
        _skip_display_string(cursor)
    elif char in _ALPHA or char == "*":
        cursor.take()
        while cursor.peek() and cursor.peek() in _TOKEN_CHARS:
            cursor.take()
    else:
        raise InvalidKey("The Idempotency-Key has a malformed parameter value.")


def _skip_number(cursor: _Cursor, *, allow_decimal: bool = True) -> None:
    if cursor.peek() == "-":
        cursor.take()
    digits = 0
    while cursor.peek() and cursor.peek() in _DIGITS:
        cursor.take()
        digits += 1
    if digits == 0 or digits > 15:
        raise InvalidKey("The Idempotency-Key has a malformed numeric parameter.")
    if allow_decimal and cursor.peek() == ".":
        cursor.take()
        fraction = 0
        while cursor.peek() and cursor.peek() in _DIGITS:
            cursor.take()
            fraction += 1
        if not 1 <= fraction <= 3 or digits > 12:
            raise InvalidKey("The Idempotency-Key has a malformed decimal parameter.")


def _skip_display_string(cursor: _Cursor) -> None:
    if cursor.take() != '"':
        raise InvalidKey("The Idempotency-Key has a malformed display-string parameter.")
    hexdigits = frozenset("0123456789abcdef")
    decoded = bytearray()
    while not cursor.done():
        char = cursor.take()
        if char == '"':
            try:
                decoded.decode("utf-8")  # RFC 9651 §4.2.10: the octets must be UTF-8
            except UnicodeDecodeError:
                break
            return
        if char == "%":
            high, low = cursor.take(), cursor.take()
            if high not in hexdigits or low not in hexdigits:
                raise InvalidKey("The Idempotency-Key has a malformed display-string parameter.")
            decoded.append(int(high + low, 16))
        elif not " " <= char <= "~":
            raise InvalidKey("The Idempotency-Key has a malformed display-string parameter.")
    raise InvalidKey("The Idempotency-Key has a malformed display-string parameter.")
