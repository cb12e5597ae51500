"""The benchmark suite: ``harness`` (servers, sampling, statistics), ``paths`` (what is
measured, and each path's floor), ``report`` (RESULTS.md). Run it with ``make bench``.

It imports nothing from ``tests/``: the bench must run from a checkout without the suite.
The exceptions are the fault-injection runs, ``atomic_kills.py`` and ``soak.py`` (``make
soak``), which reuse the plain server helpers of ``tests/support/`` (gunicorn, a private
redis-server, a cuttable TCP proxy), never a pytest fixture.
"""
