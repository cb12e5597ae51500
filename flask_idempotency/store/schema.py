"""The store's tables: set up when asked, verified before the first claim, and its identity.

The records table and its one-row companion ``<table>_store`` (the store's
identity, which names its records in Redis, C41) are created here when the app
asks for it (``IDEMPOTENCY_CREATE_TABLE``, the embedded SQLite default), and read
once per process: every column before the first claim (a missing or mismatched
table stops requests before a view runs, C45), the identity at the Redis tier's
first use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import Connection, Engine, MetaData, Table, inspect, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from .. import process
from .engines import StoreEngines
from .errors import StoreError, StoreMisconfigured, describe
from .identity import (
    IdentityMissing,
    IdentityUnavailable,
    StoreIdentity,
    add_secret_column,
    fill_secret_statement,
    identity_table,
    missing_help,
    read_identity,
    write_statement,
)
from .table import idempotency_table

log = logging.getLogger("flask_idempotency")

#: Seconds an identity that could not be read is not asked for again by callers that ask
#: per request (the default scope's secret). Shorter than the Redis tier's first back-off
#: step (1 s, :class:`~flask_idempotency.cache.outage.Outage`): the tier asks once per
#: step, and each of its probes must reach the database, so that a table created after
#: the app started brings the tier back at its next probe (C54; 5 s here kept it off
#: four probes longer, issue 33).
IDENTITY_RETRY_MISSING = 0.2
IDENTITY_RETRY_UNAVAILABLE = 0.2


class StoreSchema(StoreEngines):
    """The records table and the store's identity (the base of
    :class:`~flask_idempotency.store.sql.DurableStore`)."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        metadata: MetaData | None,
        table_name: str,
        create_table: bool,
    ) -> None:
        own = metadata or MetaData()
        table: Table = idempotency_table(own, table_name)
        super().__init__(engine_factory, table, create_table)
        #: The store's identity (one row), which names its records in Redis (C41).
        self.identity_table: Table = identity_table(own, table_name)
        #: The table is on the app's metadata (``db=``): its migrations create it.
        self.on_app_metadata = metadata is not None
        self._identity: StoreIdentity | None = None
        self._identity_failure: tuple[float, StoreError] | None = None
        #: One reader of the identity at a time: racing first requests wait for its
        #: answer instead of each reading (and maybe writing) the row (issue 33).
        self._identity_lock = process.lazy_lock()
        self._verified = False

    def create_table(self) -> None:
        """Create the table and its identity if missing (tests, the embedded SQLite default)."""
        self.table.create(self.engine, checkfirst=True)
        self.identity_table.create(self.engine, checkfirst=True)  # writes the id (identity.py)
        with self.engine.begin() as conn:
            add_secret_column(conn, self.identity_table)

    def _create_if_missing(self, engine: Engine) -> None:
        """The set-up's step (``IDEMPOTENCY_CREATE_TABLE``): the table, then its identity
        (and the identity's ``secret`` column, on a table made before it existed)."""
        super()._create_if_missing(engine)
        try:
            self.identity_table.create(engine, checkfirst=True)
        except SQLAlchemyError:
            table = self.identity_table
            if not inspect(engine).has_table(table.name, schema=table.schema):
                raise
        try:
            with engine.begin() as conn:
                add_secret_column(conn, self.identity_table)
        except SQLAlchemyError:  # another process added it first
            table = self.identity_table
            with engine.connect() as conn:
                columns = inspect(conn).get_columns(table.name, schema=table.schema)
            if "secret" not in {c["name"] for c in columns}:
                raise

    # -- identity -------------------------------------------------------------------

    def identity(self) -> StoreIdentity:
        """This store's identity, read from its database once per process (C41).

        The first call reads the row of ``<table>_store``, writing it first if the table
        is empty (racing writers agree: :mod:`.identity`). Raises
        :class:`.identity.IdentityMissing` when the table is not there (logged at ERROR,
        with the command that fixes it) and :class:`.identity.IdentityUnavailable` when
        the database does not answer; for a few seconds after either, the same error is
        raised again without asking the database. Single-flight: concurrent first
        callers wait for one read (once per process, as docs/redis.md says).
        """
        known = self._identity
        if known is not None:
            return known
        with self._identity_lock:
            return self._identity_once()

    def _identity_once(self) -> StoreIdentity:
        """:meth:`identity` under its lock: the answer of whoever read it first."""
        known = self._identity
        if known is not None:
            return known
        failure = self._identity_failure
        if failure is not None and time.monotonic() < failure[0]:
            raise type(failure[1])(str(failure[1]))
        try:
            found = self._read_or_write_identity()
        except StoreMisconfigured as exc:
            error: StoreError = IdentityMissing(
                missing_help(
                    self.table.name,
                    migrations=self.on_app_metadata,
                    cause=describe(exc.__cause__ or exc),
                )
            )
            if self._identity_failure is None or not isinstance(
                self._identity_failure[1], IdentityMissing
            ):
                log.error("idempotency: %s", error)
            self._identity_failure = (time.monotonic() + IDENTITY_RETRY_MISSING, error)
            raise error from exc
        except StoreError as exc:
            error = IdentityUnavailable(
                f"could not read this store's identity from {self.identity_table.name!r}: {exc}"
            )
            self._identity_failure = (time.monotonic() + IDENTITY_RETRY_UNAVAILABLE, error)
            raise error from exc
        self._identity, self._identity_failure = found, None
        log.info(
            "idempotency: store %r is %s (from %r)",
            self.table.name,
            found.id[:12],
            self.identity_table.name,
        )
        return found

    def _read_or_write_identity(self) -> StoreIdentity:
        table = self.identity_table

        def read(conn: Connection) -> StoreIdentity | None:
            return read_identity(conn, table)

        found = self._run(read)
        if found is None:  # an empty table (an autogenerated migration): write the one row
            try:
                self._run(lambda conn: conn.execute(write_statement(table)))
            except StoreError as exc:
                if not isinstance(exc.__cause__, IntegrityError):
                    raise  # (another process wrote it first: read theirs)
            found = self._run(read)
        if found is not None and not found.secret:  # a row from before the secret (C60)
            self._run(lambda conn: conn.execute(fill_secret_statement(table)))
            found = self._run(read)
        if found is None:  # pragma: no cover - deleted again between the two statements
            raise StoreError(f"the row of {table.name!r} vanished while it was being written")
        return found

    def __repr__(self) -> str:
        # Its table, never its engine's URL or its identity's secret (C61).
        return f"<{type(self).__name__} table={self.table.fullname!r}>"

    def verify_table(self) -> None:
        """Read every column once per process before the first claim, so that a missing
        or mismatched table stops requests before any view runs (C45), not at completion."""
        t = self.table
        probe = select(*t.c).where(t.c.id.is_(None)).limit(1)
        self._run(lambda conn: conn.execute(probe).first(), self._single())
        self._verified = True
