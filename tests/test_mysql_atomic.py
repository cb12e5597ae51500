"""Transactional mode (C40) with Flask-SQLAlchemy on MariaDB (issue 16).

The proofs of ``test_atomic.py`` are collected here a second time, with the
``harness`` fixture below: the same payments app, the same assertions, the
records, payments and attempts tables on this session's MariaDB database.

The app's connections run at READ COMMITTED (``init_command``), the level these
proofs assume on PostgreSQL too: at a snapshot level (MariaDB's default
REPEATABLE READ) an atomic owner locks its record's row for its whole
transaction (C43), so a retry cannot take over a lapsed lease while the
original's transaction is still alive; it waits for that transaction instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import URL

from tests.support.kill_campaign import AtomicHarness

from .test_atomic import (  # noqa: F401  (collected here, on MariaDB)
    make_payments_app,
    test_c40_constraint_failure_at_the_final_flush_is_the_views_error,
    test_c40_duplicate_does_not_queue_behind_an_owner_inside_its_commit,
    test_c40_exception_and_release_roll_back,
    test_c40_failed_commit_keeps_nothing_and_answers_503,
    test_c40_lost_lease_rolls_back_the_late_owners_writes,
    test_c40_unflushed_writes_commit_with_the_record,
    test_c40_view_commit_is_refused_in_testing,
)

pytestmark = [pytest.mark.slow, pytest.mark.mysql]

if os.environ.get("IDEMPOTENCY_TEST_MARIADB_KILLS") == "1":
    # The SIGKILL campaign on MariaDB (about 4 minutes on 2 cores): collected only on
    # request, to keep `make test` short; the PostgreSQL campaign always runs.
    from .test_atomic import (  # noqa: F401
        test_c40_sigkill_at_random_points_leaves_exactly_one_row_per_key,
    )


@pytest.fixture
def harness(mysql_url: URL, pg_table: str) -> Iterator[AtomicHarness]:
    url = mysql_url.update_query_dict(
        {"init_command": "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"}
    )
    h = AtomicHarness(url, pg_table)
    try:
        yield h
    finally:
        h.close()
