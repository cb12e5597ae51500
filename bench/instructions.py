"""Instructions per request of each path, counted by Valgrind: a figure no load moves.

    .venv/bin/python bench/instructions.py [--requests 100] [--drivers psycopg2,psycopg]

On a shared 2-core machine the CPU time of one request moves by ±30 % from round to
round (``bench/cpu_per_request.py`` shows the spread), so a change of 5 % cannot be
judged by time. This runs the paths of ``cpu_per_request.py`` (bare route, bare + GET,
replay from Redis, a first execution and its raw round trips) in a Python process under
``valgrind --tool=callgrind`` and counts the instructions the process executes per
request: deterministic to well under 1 % from run to run, whatever else the machine
does. Instructions are not time (a system call or a cache miss costs more than an add),
so the wall-clock ratios stay ``make bench``'s; this is the before/after instrument for
the Python side of a change (issue 36).

Each path is warmed, then the parent zeroes the counters (``callgrind_control -z``), the
child runs ``--requests`` requests of that path, and the parent dumps the counters
(``callgrind_control -d``): the dump's total divided by the requests.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = ("bare", "floor", "replay", "first-floor", "first")
DRIVERS = {"psycopg2": "postgresql+psycopg2", "psycopg": "postgresql+psycopg"}


def child(driver: str, requests: int, database_url: str, redis_url: str) -> None:
    """Build the paths, then run each on the parent's word: ``go`` in, ``done`` out."""
    import sqlalchemy as sa

    from bench import cpu_per_request

    url = sa.make_url(database_url).set(drivername=DRIVERS[driver]).render_as_string(False)
    steps = cpu_per_request.build(url, redis_url, driver)
    for step in steps.values():
        for _ in range(30):  # prepared statements, pools, caches: as in a served process
            step()
    for name in PATHS:
        print(f"ready {name}", flush=True)
        sys.stdin.readline()
        for _ in range(requests):
            steps[name]()
        print(f"done {name}", flush=True)
        sys.stdin.readline()
    with sa.create_engine(url).begin() as connection:
        connection.execute(sa.text(f"DROP TABLE IF EXISTS {cpu_per_request.TABLE}"))


def _total(dump: Path) -> int:
    match = re.search(r"^(?:summary|totals):\s+(\d+)", dump.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"no total in {dump}")
    return int(match.group(1))


def count(driver: str, requests: int, database_url: str, redis_url: str) -> dict[str, float]:
    """Instructions per request of each path, for one driver."""
    with tempfile.TemporaryDirectory(prefix="idem-icount-") as directory:
        out = Path(directory) / "callgrind.out"
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--child",
            driver,
            "--requests",
            str(requests),
            "--database-url",
            database_url,
            "--redis-url",
            redis_url,
        ]
        env = dict(os.environ, PYTHONMALLOC="malloc")
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        result: dict[str, float] = {}
        try:
            for name in PATHS:
                line = proc.stdout.readline().strip()
                if line != f"ready {name}":
                    raise RuntimeError(f"child said {line!r}, expected 'ready {name}'")
                _control("-z", proc.pid)
                proc.stdin.write("go\n")
                proc.stdin.flush()
                line = proc.stdout.readline().strip()
                if line != f"done {name}":
                    raise RuntimeError(f"child said {line!r}, expected 'done {name}'")
                before = set(Path(directory).iterdir())
                _control("-d", proc.pid)
                dumps = sorted(set(Path(directory).iterdir()) - before)
                result[name] = _total(dumps[-1]) / requests
                proc.stdin.write("go\n")
                proc.stdin.flush()
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return result


def _control(flag: str, pid: int) -> None:
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--drivers", default="psycopg2,psycopg")
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "IDEMPOTENCY_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.requests, args.database_url, args.redis_url)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench: valgrind is not installed (apt-get install -y valgrind)")
    print(f"instructions per request ({args.requests} requests per path, callgrind)")
    print(
        "| driver | "
        + " | ".join(PATHS)
        + " | replay − floor | replay ÷ floor | first ÷ its floor |"
    )
    print("|---|" + "---:|" * (len(PATHS) + 3))
    for driver in args.drivers.split(","):
        got = count(driver, args.requests, args.database_url, args.redis_url)
        cells = " | ".join(f"{got[name]:,.0f}" for name in PATHS)
        print(
            f"| {driver} | {cells} | {got['replay'] - got['floor']:,.0f}"
            f" | {got['replay'] / got['floor']:.3f} | {got['first'] / got['first-floor']:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
