"""Fixtures of the failover test: a fresh Patroni pair per test, and the summary table.

Each test gets its own pair (etcd, two PostgreSQL nodes under Patroni), since the test
kills one node; everything is stopped by pid at the end, also when the test fails, and
the servers' logs are copied into the test's ``tmp_path`` first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import service_missing
from tests.support.patroni import PatroniCluster, missing_parts
from tests.support.summary import add_row

SECTION = "failover summary (Patroni pair, primary SIGKILLed mid-storm)"


@pytest.fixture
def patroni_pair(tmp_path: Path) -> Iterator[PatroniCluster]:
    """A synchronous Patroni pair, leader and sync standby both streaming."""
    missing = missing_parts()
    if missing:
        service_missing("a Patroni pair", "missing " + ", ".join(missing))
    try:
        import psycopg2  # noqa: F401 - the harness probes the nodes with it
    except ImportError as exc:
        service_missing("the psycopg2 driver", str(exc))
    cluster = start_pair(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()
        cluster.keep_logs(tmp_path / "patroni-logs")
        cluster.remove()


def start_pair(tmp_path: Path, attempts: int = 2) -> PatroniCluster:
    """Start a pair; once more on fresh ports if the first start fails (a free port
    taken between ``free_port()`` and the server's bind, or a slow bootstrap)."""
    for attempt in range(1, attempts + 1):
        cluster = PatroniCluster(synchronous=True)
        try:
            return cluster.start()  # stops what it started when it fails
        except RuntimeError:
            cluster.keep_logs(tmp_path / f"patroni-logs-failed-start-{attempt}")
            cluster.remove()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def failover_summary(request: pytest.FixtureRequest) -> Callable[[str, dict[str, Any]], None]:
    """``failover_summary(name, figures)`` adds a row to the table printed at the end
    (tests/support/summary.py)."""

    def report(name: str, figures: dict[str, Any]) -> None:
        add_row(request.node, SECTION, name, figures)

    return report
