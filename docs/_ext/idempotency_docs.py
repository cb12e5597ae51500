"""Sphinx helpers for this project's docs, so the pages cannot drift from the code.

- ``settings-table``: the configuration reference, read from the fields of
  ``flask_idempotency.config.Settings`` and the ``#:`` comment above each one.
  A field without a comment is a build warning, and ``make docs`` turns warnings
  into errors.
- Every rule number written in prose (``C12``) becomes a link to its anchor on the
  guarantees page; a number with no rule behind it is a build warning too.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from docutils import nodes
from pygments.lexers.special import TextLexer
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.transforms import SphinxTransform
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

RULE = re.compile(r"\bC([1-9][0-9]?)\b")
LITERAL = re.compile(r"``(.+?)``")
#: Where rule numbers stay plain text: code, links, titles, signatures.
NO_LINKS = (
    nodes.literal,
    nodes.literal_block,
    nodes.reference,
    nodes.target,
    nodes.title,
    nodes.raw,
    nodes.FixedTextElement,
    addnodes.pending_xref,
    addnodes.desc_signature,
    addnodes.toctree,
)


def _default(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, frozenset):
        return ", ".join(sorted(value)) or "none"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _inline(text: str) -> list[nodes.Node]:
    """The ``#:`` comments use only ``literal`` markup; everything else is plain text."""
    result: list[nodes.Node] = []
    for index, part in enumerate(LITERAL.split(text)):
        if part:
            result.append(nodes.literal(part, part) if index % 2 else nodes.Text(part))
    return result


class SettingsTable(SphinxDirective):
    """``.. settings-table::`` — one entry per ``Settings`` field: key, meaning, default, type."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from flask_idempotency import config

        self.env.note_dependency(config.__file__)
        comments = ModuleAnalyzer.for_module(config.__name__).find_attr_docs()
        std = self.env.domains.standard_domain

        entries = nodes.definition_list(classes=["settings"])
        for field in dataclasses.fields(config.Settings):
            key = config.config_key(field.name)
            if getattr(config.ConfigVars, field.name.upper(), None) != key:
                logger.warning("ConfigVars.%s is not %s", field.name.upper(), key)
            help_lines = comments.get(("Settings", field.name))
            if not help_lines or not "".join(help_lines).strip():
                logger.warning(
                    "Settings.%s has no '#:' comment: the configuration page needs one"
                    " (flask_idempotency/config.py)",
                    field.name,
                    location=self.get_location(),
                )
                help_lines = [""]
            help_text = " ".join(line.strip() for line in help_lines if line.strip())
            node_id = key.lower().replace("_", "-")
            std.note_object("confval", key, node_id, location=self.get_location())
            default = _default(field.default if field.default is not dataclasses.MISSING else None)

            item = nodes.definition_list_item(ids=[node_id])
            term = nodes.term()
            term += nodes.literal(key, key)
            item += term
            definition = nodes.definition()
            meaning = nodes.paragraph()
            meaning.extend(_inline(help_text))
            facts = nodes.paragraph(classes=["setting-default"])
            facts += nodes.Text("Default: ")
            facts += nodes.literal(default, default)
            facts += nodes.Text(" · type: ")
            facts += nodes.literal(str(field.type), str(field.type))
            definition += [meaning, facts]
            item += definition
            entries += item
        return [entries]


class RuleLinks(SphinxTransform):
    """Turn ``C12`` in prose into a link to the rule's anchor (``guarantees.html#c12``)."""

    default_priority = 500

    def apply(self, **kwargs: Any) -> None:
        for text in list(self.document.findall(nodes.Text)):
            parent = text.parent
            if parent is None or not RULE.search(text.astext()):
                continue
            if any(isinstance(node, NO_LINKS) for node in _ancestors(text)):
                continue
            parent.replace(text, self._linked(text.astext()))

    def _linked(self, source: str) -> list[nodes.Node]:
        result: list[nodes.Node] = []
        position = 0
        for match in RULE.finditer(source):
            if match.start() > position:
                result.append(nodes.Text(source[position : match.start()]))
            label = "c" + match.group(1)
            xref = addnodes.pending_xref(
                "",
                refdomain="std",
                reftype="ref",
                reftarget=label,
                refexplicit=True,
                refwarn=True,
            )
            xref += nodes.inline(match.group(0), match.group(0), classes=["rule-ref"])
            result.append(xref)
            position = match.end()
        if position < len(source):
            result.append(nodes.Text(source[position:]))
        return result


def _ancestors(node: nodes.Node) -> list[nodes.Node]:
    found = []
    while node.parent is not None:
        node = node.parent
        found.append(node)
    return found


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("settings-table", SettingsTable)
    app.add_lexer("cron", TextLexer)  # crontab lines in deployment.md and operations.md
    app.add_transform(RuleLinks)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
