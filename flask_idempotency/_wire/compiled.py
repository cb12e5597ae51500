"""What a statement compiled for the direct path is on either PostgreSQL driver
(:mod:`.psycopg2`, :mod:`.psycopg`): SQLAlchemy's compiled text and its values'
names, the constants it compiled in, and where its result holds a record.

Private SQLAlchemy APIs this module touches: ``compiled.string``,
``compiled.binds[name].required`` and ``compiled.params`` (SQLAlchemy 2.0.0 to 2.1.9).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .sqla_pool import _CURSOR, _KEPT_RESULT_BYTES

#: SQLAlchemy's placeholder for a named value in the pyformat both drivers take.
PLACEHOLDER = re.compile(r"%\((\w+)\)s")


class CompiledSQL:
    """A statement compiled once by SQLAlchemy, for one driver's direct path.

    ``sql`` is the statement as SQLAlchemy would run it, after ``prefix`` (error
    messages name it); ``names`` its values' names in placeholder order (repeats
    included); ``record_values``: a row's values in
    :data:`~flask_idempotency.records.RECORD_COLUMNS` order (statements that read a
    record); ``body_at``: where a row holds a stored body, if it does.
    """

    __slots__ = ("_constants", "body_at", "names", "record_values", "sql")

    def __init__(
        self,
        compiled: Any,
        record_values: Callable[[Any], Any] | None,
        prefix: str,
        body_at: int | None,
    ) -> None:
        text: str = compiled.string
        self.sql = prefix + text
        self.record_values = record_values
        self.body_at = body_at
        self.names: list[str] = PLACEHOLDER.findall(text)
        #: SQLAlchemy's constants (values compiled into the statement), sent with each run's.
        self._constants = {
            name: compiled.params[name] for name in self.names if not compiled.binds[name].required
        }

    def with_constants(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` and the statement's own constants: every value a run sends."""
        constants = self._constants
        return {**constants, **params} if constants else params

    def let_go_of_big_body(self, info: dict[str, Any], row: Any) -> None:
        """The kept cursor holds its last result until its next statement: a row with a
        big stored body is let go with the cursor rather than kept by the pooled
        connection (its ``info``)."""
        at = self.body_at
        if at is not None and row is not None:
            body = row[at]
            if body is not None and len(body) > _KEPT_RESULT_BYTES:
                info.pop(_CURSOR, None)
