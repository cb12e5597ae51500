#!/usr/bin/env python3
"""Install the BUILT wheel into a fresh virtualenv and run the quick start there.

``python .ci/package_check.py dist`` (``make package-check`` builds ``dist`` first).
The checkout is never on the path: the quick start and its driver are copied into
a temporary directory, so a file missing from the wheel fails this check.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: str) -> str:
    print("+", " ".join(args), flush=True)
    result = subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True)
    return result.stdout


def main(dist: str) -> None:
    wheels = glob.glob(os.path.join(dist, "*.whl"))
    sdists = glob.glob(os.path.join(dist, "*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        sys.exit(
            f"package-check: expected one wheel and one sdist in {dist}, found {wheels + sdists}"
        )
    wheel = os.path.abspath(wheels[0])
    with tempfile.TemporaryDirectory(prefix="idem-package-check-") as tmp:
        env_dir = os.path.join(tmp, "venv")
        venv.create(env_dir, with_pip=True)
        python = os.path.join(env_dir, "bin", "python")
        run(python, "-m", "pip", "install", "--quiet", wheel, cwd=tmp)
        app_dir = os.path.join(tmp, "app")
        os.mkdir(app_dir)
        for name in ("quickstart.py", "check_quickstart.py"):
            shutil.copy(ROOT / "recipes" / name, app_dir)
        where = run(
            python, "-c", "import flask_idempotency; print(flask_idempotency.__file__)", cwd=app_dir
        )
        if not where.startswith(env_dir):
            sys.exit(f"package-check: flask_idempotency came from {where.strip()}, not the wheel")
        version = run(
            python,
            "-c",
            "import flask_idempotency; print(flask_idempotency.__version__)",
            cwd=app_dir,
        ).strip()
        if version in ("", "0+unknown"):
            sys.exit(f"package-check: the installed package reports version {version!r}")
        print(run(python, "check_quickstart.py", app_dir, cwd=app_dir), end="")
        typed = run(
            python,
            "-c",
            "import importlib.resources as r;"
            " print(r.files('flask_idempotency').joinpath('py.typed').is_file())",
            cwd=app_dir,
        ).strip()
        if typed != "True":
            sys.exit("package-check: py.typed is missing from the wheel")
    print(f"package-check: OK ({os.path.basename(wheel)}, version {version})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dist")
