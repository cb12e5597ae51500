"""Log lines that would otherwise repeat once per request: one, then a count.

Used for the durable store's outages (:mod:`.state`), unsafe cached values
(:mod:`.cache.redis`) and requests refused a place to wait (:mod:`.notify.hub`).
A leaf module, so that any part of the package can use it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("flask_idempotency")


class ThrottledLog:
    """Log a recurring failure once, then at most once per ``every`` seconds with a count.

    During a database outage every protected request fails the same way; one line
    per request would bury everything else in the log.
    """

    def __init__(self, every: float = 10.0) -> None:
        self._every = every
        self._next = 0.0
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._suppressed += 1
                return
            suppressed, self._suppressed = self._suppressed, 0
            self._next = now + self._every
        if suppressed:
            message += f" ({suppressed} more since the last such line)"
        log.warning(message, *args)
