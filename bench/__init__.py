"""The benchmark suite: ``harness`` (servers, sampling, statistics), ``paths`` (what is
measured, and each path's floor), ``report`` (RESULTS.md). Run it with ``make bench``.

It imports nothing from ``tests/``: the bench must run from a checkout without the suite.
"""
