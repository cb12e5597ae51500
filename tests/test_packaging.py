"""One version source and one list of configuration names (issue 14, items 1 and 2)."""

from __future__ import annotations

import configparser
import dataclasses
import re
from importlib import metadata
from pathlib import Path

import flask_idempotency
from flask_idempotency import ConfigVars
from flask_idempotency.config import Settings

ROOT = Path(__file__).resolve().parent.parent

#: The names ConfigVars has exported since 0.1.0: they stay.
PUBLIC_NAMES = {
    "DATABASE_URI", "REDIS_URL", "HEADER", "REPLAY_HEADER", "METHODS", "REQUIRED", "TTL",
    "LEASE", "WAIT", "KEY_MAX_LENGTH", "STRICT_HEADER", "STORE_SERVER_ERRORS",
    "MAX_BODY_BYTES", "REPLAY_HEADERS", "FAIL_OPEN", "REDIS_PREFIX", "TABLE",
    "PROBLEM_TYPE_BASE", "ATOMIC", "MAX_WAITERS", "CREATE_TABLE", "REDIS_SOCKET_TIMEOUT",
}  # fmt: skip


def test_i14_1_version_has_one_source_the_package_metadata() -> None:
    """``__version__`` is read from the installed metadata, which setup.cfg alone sets."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    declared = setup["metadata"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", declared), declared
    assert flask_idempotency.__version__ == metadata.version("Flask-Idempotency") == declared
    init = (ROOT / "flask_idempotency" / "__init__.py").read_text(encoding="utf-8")
    assert declared not in init, "the version is written in setup.cfg only"


def test_i14_2_configvars_is_derived_from_the_settings_fields() -> None:
    """Every ``Settings`` field has its ``ConfigVars`` name, and nothing else does, so a
    new setting cannot be missing from it or from the generated configuration page."""
    names = {name for name in vars(ConfigVars) if name.isupper()}
    fields = {field.name.upper() for field in dataclasses.fields(Settings)}
    assert names == fields
    assert names >= PUBLIC_NAMES
    for name in names:
        assert getattr(ConfigVars, name) == "IDEMPOTENCY_" + name
    settings = Settings.from_config({ConfigVars.TTL: 120, ConfigVars.LEASE: 30})
    assert (settings.ttl, settings.lease) == (120.0, 30.0)


def test_i14_2_every_setting_has_help_text_for_the_docs() -> None:
    """The configuration page is generated from the ``#:`` comment above each field."""
    source = (ROOT / "flask_idempotency" / "config.py").read_text(encoding="utf-8")
    body = source.split("class Settings:", 1)[1].split("@classmethod", 1)[0]
    lines = body.splitlines()
    for field in dataclasses.fields(Settings):
        index = next(i for i, line in enumerate(lines) if line.startswith(f"    {field.name}:"))
        assert lines[index - 1].strip().startswith("#:"), f"Settings.{field.name} needs a '#:'"
