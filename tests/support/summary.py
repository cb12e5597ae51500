"""Tables printed at the end of a run (the chaos and failover summaries), xdist-safe.

A scenario's row travels with its test report as a user property, so it reaches the
process that prints the terminal summary whether the tests ran in it or in pytest-xdist
workers (module globals of a worker never reach the controller).
"""

from __future__ import annotations

from typing import Any

import pytest

#: The user property a summary row travels under: ``(section, row name, {column: value})``.
ROW_PROPERTY = "summary_row"


def add_row(node: pytest.Item, section: str, name: str, row: dict[str, Any]) -> None:
    """Add ``name``'s row to the table headed ``section``."""
    node.user_properties.append((ROW_PROPERTY, (section, name, dict(row))))


class SummaryTables:
    """Collects rows from test reports (``pytest_runtest_logreport``) and prints them."""

    def __init__(self) -> None:
        self.sections: dict[str, list[tuple[str, dict[str, Any]]]] = {}

    def collect(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == ROW_PROPERTY:
                section, name, row = value
                self.sections.setdefault(section, []).append((name, row))

    def print(self, terminalreporter: Any) -> None:
        for section, rows in self.sections.items():
            columns = list(dict.fromkeys(c for _, row in rows for c in row))
            width = max(len(name) for name, _ in rows)
            widths = {c: max(len(c), 6) + 2 for c in columns}
            terminalreporter.section(section)
            terminalreporter.write_line(
                "".ljust(width) + "".join(c.rjust(widths[c]) for c in columns)
            )
            for name, row in rows:
                cells = "".join(_cell(row.get(c)).rjust(widths[c]) for c in columns)
                terminalreporter.write_line(name.ljust(width) + cells)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)
