"""Sphinx configuration: ``make docs`` builds docs/_build/html with warnings as errors."""

from __future__ import annotations

import os
import sys
from importlib import metadata

sys.path.insert(0, os.path.abspath("_ext"))

project = "Flask-Idempotency"
author = "the Flask-Idempotency authors"
copyright = "2026, the Flask-Idempotency authors"
release = metadata.version("Flask-Idempotency")  # the one version source
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "idempotency_docs",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "check_site.py"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}

html_theme = "furo"
html_title = f"Flask-Idempotency {release}"
html_static_path: list[str] = []
html_theme_options = {"source_directory": "docs/"}
