"""The docs a reader gets: what ``make docs`` needs, and pages that point somewhere
(issue 23 items 5 and 7).

- The ``docs`` extra holds everything the pages' autodoc directives import, so
  ``make docs`` works on a fresh clone without ``make test`` having installed
  the ``dev`` extra first; the screenshots need Chromium only where the docs say
  so, and ``make docs`` without it still builds and checks the site.
- No page cites what a reader cannot open (the research notes' ``R86``, the
  unpublished ``CONTRACT §1``); the README lists every page of the site; a page
  whose content is a directive (generated or included) still gives a reader on
  the repository host a sentence and a link; development.md says what the
  Makefile does.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _requirements(text: str) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [line for line in lines if line]


# -- item 5: make docs on a fresh clone --------------------------------------------------------


def _documented_modules() -> set[str]:
    """Every module an autodoc directive of the pages imports."""
    modules: set[str] = set()
    pattern = re.compile(r"\.\. auto(class|function|module|exception)::\s*(\S+)")
    for page in DOCS.glob("*.md"):
        for kind, target in pattern.findall(page.read_text("utf-8")):
            if kind == "module":
                modules.add(target)
                continue
            parts = target.split(".")
            module = parts[0]
            for cut in range(2, len(parts) + 1):  # the longest prefix that is a module
                name = ".".join(parts[:cut])
                try:
                    if importlib.util.find_spec(name) is None:
                        break
                except (ModuleNotFoundError, AttributeError):  # a class of a plain module
                    break
                module = name
            modules.add(module)
    return modules


def _allowed_distributions() -> set[str]:
    """install_requires + the docs extra, and what they require in turn (when installed)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    config = _setup_cfg()
    wanted = _requirements(config["options"]["install_requires"])
    wanted += _requirements(config["options.extras_require"]["docs"])
    allowed: set[str] = set()
    todo = [Requirement(text) for text in wanted]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in allowed:
            continue
        allowed.add(name)
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (Sphinx, furo): imported by nothing we import
        todo += [Requirement(text) for text in requires]
    return allowed


#: Runs in a fresh interpreter: refuse every third-party import outside the allowed
#: distributions, then import the documented modules.
_PROBE = r"""
import importlib, importlib.abc, importlib.metadata, json, sys
allowed, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
from packaging.utils import canonicalize_name
owners = importlib.metadata.packages_distributions()
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top in ("flask_idempotency", "_distutils_hack"):
            return None
        dists = {canonicalize_name(d) for d in owners.get(top, [])}
        if not dists or dists & set(allowed):  # no distribution: the interpreter's own
            return None
        raise ImportError(f"{name} (distribution {sorted(dists)}) is not in the docs extra")
sys.meta_path.insert(0, Refuse())
for module in modules:
    importlib.import_module(module)
print("imported", len(modules))
"""


def test_i23_5_the_docs_extra_holds_what_autodoc_imports() -> None:
    """Before the fix: ``flask_idempotency.testing`` imports pytest, which only the dev
    extra brought, so ``make docs`` failed on a fresh clone."""
    modules = sorted(_documented_modules())
    assert "flask_idempotency.testing" in modules and "flask_idempotency.telemetry.otel" in modules
    allowed = sorted(_allowed_distributions())
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(allowed), json.dumps(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]


def _check_site():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_site", DOCS / "check_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_i23_5_make_docs_without_chromium_skips_the_screenshots_and_says_so(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    check_site = _check_site()
    monkeypatch.setattr(check_site.shutil, "which", lambda name: None)
    monkeypatch.delenv("CI", raising=False)
    said = check_site.take_screenshots(tmp_path)
    assert said.startswith("screenshots skipped") and "chromium" in said
    assert not (tmp_path / "screenshots").exists()
    monkeypatch.setenv("CI", "true")  # CI has Chromium (.ci/run, make system-deps): no skip
    with pytest.raises(SystemExit, match="Chromium"):
        check_site.take_screenshots(tmp_path)


def test_i23_5_the_readme_and_development_page_say_where_chromium_is_needed() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    documentation = readme[readme.index("## Documentation") :]
    assert "Chromium" in documentation and "fresh" in documentation
    development = (DOCS / "development.md").read_text("utf-8")
    [row] = [line for line in development.splitlines() if line.startswith("| `make docs` |")]
    assert "Chromium" in row and "skipped" in row and "fresh clone" in row


# -- item 7: docs that point somewhere -----------------------------------------------------------


def _reader_text() -> dict[str, str]:
    """What a reader sees: the pages, the README, and the comments the configuration
    page is generated from."""
    texts = {str(p.relative_to(ROOT)): p.read_text("utf-8") for p in DOCS.glob("*.md")}
    texts["README.md"] = (ROOT / "README.md").read_text("utf-8")
    config = (ROOT / "flask_idempotency" / "config.py").read_text("utf-8")
    body = config[config.index("class Settings:") : config.index("def header_environ_key")]
    texts["Settings #: comments"] = "\n".join(
        line for line in body.splitlines() if line.strip().startswith("#:")
    )
    return texts


def test_i23_7_no_page_cites_what_a_reader_cannot_open() -> None:
    """R-numbers and X-numbers are the research notes'; the contract file is not
    published: the rules are, on the guarantees page (C1...)."""
    unpublished = re.compile(r"\bR\d{1,3}\b|\bX\d{1,2}\b|CONTRACT|§\d")
    found = [
        f"{where}: {match.group()}"
        for where, text in _reader_text().items()
        for match in unpublished.finditer(text)
    ]
    assert found == []


def test_i23_7_the_readme_lists_every_page_of_the_site() -> None:
    index = (DOCS / "index.md").read_text("utf-8")
    pages = {
        line.strip()
        for block in re.findall(r"```\{toctree\}(.*?)```", index, flags=re.DOTALL)
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith(":")
    }
    readme = (ROOT / "README.md").read_text("utf-8")
    missing = sorted(p for p in pages - {"changes"} if f"(docs/{p}.md" not in readme)
    assert missing == []
    assert "(CHANGES.rst)" in readme


def test_i23_7_a_page_made_of_a_directive_still_links_its_source() -> None:
    """On the repository host a ``{literalinclude}`` or ``{settings-table}`` renders as
    nothing: the sentence around it must link what it would show."""
    for page in DOCS.glob("*.md"):
        text = page.read_text("utf-8")
        for target in re.findall(r"```\{literalinclude\}\s+(\S+)", text):
            assert f"]({target})" in text, f"{page.name}: no link to {target}"
        if "{settings-table}" in text:
            assert "](../flask_idempotency/config.py)" in text, page.name


def test_i23_7_development_page_says_what_make_run_installs() -> None:
    """The Makefile's run target installs the example's needs, not the project."""
    makefile = (ROOT / "Makefile").read_text("utf-8")
    run_stamp = makefile[makefile.index("$(RUN_STAMP):") :].split("\n\n", 1)[0]
    assert "install" in run_stamp and "-e ." not in run_stamp and "'.[" not in run_stamp
    development = (DOCS / "development.md").read_text("utf-8")
    assert "install the project into it on first" not in development
    assert "`make run` installs only what the example needs, not the\nproject" in development
