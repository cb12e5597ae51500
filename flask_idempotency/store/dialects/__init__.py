"""What differs between the databases the store speaks: one module per dialect.

CONTRACT C8, C13, C14, C26, C42.

The store's statements are the same everywhere except for a few things, which each
dialect module (:mod:`.postgresql`, :mod:`.mysql`, :mod:`.sqlite`) holds for its
database, starting from the plain SQL of :class:`~.base.Dialect`:

* The clock: how :class:`~flask_idempotency.store.clock.db_now_ms` is written.
* The claim. PostgreSQL and SQLite have ``INSERT … ON CONFLICT DO NOTHING
  RETURNING``: the winner learns it from the returned row. MySQL and MariaDB have
  neither ``ON CONFLICT`` nor (MySQL 8) ``RETURNING`` (:mod:`.mysql` says how the
  winner is told).
* ``UPDATE … RETURNING``: MySQL and MariaDB have none.
* Which errors mean "run it again" (C26) and "a live transaction holds the row",
  and how a statement is kept from waiting long for another's row lock.
* How ``prune`` picks a batch without queueing behind other prunes.

The store picks the rules by ``engine.dialect.name`` (:func:`named`, :func:`of`).
A driver error is classified by asking every dialect (:func:`is_retryable`): an
error says by its own codes which database raised it.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine

from .base import Dialect
from .mysql import MYSQL_FAMILY, MySQL
from .postgresql import PostgreSQL
from .sqlite import SQLite

__all__ = ["MYSQL_FAMILY", "Dialect", "is_lock_unavailable", "is_retryable", "named", "of"]

_POSTGRESQL = PostgreSQL("postgresql")
_SQLITE = SQLite("sqlite")
#: The rules of each database by SQLAlchemy's dialect name.
_BY_NAME: dict[str, Dialect] = {
    "postgresql": _POSTGRESQL,
    "sqlite": _SQLITE,
    **{name: MySQL(name) for name in sorted(MYSQL_FAMILY)},
}
#: Each database's rules once, for classifying an error whatever raised it.
_ALL = (_POSTGRESQL, _BY_NAME["mysql"], _SQLITE)


def named(name: str) -> Dialect:
    """The rules for the dialect SQLAlchemy calls ``name``; plain SQL for one the store has
    no module for (its claim is refused: 503)."""
    rules = _BY_NAME.get(name)
    return Dialect(name) if rules is None else rules


def of(bind: Connection | Engine) -> Dialect:
    """The rules for the database ``bind`` talks to."""
    return named(bind.dialect.name)


def is_retryable(exc: BaseException) -> bool:
    """A serialization failure, deadlock or lock-wait timeout: the statement may succeed
    when run again in a fresh transaction (C26)."""
    return any(rules.is_retryable(exc) for rules in _ALL)


def is_lock_unavailable(exc: BaseException | None) -> bool:
    """The guarded statement gave up waiting for another transaction's row lock."""
    return any(rules.is_lock_unavailable(exc) for rules in _ALL)
