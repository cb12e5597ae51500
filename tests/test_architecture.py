"""The package's shape as a test: the import-linter contracts in setup.cfg (issue 24).

Arrows point down (api → lifecycle → decision and completion → state → tiers →
records), nothing imports in a circle, and the lifecycle and the decision name no
dialect, Redis topology, isolation level or hand-written wire code. ``make lint``
runs the same contracts; here they also fail ``make test``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_i24_import_contracts_are_kept() -> None:
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if linter is None:
        pytest.fail("import-linter is not installed: `pip install -e '.[dev]'` brings it")
    result = subprocess.run(
        [linter, "--config", str(ROOT / "setup.cfg")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
