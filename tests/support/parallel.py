"""Running the suite on several pytest-xdist workers (``make test`` passes ``-n``).

Each worker is a process of its own, and everything a test touches is already private
to it: PostgreSQL and MariaDB databases named by the worker's pid, tables named by a
uuid, its own ``tmp_path``, servers on free ports, Redis keys under a store origin of
their own. Two things need the scheduler's help, and this module gives it:

- **A server started once for many tests** (a module- or session-scoped fixture: a
  Redis Cluster, a Sentinel group, PgBouncer, a private PostgreSQL or MariaDB) would
  be started again on every worker that runs one of its tests. The tests that share
  one form a group, which :class:`GroupScheduling` hands to one worker as one unit:
  they run one after another and the server starts once per run.
- **Two cores.** A test marked ``heavy`` keeps the CPU busy for many seconds (a load
  storm against gunicorn workers, a SIGKILL campaign, a pip install). Four at once
  would starve each other and everything else, and their deadlines are generous but
  not endless: they run in ``HEAVY_LANES`` lanes (groups), so at most that many run at
  any moment, the other workers taking the tests that mostly wait.
- **A run ends when its slowest worker does.** Work is handed out in collection order,
  so the units (a group, or a single test) are put heaviest first, by the durations the
  last full run recorded (``tests/durations.json``, written by ``--record-durations``):
  longest-processing-time-first. A test the file does not know yet counts as light.

The groups are found where the tests are collected, in the workers, and reach the
scheduler in the controller through a file the controller names before it starts them
(``GROUPS_ENV``). xdist's own ``--dist loadgroup`` does the same by appending the group
to each test id, which pytest 9.2 no longer lets a plugin change: the tests were then
spread as if ungrouped (pytest-xdist issue 1386), every worker starting its own Redis
Cluster and heavy tests running four at once.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest-xdist not installed: the suite runs in one process
    LoadScopeScheduling = object

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
        "small_packet_mariadb",  # tests/fault_matrix/test_refusals.py
        "server",
    }
)

#: How many heavy tests may run at once: one per core (``IDEMPOTENCY_TEST_HEAVY_LANES``
#: changes it, to try another split on another machine).
HEAVY_LANES = int(os.environ.get("IDEMPOTENCY_TEST_HEAVY_LANES", "2"))

#: Names the file in which workers leave each grouped test's group for the controller.
GROUPS_ENV = "IDEMPOTENCY_TEST_GROUPS_FILE"

_SERVERS = pytest.StashKey[list[str]]()
_GROUP = pytest.StashKey[str]()


def _shared_servers(item: pytest.Item) -> list[str]:
    """The shared-server fixtures ``item`` uses, each named with where it is defined
    (two modules may each define a ``server``). A module whose tests request one by name
    at run time (``request.getfixturevalue``) says which with a function
    ``shared_servers(item)`` returning their names."""
    manager = item.session._fixturemanager
    wanted = set(getattr(item, "fixturenames", ()))
    asked_by_name = getattr(getattr(item, "module", None), "shared_servers", None)
    if asked_by_name is not None:
        wanted |= set(asked_by_name(item))
    names = []
    for name in sorted(wanted & SHARED_SERVER_FIXTURES):
        definitions = manager.getfixturedefs(name, item)
        if not definitions or definitions[-1].scope not in ("module", "session", "package"):
            continue
        names.append(f"{definitions[-1].baseid or '.'}::{name}")
    return names


def group_shared_servers(items: list[pytest.Item]) -> None:
    """Give the tests that share a server one group, and put heavy tests in lanes.

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
            group = unit
        else:
            continue
        for item in members:
            item.stash[_GROUP] = group


def _group_of(item: pytest.Item) -> str | None:
    return item.stash.get(_GROUP, None)


# -- the hooks (this module is registered as a plugin by tests/conftest.py) -----------


def pytest_configure(config: pytest.Config) -> None:
    """In the controller of a parallel run: name the file the workers write the groups
    to (they inherit the environment when they are started, after this)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    handle, path = tempfile.mkstemp(prefix="idem-test-groups-", suffix=".json")
    os.close(handle)
    os.environ[GROUPS_ENV] = path


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        path = os.environ.pop(GROUPS_ENV, None)
        if path:
            Path(path).unlink(missing_ok=True)


@pytest.hookimpl(trylast=True)  # after pytest has ordered the tests by their fixtures
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heaviest_first(items)
    path = os.environ.get(GROUPS_ENV)
    if path and hasattr(config, "workerinput"):
        groups = {item.nodeid: group for item in items if (group := _group_of(item))}
        # Every worker writes the same; each replaces the file whole, never half-written.
        temporary = f"{path}.{os.getpid()}"
        Path(temporary).write_text(json.dumps(groups))
        os.replace(temporary, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") in ("load", "loadgroup"):
        return GroupScheduling(config, log)
    return None


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc,valid-type]
    """xdist's scope scheduling, the scopes being this module's groups: a group's tests
    go to one worker, in collection order; every other test is a unit of its own. Units
    are handed out in collection order (heaviest first), never re-sorted by size."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # the workers wrote it before they reported their collection
            path = os.environ.get(GROUPS_ENV)
            try:
                self._groups = json.loads(Path(path).read_text()) if path else {}
            except (OSError, ValueError):
                self._groups = {}
        group = self._groups.get(nodeid)
        return f"group:{group}" if group else nodeid


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
        unit: sum(known.get(item.nodeid, 0.0) for item in members)
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
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: Any) -> None:
        if hasattr(session.config, "workerinput"):
            return  # a worker: the controller writes the file
        kept = {k: round(v, 1) for k, v in sorted(self.seconds.items()) if v >= self.SHORTEST}
        if kept:
            DURATIONS_FILE.write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
