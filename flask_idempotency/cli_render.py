"""How the CLI shows what a record holds: escaped, never raw, and times an operator reads.

A record holds what a client sent (its path, the scope a loader read from the
request, the response the view made of it), so nothing of it reaches the
operator's terminal raw: control and format characters are escaped
(:func:`printable`, issue 26 item 8).
"""

from __future__ import annotations

import json
import re
import unicodedata
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store.maintenance import RecordView

#: Characters looked at by :func:`printable`: all but printable ASCII other than ``\``.
_SUSPECT = re.compile(r"[^\x20-\x5b\x5d-\x7e]")
#: Unicode categories a terminal acts on or may hide: controls (C0, DEL, C1: escape
#: sequences, bells, carriage returns), format characters (bidirectional overrides,
#: zero-width characters), line and paragraph separators, surrogates, unassigned.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})


def printable(text: str, *, keep_lines: bool = False) -> str:
    r"""``text`` as a terminal may show it: every unsafe character escaped.

    ``\x1b`` for a character below U+0080, ``\u202e`` (``\U…``) above; a byte
    that was not UTF-8 (decoded with ``surrogateescape``) as ``\xff``; ``\``
    itself as ``\\``, so the rendering is unambiguous. ``keep_lines``: newlines
    and tabs stay (a body's layout); otherwise they are escaped too, so a value
    cannot start a line of its own.
    """
    return _SUSPECT.sub(_escape_keeping_lines if keep_lines else _escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    if unicodedata.category(char) not in _UNSAFE_CATEGORIES:
        return char
    code = ord(char)
    if code < 0x80:
        return f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _escape_keeping_lines(match: re.Match[str]) -> str:
    char = match.group()
    return char if char in "\n\t" else _escape(match)


def iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def relative(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return ""
    delta = (ms - now_ms) / 1000
    span_text = span(abs(delta))
    return f" (in {span_text})" if delta >= 0 else f" ({span_text} ago)"


def moment(ms: int | None, now_ms: int) -> str:
    """ISO-8601 UTC, and how far from now: what an operator reading a record wants."""
    return iso(ms) + relative(ms, now_ms)


def span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m {seconds % 60:.0f}s"
    if seconds < 86400:
        return f"{seconds // 3600:.0f}h {seconds % 3600 // 60:.0f}m"
    return f"{seconds // 86400:.0f}d {seconds % 86400 // 3600:.0f}h"


def body_limit(setting: int, database: int | None) -> str:
    """The largest body stored with its response, and which limit sets it (C33, C58)."""
    if database is None or setting <= database:
        by = "IDEMPOTENCY_MAX_BODY_BYTES"
        if database is not None:
            by += f"; the database takes up to {database:,} bytes"
        return f"Stored bodies: up to {setting:,} bytes ({by}); a larger one is omitted (C33)."
    return (
        f"Stored bodies: up to {database:,} bytes, the most this database takes in one"
        f" completion (IDEMPOTENCY_MAX_BODY_BYTES is {setting:,}); a larger one is omitted"
        " (C33, C58)."
    )


def describe_record(record: RecordView) -> list[str]:
    """The record as lines for a terminal: every value that came from a request (the
    scope, method and path, the header names of the view's answer) is escaped."""
    now = record.now_ms
    lines = [
        f"digest         {printable(record.key_digest)}",
        f"scope          {printable(record.scope)}",
        f"state          {printable(record.state)}",
        f"request        {printable(record.method)} {printable(record.path)}",
        f"created        {iso(record.created_at_ms)}{relative(record.created_at_ms, now)}",
        f"expires        {iso(record.expires_at_ms)}{relative(record.expires_at_ms, now)}",
    ]
    if record.lease_expires_at_ms is not None:
        lines.append(
            f"lease until    {iso(record.lease_expires_at_ms)}"
            f"{relative(record.lease_expires_at_ms, now)}"
        )
    if record.completed_at_ms is not None:
        lines.append(
            f"completed      {iso(record.completed_at_ms)}{relative(record.completed_at_ms, now)}"
        )
    if record.response_status is not None:
        size = record.body_size or 0
        omitted = (
            " (body omitted: larger than IDEMPOTENCY_MAX_BODY_BYTES)" if record.body_omitted else ""
        )
        lines.append(f"status         {record.response_status}")
        lines.append(f"body           {size} bytes{omitted}")
        if record.response_headers:
            names = (printable(str(name)) for name, _ in json.loads(record.response_headers))
            lines.append(f"headers        {', '.join(names)}")
    return lines
