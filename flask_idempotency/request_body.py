"""The one reader of a protected request's body (C31).

The fingerprint (C6) needs the body, and a key may sit in a form field (C49), so the
layer reads the body before the view runs, and so before any authentication decorator
on the view could turn an anonymous request away. Flask's ``MAX_CONTENT_LENGTH`` is
unset by default; without a cap of the layer's own one unauthenticated client could
make every worker read and hold a body of any size. ``IDEMPOTENCY_MAX_REQUEST_BYTES``
is that cap, and this module is the only place that reads such a body:

- :func:`limit` puts the cap on the body before anything reads it, the app's own
  ``before_request`` hooks included (it runs first, :mod:`.lifecycle`): a
  ``Content-Length`` over the cap is a 413 before a byte is read; a body without one
  (chunked) is read through :class:`CappedInput`, which answers 413 at the first byte
  past the cap. Werkzeug's own limit stops *silently* where its form parser and
  ``get_data()`` read (they saw ``amount=10`` of ``amount=100000``), so it is not
  relied on: whoever reads the body, a hook, the layer or the view, gets all of it
  or a 413, never a cut body.
- :func:`form` parses a form once, through that cap; :func:`read` hands the fingerprint
  the bytes and keeps them for the view (``get_data()``, ``get_json()``, ``stream``).
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Callable
from typing import IO, Any

from werkzeug.exceptions import ClientDisconnected, RequestEntityTooLarge
from werkzeug.wsgi import LimitedStream, get_content_length

from .problems import RequestTooLarge

#: Set in the environ once :func:`limit` has run for the request: ``(Content-Length,)``
#: as it read it (``None`` without one), so that :func:`read` need not parse it again.
_LIMITED = "flask_idempotency.body_limited"
_CHUNK = 64 * 1024
#: Bodies up to this size are kept in memory for the view; larger ones in a temporary file.
SPOOL_IN_MEMORY = 1024 * 1024


class CappedInput(io.RawIOBase):
    """A body stream never read past ``cap`` bytes: reading the byte after it raises 413.

    It asks the stream under it for at most ``cap + 1`` bytes in all, so a client that
    sends more makes the worker read one byte more than it may, not the rest; every
    read after that raises again. ``read_bytes`` counts what was read (the tests'
    measure of "read before 413").
    """

    def __init__(self, stream: IO[bytes], cap: int, setting: str) -> None:
        super().__init__()
        self._stream = stream
        self._cap = cap
        self._setting = setting
        self.read_bytes = 0
        self.over = False
        #: Files the form parser spooled uploads to: closed when the body runs over,
        #: since the parse that made them stops with the 413 and never hands them on.
        self.spooled: list[IO[bytes]] = []

    def readable(self) -> bool:
        return True

    def _allowed(self, size: int | None) -> int:
        if self.over:
            raise too_large(self._cap, self._setting)
        allowed = self._cap + 1 - self.read_bytes  # at least 1 while not over
        return allowed if size is None or size < 0 else min(size, allowed)

    def _count(self, data: bytes) -> bytes:
        self.read_bytes += len(data)
        if self.read_bytes > self._cap:
            self.over = True
            for spooled in self.spooled:
                spooled.close()
            raise too_large(self._cap, self._setting)
        return data

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        if size == 0:
            return b""
        return self._count(self._stream.read(self._allowed(size)))

    def readall(self) -> bytes:
        chunks: list[bytes] = []
        while True:
            chunk = self.read(_CHUNK)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)

    def readline(self, size: int | None = -1) -> bytes:
        return self._count(self._stream.readline(self._allowed(size)))

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def limit(req: Any, cap: int) -> None:
    """Put the cap on this request's body before anything reads it (once per request).

    ``cap`` is ``IDEMPOTENCY_MAX_REQUEST_BYTES``; the app's own ``MAX_CONTENT_LENGTH``
    (``request.max_content_length``) counts too, whichever is lower. A ``Content-Length``
    over it is refused at once. A body whose end the server finds (chunked:
    ``wsgi.input_terminated``, which Werkzeug then reads to its end whatever
    ``Content-Length`` says) is read through :class:`CappedInput`, whichever stream
    exists: the server's, or one something built already (``request.values`` on a JSON
    body builds it without reading it).
    """
    environ = req.environ
    if _LIMITED in environ:
        return
    # Werkzeug's reading of the environ itself, as ``req.content_length`` gives it, without
    # building the request's header view only for it (a replay never uses that view).
    length = get_content_length(environ)
    environ[_LIMITED] = (length,)
    if "wsgi.input_terminated" not in environ:
        # Werkzeug reads up to Content-Length (refusing one over MAX_CONTENT_LENGTH
        # itself), or nothing without one: only the layer's own cap to judge.
        if cap and length is not None and length > cap:
            raise too_large(cap)
        return
    bound, setting = cap, "IDEMPOTENCY_MAX_REQUEST_BYTES"
    app_limit = req.max_content_length
    if app_limit is not None and (not bound or app_limit < bound):
        bound, setting = app_limit, "MAX_CONTENT_LENGTH"
    if not bound:
        return
    if length is not None and length > bound:
        raise too_large(bound, setting)
    d = req.__dict__
    cached = d.get("_cached_data")
    if cached is not None:  # read whole already, by whatever ran first
        if len(cached) > bound:
            raise too_large(bound, setting)
        return
    stream = d.get("stream")
    if stream is None:  # nothing built it yet: every reader gets the capped one
        capped = CappedInput(environ["wsgi.input"], bound, setting)
        environ["wsgi.input"] = capped
    else:
        capped = CappedInput(stream, bound, setting)
    d["stream"] = capped
    make_file = req._get_file_stream  # where Werkzeug's form parser spools an upload

    def spooled_file(*args: Any, **kwargs: Any) -> Any:
        spooled = make_file(*args, **kwargs)
        capped.spooled.append(spooled)
        return spooled

    d["_get_file_stream"] = spooled_file


def form(req: Any) -> tuple[Any, Any]:
    """The form's fields and uploads, parsed once by Werkzeug through the cap (C49).

    The view gets this parse (``request.form``, ``request.files``). A body over the cap
    stops the parse with 413 at the first byte past it, before any upload past it is
    spooled or hashed.
    """
    return req.form, req.files


def read(
    req: Any, update: Callable[[bytes], Any], *, whole_up_to: int, before: bytes = b""
) -> bytes | None:
    """Read a body that is not a form, once, and keep it for the view.

    Returns the body when it is at most ``whole_up_to`` bytes, kept where ``get_data()``
    keeps it (so the view's ``get_json()`` reuses it). A longer body is fed to ``update``
    chunk by chunk instead (``before`` first), kept in memory up to
    :data:`SPOOL_IN_MEMORY` and in a temporary file above (the view reads it from
    ``request.stream``), and ``None`` is returned. Either way the body was read through
    the cap (:func:`limit`).
    """
    d = req.__dict__
    cached: bytes | None = d.get("_cached_data")
    if cached is not None:  # a hook cached it (a signature check): the body as read
        if len(cached) <= whole_up_to:
            return cached
        update(before)
        update(cached)
        return None
    environ = req.environ
    if "stream" not in d and "wsgi.input_terminated" not in environ:
        limited = environ.get(_LIMITED)
        length = limited[0] if limited is not None else get_content_length(environ)
        if length is not None and length <= whole_up_to:
            return _read_declared(req, environ, length)
    stream = req.stream
    if type(stream) is LimitedStream and "wsgi.input_terminated" not in environ:
        expected: int | None = stream.limit - stream.tell()  # Content-Length: just that
    else:
        expected = None  # read to the end the server finds (through the cap)
    if expected is None or expected <= whole_up_to:
        head = _read_up_to(stream, whole_up_to + 1 if expected is None else expected)
        if len(head) <= whole_up_to:
            req._cached_data = head  # where get_data caches it
            return head
    else:
        head = b""
    update(before)
    _spool(req, stream, head, update)
    return None


def _read_declared(req: Any, environ: dict[str, Any], length: int) -> bytes:
    """A ``Content-Length`` body of at most the size kept whole, nothing read of it yet:
    exactly ``length`` bytes from the server's stream, what Werkzeug's ``LimitedStream``
    would give, without building it (a replay reads every body, and those layers of
    Python were a third of what it spent above a bare route and its Redis GET, issue 36).

    As Werkzeug does: the app's ``MAX_CONTENT_LENGTH`` refuses a longer body before a
    byte is read, and a body that ends early is the client gone (400). The view gets
    the bytes from ``get_data()`` and ``get_json()``, and ``request.stream`` is spent,
    as after Werkzeug's own ``get_data()``.
    """
    app_limit = req.max_content_length
    if app_limit is not None and length > app_limit:
        raise RequestEntityTooLarge()
    body = _read_up_to(environ["wsgi.input"], length) if length else b""
    if len(body) < length:
        raise ClientDisconnected()
    d = req.__dict__
    d["stream"] = io.BytesIO()  # read to its end, like the stream it stands for
    d["_cached_data"] = body  # where get_data caches it
    return body


def _read_up_to(stream: IO[bytes], size: int) -> bytes:
    """At most ``size`` bytes, without Werkzeug's 64 KiB scratch buffer for a small body.

    A ``Content-Length`` body that ends early raises ``ClientDisconnected`` (Werkzeug's
    stream does), as in ``get_data()``.
    """
    chunks = []
    remaining = size
    while remaining > 0:
        chunk = stream.read(min(remaining, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _spool(req: Any, stream: IO[bytes], head: bytes, update: Callable[[bytes], Any]) -> None:
    """Feed ``head`` and the rest of ``stream`` to ``update``, keeping it all for the view:
    in memory up to :data:`SPOOL_IN_MEMORY`, in a temporary file above."""
    # Not a context manager: the spool outlives this call, closed with the request.
    spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY)  # noqa: SIM115
    try:
        if head:
            update(head)
            spool.write(head)
        for chunk in iter(lambda: stream.read(_CHUNK), b""):
            update(chunk)
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    req.__dict__["stream"] = spool
    req.close = _closing(req.close, spool)


def _closing(close: Any, spool: IO[bytes]) -> Any:
    def close_both() -> None:
        try:
            close()
        finally:
            spool.close()

    return close_both


def too_large(cap: int, setting: str = "IDEMPOTENCY_MAX_REQUEST_BYTES") -> RequestTooLarge:
    return RequestTooLarge(
        f"The request body is larger than the {cap} bytes an idempotent request may send"
        f" ({setting})."
    )
