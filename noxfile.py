"""Supported versions, tested rather than claimed: ``make test-versions`` (nox).

Two sessions, each in its own virtualenv on its own interpreter:

- ``oldest``: the oldest Python this machine provides that ``python_requires``
  allows, with every runtime dependency pinned to the lowest version
  ``setup.cfg`` accepts (``OLDEST``);
- ``newest``: the newest Python here, with the newest release of everything.

Both run the fast suite (``-m "not slow"``) plus the real PostgreSQL and Redis
smoke tests (``SMOKE``), on both PostgreSQL drivers; given test files as
positional arguments (``nox -- tests/test_keys.py …``) they run those instead of
the fast suite. CI passes the files that exercise Flask, Werkzeug, SQLAlchemy and
redis-py most directly (``.ci/run``), so both sets fit in its time.
Interpreters are looked up on PATH and in pyenv's versions directory
(CI machines have no way to download Python builds).
"""

from __future__ import annotations

import configparser
import glob
import os
import re
from pathlib import Path

import nox

OLDEST_PYTHON = "3.10"
NEWEST_PYTHON = "3.13"

#: The lowest version of each runtime dependency setup.cfg accepts, plus the lowest
#: Flask-SQLAlchemy / Flask-Migrate / Flask-Login / Flask-Cors the tests work with beside them
#: (Flask-SQLAlchemy 3.1 needs SQLAlchemy 2.0.16, so the oldest set uses 3.0.5).
OLDEST = [
    "Flask==2.3.0",
    "Werkzeug==2.3.8",  # setup.cfg's floor: 2.3.0-2.3.7 parse big multipart bodies in O(n²)
    "SQLAlchemy==2.0.0",
    "blinker==1.6.2",
    "redis==5.0.0",
    "psycopg2-binary==2.9.5",
    "psycopg[binary]==3.1.8",
    "Flask-SQLAlchemy==3.0.5",
    "Flask-Migrate==4.0.2",  # the first with `flask db check`, which the tests use
    "Flask-Login==0.6.3",
    "Flask-Cors==4.0.0",
]

#: Lint tools and nox itself: not needed to run the tests.
NOT_FOR_TESTS = {"ruff", "mypy", "nox"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _test_requirements() -> list[str]:
    """The ``dev`` extra of setup.cfg, so a new test dependency reaches both sessions."""
    parser = configparser.ConfigParser()
    parser.read(Path(__file__).with_name("setup.cfg"))
    lines = parser["options.extras_require"]["dev"].splitlines()
    wanted = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return [req for req in wanted if _name(req) not in NOT_FOR_TESTS]


#: The real-server tests both sessions add to the fast suite (they are marked slow).
SMOKE = ["tests/test_pg_smoke.py", "tests/test_redis_real.py", "tests/deploy/test_pgbouncer.py"]

nox.options.sessions = ["oldest", "newest"]
nox.options.reuse_existing_virtualenvs = True


def _add_pyenv_interpreters() -> None:
    """Let nox find ``python3.10`` etc. in pyenv's versions when no shim exposes them."""
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    found = sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin")), reverse=True)
    if found:
        os.environ["PATH"] = os.pathsep.join([*found, os.environ.get("PATH", "")])


_add_pyenv_interpreters()


#: pytest on the suite's parallel workers, as ``make test`` runs it (tests/support/parallel.py).
PYTEST = ("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "4")


def _pytest(session: nox.Session) -> None:
    if session.posargs:  # a chosen set of test files (CI's, see .ci/run) plus the smoke tests
        session.run(*PYTEST, *session.posargs, *SMOKE)  # one run: no marker filter
        return
    session.run(*PYTEST, "-m", "not slow")
    session.run(*PYTEST, *SMOKE)  # marked slow: a run of their own


@nox.session(python=OLDEST_PYTHON)
def oldest(session: nox.Session) -> None:
    """The oldest supported set: Python 3.10, Flask 2.3, SQLAlchemy 2.0, redis-py 5.0."""
    pinned = {_name(pin) for pin in OLDEST}
    tools = [req for req in _test_requirements() if _name(req) not in pinned]
    session.install(*OLDEST, *tools)
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pip", "check")
    session.run("python", "-m", "pip", "freeze", "--exclude-editable")
    _pytest(session)


@nox.session(python=NEWEST_PYTHON)
def newest(session: nox.Session) -> None:
    """The newest Python here with the newest release of every dependency, hiredis included
    (the ``speedups`` extra: redis-py parses every reply with it)."""
    session.install("--upgrade", "-e", ".[redis,postgresql,psycopg,speedups]", *_test_requirements())
    session.run("python", "-m", "pip", "freeze", "--exclude-editable")
    _pytest(session)
