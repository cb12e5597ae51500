"""The throughput bench's wrk script sends what its cells are named after (issue 21 item 4).

"All new keys" must be new keys: each wrk thread runs the script in a Lua state of its
own, and a key numbered by a ``local`` thread id was the same in every thread, so
about half of that cell's requests were concurrent duplicates that parked behind
their original (2,603 of 3,161 keys sent twice in one second).
"""

from __future__ import annotations

import collections
import http.server
import os
import shutil
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bench import paths as bench_paths
from tests.conftest import service_missing


class _Counting(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: ClassVar[collections.Counter[str]] = collections.Counter()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen[self.headers.get("Idempotency-Key") or ""] += 1
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def counting_server() -> Iterator[tuple[int, collections.Counter[str]]]:
    if shutil.which("wrk") is None:
        service_missing("wrk", "not installed (apt-get install wrk; make system-deps does)")
    _Counting.seen = collections.Counter()
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Counting)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], _Counting.seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", ["new", "mix"])
def test_i21_4_the_wrk_scripts_new_keys_are_each_sent_once(
    counting_server: tuple[int, collections.Counter[str]], mode: str, tmp_path: Path
) -> None:
    port, seen = counting_server
    script = tmp_path / "bench.lua"
    script.write_text(bench_paths.WRK_SCRIPT)
    result = bench_paths.wrk_run(script, port, mode, 1, 4, 200, 0.1)
    new = {key: n for key, n in seen.items() if key and not key.startswith("mix-")}
    assert result["requests"] > 100 and new, (result, len(new))
    assert [key for key, n in new.items() if n > 1] == []
    if mode == "mix":  # about a tenth new, the rest replays of the 200 stored keys
        assert 0.03 < len(new) / sum(seen.values()) < 0.3


def test_i36_3_worker_cpu_is_read_from_proc_and_a_gone_worker_counts_nothing() -> None:
    """Throughput cells give the workers' CPU per request beside req/s (issue 36 item 3):
    read from ``/proc/<pid>/stat`` (user + system), the same figure ``os.times`` gives for
    this process; a worker gone between the two reads adds nothing rather than failing."""
    spent = bench_paths.workers_cpu_s([os.getpid()])
    times = os.times()
    assert spent > 0
    assert abs(spent - (times.user + times.system)) < 0.1  # /proc counts in clock ticks
    gone = 2**22 + 1  # above pid_max's largest default: no such process
    assert bench_paths.workers_cpu_s([gone]) == 0
    assert bench_paths.workers_cpu_s([os.getpid(), gone]) >= spent


def test_i36_3_the_machine_split_counts_a_named_process_and_the_whole_machine() -> None:
    """Throughput cells split the machine's CPU per request by process (issue 36 item 3):
    a busy child named like a server is found by its command name and its CPU counted,
    the machine's busy time grows at least by it, and a waited-for child (as each wrk
    run is) counts in ``wrk``."""
    import subprocess
    import sys

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    before = bench_paths.machine_split(redis_pids=[])
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        comm = Path(f"/proc/{child.pid}/comm").read_text().strip()
        assert child.pid in bench_paths.processes_named(comm)
    finally:
        child.wait()
    after = bench_paths.machine_split(redis_pids=[])
    split = bench_paths.per_request(before, after, requests=1)
    assert split["wrk_us"] >= 0.35e6  # the waited-for child's 0.4 s, in µs per "request"
    assert split["machine_us"] >= 0.35e6
    assert split["redis_us"] == 0  # no redis-server given
    assert bench_paths.redis_server_pids(1) == []  # none listens on port 1
