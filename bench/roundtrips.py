"""Round trips per request, counted: the client's sends to PostgreSQL and to Redis, by path.

    .venv/bin/python bench/roundtrips.py [--requests 20]

A figure the load of the machine cannot move: each path runs in a child process
under ``strace -f -yy -e trace=sendto``, and every send between two markers is
counted by the server port it went to. A request costs at least one round trip
per send (the client then waits for the reply). Needs ``strace``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (
    DEFAULT_DATABASE_URL,
    WsgiCaller,
    private_database,
    private_redis,
)

#: path → (route, uses Redis, key per request: "fixed", "new" or None)
PATHS = {
    "unprotected route": ("/bare", True, None),
    "replay from Redis": ("/pay", True, "fixed"),
    "replay from PostgreSQL only": ("/pay", False, "fixed"),
    "first execution, PostgreSQL + Redis": ("/pay", True, "new"),
    "first execution, PostgreSQL only": ("/pay", False, "new"),
}
#: What the floor of each path needs (bench/paths.py).
FLOOR = {
    "unprotected route": (0, 0),
    "replay from Redis": (0, 1),
    "replay from PostgreSQL only": (1, 0),
    "first execution, PostgreSQL + Redis": (2, 1),
    "first execution, PostgreSQL only": (2, 0),
}
_SEND = re.compile(r"sendto\(\d+<TCP:\[[^\]]*->[^\]]*:(\d+)\]>")


def child(path: str, db_url: str, redis_url: str, requests: int) -> None:
    from bench.benchapp import create_app

    route, uses_redis, keys = PATHS[path]
    app = create_app(
        "ours", database_url=db_url, redis_url=redis_url if uses_redis else None, table="rt"
    )
    caller = WsgiCaller(app, route)
    for i in range(5):  # create the table, open the pools, store the replayed record
        caller("fixed" if keys == "fixed" else f"warm-{i}" if keys else None)
    os.getppid()  # marker: counting starts
    for _ in range(requests):
        caller(uuid.uuid4().hex if keys == "new" else keys)
    os.getppid()  # marker: counting ends


def count(path: str, db_url: str, redis_url: str, requests: int) -> tuple[float, float]:
    strace = shutil.which("strace")
    assert strace is not None
    with tempfile.NamedTemporaryFile(suffix=".strace") as trace:
        subprocess.run(
            [strace, "-f", "-qq", "-yy", "-e", "trace=sendto,getppid", "-o", trace.name,
             sys.executable, __file__, "--child", path, db_url, redis_url, str(requests)],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        lines = Path(trace.name).read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if "getppid()" in line]
    pg_port = db_url.rsplit(":", 1)[-1].split("/")[0]
    redis_port = redis_url.rsplit(":", 1)[-1].split("/")[0]
    sends = {"pg": 0, "redis": 0}
    for line in lines[marks[0] : marks[-1]]:
        match = _SEND.search(line)
        if match and match.group(1) == pg_port:
            sends["pg"] += 1
        elif match and match.group(1) == redis_port:
            sends["redis"] += 1
    return sends["pg"] / requests, sends["redis"] / requests


def table(requests: int, database_url: str = DEFAULT_DATABASE_URL) -> list[str]:
    """Markdown rows: per path, round trips to PostgreSQL and Redis, ours and the floor's."""
    if shutil.which("strace") is None:
        return ["Not counted: `strace` is not installed."]
    lines = [
        "| path | PostgreSQL, ours | PostgreSQL, floor | Redis, ours | Redis, floor |",
        "|---|---:|---:|---:|---:|",
    ]
    with private_database(database_url) as db_url, private_redis() as redis_url:
        for path in PATHS:
            pg, redis = count(path, db_url, redis_url, requests)
            floor_pg, floor_redis = FLOOR[path]
            lines.append(f"| {path} | {pg:g} | {floor_pg} | {redis:g} | {floor_redis} |")
    return lines


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    args = parser.parse_args()
    print("\n".join(table(args.requests, args.database_url)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
