"""The parallel run's scheduling (tests/support/parallel.py), on a small suite of its own.

``make test`` runs on several pytest-xdist workers; two promises keep it sound on two
cores: tests that share a module- or session-scoped server run on one worker (the
server starts once), and at most ``HEAVY_LANES`` heavy tests run at any moment. Both
broke silently once (pytest 9.2 ignored xdist's group suffix): these tests run a
suite through real xdist workers and read where and when each test ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import parallel

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
import pytest
from tests.support import parallel

def pytest_configure(config):
    config.pluginmanager.register(parallel, "parallel-order")
    config.addinivalue_line("markers", "heavy: keeps the CPU busy")

def pytest_collection_modifyitems(config, items):
    parallel.group_shared_servers(items)
"""

SUITE = """
import json, os, time
import pytest

LOG = {log!r}

def note(name, started):
    with open(LOG, "a") as f:
        f.write(json.dumps({{"test": name, "worker": os.environ["PYTEST_XDIST_WORKER"],
                             "started": started, "ended": time.time()}}) + "\\n")

@pytest.fixture(scope="module")
def cluster():
    return "one server for the module"

@pytest.mark.parametrize("n", range(6))
def test_on_the_cluster(cluster, n):
    started = time.time(); time.sleep(0.05); note(f"cluster-{{n}}", started)

@pytest.mark.parametrize("n", range(6))
def test_alone(n):
    started = time.time(); time.sleep(0.05); note(f"alone-{{n}}", started)

@pytest.mark.heavy
@pytest.mark.parametrize("n", range(6))
def test_heavy(n):
    started = time.time(); time.sleep(0.3); note(f"heavy-{{n}}", started)
"""


def run_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    log = pytester.path / "runs.jsonl"
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_suite=SUITE.format(log=str(log)))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    result = pytester.runpytest_subprocess("-n", "4", "-p", "xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=18)
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_shared_servers_run_on_one_worker_and_heavy_tests_two_at_a_time(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One suite through four real workers (a run costs seconds: both checks read it)."""
    runs = run_suite(pytester, monkeypatch)
    cluster_workers = {r["worker"] for r in runs if r["test"].startswith("cluster-")}
    assert len(cluster_workers) == 1, f"the module's server was started on {cluster_workers}"
    other_workers = {r["worker"] for r in runs if r["test"].startswith("alone-")}
    assert len(other_workers) > 1, "tests that share nothing were not spread"

    heavy = [r for r in runs if r["test"].startswith("heavy-")]
    assert len(heavy) == 6
    most = max(
        sum(1 for other in heavy if other["started"] <= r["started"] < other["ended"])
        for r in heavy
    )
    assert most <= parallel.HEAVY_LANES, f"{most} heavy tests ran at once"
    assert len({r["worker"] for r in heavy}) == parallel.HEAVY_LANES
