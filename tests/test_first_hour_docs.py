"""What a new user reads in the first hour says what they must do (issue 35 items 4 and 6).

- The README's and the quick start's install and first app say the table step where
  the database URL is set (``flask idempotency create-table``, or
  ``IDEMPOTENCY_CREATE_TABLE = True`` for a first try, or the migration), and name
  the scope choices in one line.
- No page, and no message the package prints, tells the user to
  ``pip install 'Flask-Idempotency[…]'``: the package is on no index yet (the
  observability page did).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_i35_4_readme_and_quick_start_say_the_table_step_where_the_url_is_set() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    quickstart = (DOCS / "quickstart.md").read_text("utf-8")
    for where, text in (("README.md", readme), ("docs/quickstart.md", quickstart)):
        at = text.index("IDEMPOTENCY_DATABASE_URI")
        nearby = text[at - 600 : at + 900]
        for step in (
            "idempotency create-table",
            "IDEMPOTENCY_CREATE_TABLE",
            "flask db upgrade",
        ):
            assert step in nearby, f"{where}: no {step!r} beside IDEMPOTENCY_DATABASE_URI"
        assert "503" in nearby, f"{where}: does not say what happens without the table"


def test_i35_4_readme_and_quick_start_name_the_scope_choices() -> None:
    """One paragraph (or list item) names every way a key gets its scope."""
    for path in (ROOT / "README.md", DOCS / "quickstart.md"):
        blocks = re.split(r"\n\s*\n|\n- ", path.read_text("utf-8"))
        named = [
            block
            for block in blocks
            if all(
                choice in block.replace("\n", " ")
                for choice in (
                    "scope",
                    "loader",
                    "Flask-Login",
                    "Authorization",
                    "IDEMPOTENCY_SCOPE_SECRET",
                    "SECRET_KEY",
                    "anonymous",
                )
            )
        ]
        assert named, f"{path.name}: no one place names the scope choices"


def test_i35_6_no_page_or_message_installs_from_an_index_the_package_is_not_on() -> None:
    wrong = re.compile(r"pip install ['\"]?Flask-Idempotency\[", re.IGNORECASE)
    found = []
    for path in [
        ROOT / "README.md",
        *DOCS.glob("*.md"),
        *(ROOT / "flask_idempotency").rglob("*.py"),
    ]:
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if wrong.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []
