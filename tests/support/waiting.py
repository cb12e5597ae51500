"""Waiting for something in a test: poll a condition, fail naming what was awaited.

Tests assert on outcomes, never on durations: the deadline only turns a hang into
a failure with a message, so it is generous for a loaded 2-core machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    condition: Callable[[], object], what: str, *, within: float = 30.0, interval: float = 0.01
) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)
