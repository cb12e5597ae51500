"""What fingerprinting a JSON body costs: CPU per MiB and peak memory, per shape (C31).

    .venv/bin/python bench/body_bench.py [--sizes 16384,1048576,10485760] [--ref <git ref>]

For each worst shape of ``tests/test_fingerprint_memory.py`` (small containers, small
numbers, many keys, deep nesting, long strings, big numbers…) and each size: the thread
CPU of one ``request_fingerprint`` per MiB of body (the median of a few runs, not
traced), and the peak memory it took above the body (``tracemalloc``, a separate run).
With ``--ref``, the same for that commit's package, side by side: the before/after of
issue 34 item 4. Prints a Markdown table. Figures, not a test: they depend on the
machine.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flask import Flask  # noqa: E402

from tests.test_fingerprint_memory import SHAPES  # noqa: E402

MIB = 1024 * 1024


def package_at(ref: str, into: Path) -> ModuleType:
    archive = subprocess.run(
        ["git", "archive", ref, "flask_idempotency"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "flask_idempotency").rename(into / "flask_idempotency_ref")
    sys.path.insert(1, str(into))
    return importlib.import_module("flask_idempotency_ref")


def measure(fingerprint: ModuleType, body: bytes) -> tuple[float, float]:
    """CPU ms per MiB, and peak MiB above the body, of fingerprinting ``body``."""
    from flask import request

    app = Flask(__name__)

    def once() -> None:
        with app.test_request_context(
            "/orders", method="POST", data=body, content_type="application/json"
        ):
            fingerprint.request_fingerprint(request)

    runs = max(3, min(200, MIB // len(body)))
    times = []
    for _ in range(3):
        started = time.thread_time()
        for _ in range(runs):
            once()
        times.append((time.thread_time() - started) / runs)
    tracemalloc.start()
    try:
        once()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return statistics.median(times) / (len(body) / MIB) * 1000, peak / MIB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=f"16384,{MIB},{10 * MIB}")
    parser.add_argument("--ref", default=None)
    args = parser.parse_args()
    from flask_idempotency import fingerprint as new

    versions: dict[str, ModuleType] = {"new": new}
    with tempfile.TemporaryDirectory() as tmp:
        if args.ref:
            versions = {"ref": package_at(args.ref, Path(tmp)).fingerprint, "new": new}
        heads = [f"{v} ms/MiB | {v} peak MiB" for v in versions]
        print(f"| shape | body | {' | '.join(heads)} |")
        print("|---|---|" + "---|---|" * len(versions))
        for size in (int(s) for s in args.sizes.split(",")):
            for shape, make in SHAPES.items():
                body = make(size)
                cells = []
                for module in versions.values():
                    cpu, peak = measure(module, body)
                    cells.append(f"{cpu:.1f} | {peak:.2f}")
                print(f"| {shape} | {len(body):,} B | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
