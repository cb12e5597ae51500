"""Running the suite on several pytest-xdist workers (``make test`` passes ``-n``).

Each worker is a process of its own, and everything a test touches is already private
to it: PostgreSQL and MariaDB databases named by the worker's pid, tables named by a
uuid, its own ``tmp_path``, servers on free ports, Redis keys under a store origin of
their own. Two things need the scheduler's help, and this module gives it:

- **A server started once for many tests** (a module- or session-scoped fixture: a
  Redis Cluster, a Sentinel group, PgBouncer, a private PostgreSQL or MariaDB) would
  be started again on every worker that runs one of its tests. The tests that share
  one get one ``xdist_group``, so ``--dist loadgroup`` runs them on one worker, one
  after another, and the server starts once per run.
- **Two cores.** A test marked ``heavy`` keeps the CPU busy for many seconds (a load
  storm against gunicorn workers, a SIGKILL campaign, a pip install). Four at once
  would starve each other and everything else, and their deadlines are generous but
  not endless: they run in ``HEAVY_LANES`` lanes (groups), so at most that many run at
  any moment, the other workers taking the tests that mostly wait.
- **A run ends when its slowest worker does.** Work is handed out in collection order,
  so the units (a group, or a single test) are put heaviest first, by the durations the
  last full run recorded (``tests/durations.json``, written by ``--record-durations``):
  longest-processing-time-first. A test the file does not know yet counts as light.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

#: Where each test's last measured seconds (setup + call + teardown) are kept.
DURATIONS_FILE = Path(__file__).resolve().parent.parent / "durations.json"

#: Module- and session-scoped fixtures that start a server for many tests.
SHARED_SERVER_FIXTURES = frozenset(
    {
        # tests/test_topologies.py
        "single_node",
        "cluster",
        "sentinel_group",
        "single_node_redis6",
        "cluster_redis6",
        # tests/deploy/
        "pgbouncer",
        "matrix_redis",
        # private PostgreSQL / MariaDB / Redis servers of one module
        "private_pg",
        "private_mariadb",
        "berlin_mariadb",
        "server",
    }
)

#: How many heavy tests may run at once: one per core.
HEAVY_LANES = 2

_GROUP_SUFFIX = re.compile(r"@[^/]*$")
_SERVERS = pytest.StashKey[list[str]]()


def _shared_servers(item: pytest.Item) -> list[str]:
    """The shared-server fixtures ``item`` uses, each named with where it is defined
    (two modules may each define a ``server``). A module that requests one by name at
    run time (``request.getfixturevalue``) lists it in ``SHARED_SERVERS``."""
    manager = item.session._fixturemanager
    wanted = set(getattr(item, "fixturenames", ())) | set(
        getattr(getattr(item, "module", None), "SHARED_SERVERS", ())
    )
    names = []
    for name in sorted(wanted & SHARED_SERVER_FIXTURES):
        definitions = manager.getfixturedefs(name, item)
        if not definitions or definitions[-1].scope not in ("module", "session", "package"):
            continue
        names.append(f"{definitions[-1].baseid or '.'}::{name}")
    return names


def group_shared_servers(items: list[pytest.Item]) -> None:
    """Give the tests that share a server one ``xdist_group``, and put heavy tests in lanes.

    Servers used together by one test join one group (union-find), so each server is
    started on exactly one worker. A group with a heavy test, or a heavy test of its
    own, then joins one of ``HEAVY_LANES`` lanes, heaviest first into the lightest lane.
    """
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for item in items:
        servers = _shared_servers(item)
        item.stash[_SERVERS] = servers
        for other in servers[1:]:
            parent[root(other)] = root(servers[0])
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        servers = item.stash[_SERVERS]
        units.setdefault(root(servers[0]) if servers else item.nodeid, []).append(item)
    known = load_durations()
    heavy = {
        unit: sum(known.get(item.nodeid, 1.0) for item in members)
        for unit, members in units.items()
        if any(item.get_closest_marker("heavy") for item in members)
    }
    lanes = [0.0] * HEAVY_LANES
    lane_of: dict[str, int] = {}
    for unit in sorted(heavy, key=lambda u: -heavy[u]):
        lane_of[unit] = lanes.index(min(lanes))
        lanes[lane_of[unit]] += heavy[unit]
    for unit, members in units.items():
        if unit in lane_of:
            group = f"heavy-lane-{lane_of[unit] + 1}"
        elif unit != members[0].nodeid or len(members) > 1:
            group = re.sub(r"[^A-Za-z0-9_.:-]", "_", unit)
        else:
            continue
        for item in members:
            item.add_marker(pytest.mark.xdist_group(group))


def _group_of(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


@pytest.hookimpl(trylast=True)  # after pytest has ordered the tests by their fixtures
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heaviest_first(items)


def heaviest_first(items: list[pytest.Item]) -> None:
    """Order ``items`` so the heaviest units come first; a group's tests stay together,
    in their own order (their shared fixtures are set up once)."""
    known = load_durations()
    if not known:
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(_group_of(item) or item.nodeid, []).append(item)
    weight = {
        unit: sum(known.get(_GROUP_SUFFIX.sub("", item.nodeid), 0.0) for item in members)
        for unit, members in units.items()
    }
    order = sorted(units, key=lambda unit: -weight[unit])  # stable: ties keep their order
    items[:] = [item for unit in order for item in units[unit]]


def load_durations() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


class DurationRecorder:
    """``--record-durations``: write each test's seconds to ``tests/durations.json`` at
    the end of a run (in the process that receives every report, xdist's or the only one)."""

    #: Tests shorter than this are left out: they do not change the order.
    SHORTEST = 0.5

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = _GROUP_SUFFIX.sub("", report.nodeid)
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: Any) -> None:
        if hasattr(session.config, "workerinput"):
            return  # a worker: the controller writes the file
        kept = {k: round(v, 1) for k, v in sorted(self.seconds.items()) if v >= self.SHORTEST}
        if kept:
            DURATIONS_FILE.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
