"""Check the built docs site: ``python docs/check_site.py docs/_build`` (run by ``make docs``).

1. Every rule number cited in the code, tests, recipes or pages (``C12``) has its
   anchor on the guarantees page, so a reader can follow any citation.
2. The configuration page lists every ``app.config`` key the code reads.
3. Headless Chromium renders the home page and the API reference; the screenshots
   are kept in ``docs/_build/screenshots/`` to look at (they are not committed).
   Without Chromium on ``PATH`` this step is skipped with a note (the site is still
   built and checked); with ``CI=true`` a missing Chromium fails instead, as a
   missing server fails the test suite there.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"\bC([1-9][0-9]?)\b")
SOURCES = ("flask_idempotency", "tests", "example", "recipes", "docs")
PAGES = {"home": "index.html", "api": "api.html"}


def cited_rules() -> dict[str, str]:
    """Each cited rule number, with one place that cites it."""
    cited: dict[str, str] = {}
    files = [ROOT / "README.md"]
    for folder in SOURCES:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".rst")]
    for path in files:
        if "_build" in path.parts:
            continue
        for number, line in _numbers(path):
            cited.setdefault(f"c{number}", f"{path.relative_to(ROOT)}:{line}")
    return cited


def _numbers(path: Path) -> list[tuple[str, int]]:
    found = []
    for index, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        found += [(match.group(1), index) for match in CITED.finditer(line)]
    return found


CHROMIUM_MISSING = (
    "the screenshots need headless Chromium on PATH (apt-get install chromium,"
    " or `make system-deps`)"
)


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def take_screenshots(build: Path) -> str:
    """Screenshots of the home page and the API reference; what was done, as a phrase."""
    browser = chromium()
    if browser is None:
        if os.environ.get("CI", "").lower() == "true":
            sys.exit(f"check_site: {CHROMIUM_MISSING}")
        return f"screenshots skipped: {CHROMIUM_MISSING}"
    shots = build / "screenshots"
    shots.mkdir(exist_ok=True)
    for name, page in PAGES.items():
        screenshot(browser, build / "html" / page, shots / f"{name}.png")
    try:
        where = shots.relative_to(ROOT)
    except ValueError:
        where = shots
    return f"screenshots in {where}"


def screenshot(browser: str, page: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="idem-docs-chromium-") as profile:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--window-size=1280,1400",
                f"--screenshot={out}",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    if not out.is_file() or out.stat().st_size < 20_000:
        sys.exit(f"check_site: the screenshot of {page.name} is missing or blank ({out})")


def main(build: Path) -> None:
    html = build / "html"
    problems = []

    anchors = set(re.findall(r'id="(c\d+)"', (html / "guarantees.html").read_text("utf-8")))
    for label, where in sorted(cited_rules().items()):
        if label not in anchors:
            problems.append(f"{label.upper()} is cited ({where}) but the guarantees page lacks it")

    sys.path.insert(0, str(ROOT))
    from flask_idempotency import ConfigVars

    configuration = (html / "configuration.html").read_text("utf-8")
    for name in sorted(k for k in vars(ConfigVars) if k.isupper()):
        if getattr(ConfigVars, name) not in configuration:
            problems.append(f"{getattr(ConfigVars, name)} is missing from the configuration page")

    if problems:
        sys.exit("check_site:\n  " + "\n  ".join(problems))

    done = take_screenshots(build)
    print(f"check_site: OK: {len(anchors)} rule anchors, every cited rule resolves; {done}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/_build").resolve())
