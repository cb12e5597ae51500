"""Operator work on the records table: prune, stats, look-up, forget, schema check (C28–C29),
and the store's identity (:mod:`.identity`, C41).

Kept apart from :mod:`.sql` because none of it is on the request path: these
statements may scan, run in longer transactions, and must never create the
table behind the operator's back, even for the embedded SQLite default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    Table,
    and_,
    case,
    delete,
    func,
    inspect,
    not_,
    or_,
    select,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.schema import CreateIndex, CreateTable

from ..records import COMPLETED, IN_PROGRESS
from .clock import db_now_ms
from .dialects import named
from .errors import describe
from .identity import StoreIdentity, add_secret_column, read_identity
from .sql import DurableStore

T = TypeVar("T")


class MaintenanceError(Exception):
    """The database could not be reached or refused a statement; ``str()`` is one line."""


class TableMissing(MaintenanceError):
    """The records table does not exist in the database."""


@dataclasses.dataclass(frozen=True)
class TableStats:
    """What ``flask idempotency stats`` reports: a snapshot read with the database clock."""

    now_ms: int
    total: int
    completed: int
    in_progress: int
    #: In progress, lease lapsed: the owner crashed or overran; the next request takes over.
    stale_leases: int
    #: Past ``expires_at`` and not held by a live lease: what ``prune`` would delete now.
    prunable: int
    oldest_in_progress_created_ms: int | None
    oldest_in_progress_lease_ms: int | None
    oldest_expiry_ms: int | None


@dataclasses.dataclass(frozen=True)
class PruneBatch:
    """One prune batch: how many rows it deleted, and where the next batch starts."""

    deleted: int
    #: The latest expiry deleted so far; pass it back as ``from_expiry``.
    last_expiry: int | None


@dataclasses.dataclass(frozen=True)
class RecordView:
    """One row as an operator sees it: everything but the body unless asked for."""

    now_ms: int
    id: int
    key_digest: str
    scope: str
    state: str
    method: str
    path: str
    created_at_ms: int
    expires_at_ms: int
    lease_expires_at_ms: int | None
    completed_at_ms: int | None
    response_status: int | None
    response_headers: str | None
    body_size: int | None
    body_omitted: bool
    body: bytes | None


@dataclasses.dataclass(frozen=True)
class SchemaReport:
    """Differences between the live table and the definition the code writes to.

    ``errors`` break the request path (a missing column, a wrong type, no unique
    key); ``warnings`` only cost speed or tidiness (a missing prune index).
    """

    table: str
    exists: bool
    errors: tuple[str, ...]
    warnings: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.exists and not self.errors


@dataclasses.dataclass(frozen=True)
class IdentityReport:
    """The identity table (``<table>_store``) as ``check`` finds it: there or not, its
    differences from the definition, and its row (``None``: not written yet)."""

    table: str
    exists: bool
    errors: tuple[str, ...]
    warnings: tuple[str, ...]
    identity: StoreIdentity | None


class Maintenance:
    """Maintenance statements for one app's records table."""

    def __init__(self, store: DurableStore) -> None:
        self.store = store
        self.table: Table = store.table
        self.identity_table: Table = store.identity_table

    # -- connections -------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The store's engine, fetched without the store's create-on-first-use step."""
        return self.store.engine_without_setup()

    @contextmanager
    def _connection(self) -> Iterator[Connection]:
        # One short transaction either way: no isolation switch per checkout (engines.py).
        try:
            with self.engine.begin() as conn:
                yield conn
        except SQLAlchemyError as exc:
            raise MaintenanceError(describe(exc)) from exc

    def _run(self, work: Callable[[Connection], T]) -> T:
        with self._connection() as conn:
            return work(conn)

    def table_exists(self) -> bool:
        """Whether the table is there: also the first proof that the database answers."""
        return self._run(
            lambda conn: inspect(conn).has_table(self.table.name, schema=self.table.schema)
        )

    def identity_table_exists(self) -> bool:
        t = self.identity_table
        return self._run(lambda conn: inspect(conn).has_table(t.name, schema=t.schema))

    def require_table(self) -> None:
        if not self.table_exists():
            raise TableMissing(f"the table {self.table.name!r} does not exist")

    # -- prune ------------------------------------------------------------------------

    def _prunable(self) -> Any:
        """Expired, and not an in-progress claim whose lease is still live (C21, C28)."""
        t, now = self.table, db_now_ms()
        return and_(
            t.c.expires_at_ms < now,
            not_(
                and_(
                    t.c.state == IN_PROGRESS,
                    or_(t.c.lease_expires_at_ms.is_(None), t.c.lease_expires_at_ms > now),
                )
            ),
        )

    def count_prunable(self) -> int:
        t = self.table
        stmt = select(func.count()).select_from(t).where(self._prunable())
        return int(self._run(lambda conn: conn.execute(stmt).scalar_one()))

    def prune_batch(self, batch_size: int, *, from_expiry: int | None = None) -> PruneBatch:
        """Delete up to ``batch_size`` prunable rows, oldest expiry first.

        One short transaction per batch. On PostgreSQL the rows are picked with
        ``FOR UPDATE SKIP LOCKED``: prunes running on several hosts pick disjoint
        rows instead of queueing on each other, and a row a request is replacing
        right now is simply left for the next run. The lock re-checks the
        condition on the row's newest version, so a record renewed meanwhile
        is not deleted.

        ``from_expiry`` is the ``last_expiry`` of the previous batch: the scan of
        the expiry index starts there instead of walking again over the entries
        of rows already deleted, which stay in the index until VACUUM and, while
        any long transaction on the server holds the xmin horizon back, cost a
        heap visit each. Without it a long prune slows down batch after batch.
        """
        t = self.table
        condition = self._prunable()
        if from_expiry is not None:
            condition = and_(condition, t.c.expires_at_ms >= from_expiry)
        rules = named(self.store.dialect)  # each database picks its batch its own way

        def run(conn: Connection) -> PruneBatch:
            deleted, last_expiry = rules.prune_batch(conn, t, condition, batch_size, from_expiry)
            return PruneBatch(deleted, last_expiry)

        return self._run(run)

    # -- stats --------------------------------------------------------------------------

    def stats(self) -> TableStats:
        t, now = self.table, db_now_ms()
        in_progress = t.c.state == IN_PROGRESS
        live_lease = and_(in_progress, t.c.lease_expires_at_ms > now)

        def count_where(condition: Any) -> Any:
            return func.coalesce(func.sum(_case_one(condition)), 0)

        stmt = select(
            now.label("now_ms"),
            func.count().label("total"),
            count_where(t.c.state == COMPLETED).label("completed"),
            count_where(in_progress).label("in_progress"),
            count_where(and_(in_progress, not_(live_lease))).label("stale_leases"),
            count_where(self._prunable()).label("prunable"),
            func.min(_when(in_progress, t.c.created_at_ms)).label("oldest_created"),
            func.min(_when(in_progress, t.c.lease_expires_at_ms)).label("oldest_lease"),
            func.min(t.c.expires_at_ms).label("oldest_expiry"),
        ).select_from(t)
        row = self._run(lambda conn: conn.execute(stmt).one())
        return TableStats(
            now_ms=int(row.now_ms),
            total=int(row.total),
            completed=int(row.completed),
            in_progress=int(row.in_progress),
            stale_leases=int(row.stale_leases),
            prunable=int(row.prunable),
            oldest_in_progress_created_ms=_optional_int(row.oldest_created),
            oldest_in_progress_lease_ms=_optional_int(row.oldest_lease),
            oldest_expiry_ms=_optional_int(row.oldest_expiry),
        )

    # -- one record -----------------------------------------------------------------------

    def lookup(self, key_digest: str, *, with_body: bool = False) -> RecordView | None:
        """The record named ``key_digest``; the body is read only when asked for."""
        t = self.table
        columns = [
            db_now_ms().label("now_ms"),
            t.c.id,
            t.c.key_digest,
            t.c.scope,
            t.c.state,
            t.c.method,
            t.c.path,
            t.c.created_at_ms,
            t.c.expires_at_ms,
            t.c.lease_expires_at_ms,
            t.c.completed_at_ms,
            t.c.response_status,
            t.c.response_headers,
            func.length(t.c.response_body).label("body_size"),
            t.c.body_omitted,
        ]
        if with_body:
            columns.append(t.c.response_body)
        stmt = select(*columns).where(t.c.key_digest == key_digest)
        row = self._run(lambda conn: conn.execute(stmt).first())
        if row is None:
            return None
        return RecordView(
            now_ms=int(row.now_ms),
            id=int(row.id),
            key_digest=row.key_digest,
            scope=row.scope,
            state=row.state,
            method=row.method,
            path=row.path,
            created_at_ms=int(row.created_at_ms),
            expires_at_ms=int(row.expires_at_ms),
            lease_expires_at_ms=_optional_int(row.lease_expires_at_ms),
            completed_at_ms=_optional_int(row.completed_at_ms),
            response_status=_optional_int(row.response_status),
            response_headers=row.response_headers,
            body_size=_optional_int(row.body_size),
            body_omitted=bool(row.body_omitted),
            body=bytes(row.response_body) if with_body and row.response_body is not None else None,
        )

    def digests_starting_with(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Full digests that begin with ``prefix``: logs print only the first 16 characters."""
        t = self.table
        stmt = (
            select(t.c.key_digest)
            .where(t.c.key_digest.startswith(prefix, autoescape=True))
            .order_by(t.c.key_digest)
            .limit(limit)
        )
        return [str(d) for d in self._run(lambda conn: conn.execute(stmt).scalars().all())]

    def forget(self, key_digest: str) -> bool:
        """Delete the record whatever its state: the operator's escape hatch."""
        t = self.table
        stmt = delete(t).where(t.c.key_digest == key_digest)
        return bool(self._run(lambda conn: conn.execute(stmt).rowcount))

    # -- schema ---------------------------------------------------------------------------

    def create_table(self) -> bool:
        """Create the table, its index and its identity (``<table>_store`` and its row),
        whichever is missing, and the identity's ``secret`` column on a table made before
        it (``True`` if that was added); only ever on the operator's explicit request."""

        def create(conn: Connection) -> bool:
            self.table.create(conn, checkfirst=True)
            self.identity_table.create(conn, checkfirst=True)  # writes the id (identity.py)
            return add_secret_column(conn, self.identity_table)  # a table from before issue 34

        return self._run(create)

    def add_secret_column(self) -> bool:
        """Add the identity's ``secret`` column to a table made before issue 34 (C60);
        ``True`` if it was missing."""
        return self._run(lambda conn: add_secret_column(conn, self.identity_table))

    def create_ddl(self) -> str:
        """The ``CREATE TABLE`` and ``CREATE INDEX`` statements for this database.

        The identity's row is not among them: one script run on two databases would give
        both the same id. The first process that uses Redis writes it (:mod:`.identity`).
        """
        dialect = self.engine.dialect
        statements = [str(CreateTable(self.table).compile(dialect=dialect)).strip()]
        statements += [
            str(CreateIndex(index).compile(dialect=dialect)).strip()
            for index in sorted(self.table.indexes, key=lambda i: i.name or "")
        ]
        statements.append(str(CreateTable(self.identity_table).compile(dialect=dialect)).strip())
        return ";\n\n".join(statements) + ";"

    def check_schema(self) -> SchemaReport:
        """Compare the live table with the definition the code reads and writes."""
        return self._run(self._check_schema)

    def _check_schema(self, conn: Connection) -> SchemaReport:
        t = self.table
        inspector = inspect(conn)
        if not inspector.has_table(t.name, schema=t.schema):
            return SchemaReport(t.name, False, (), ())
        errors: list[str] = []
        warnings: list[str] = []
        errors += _column_differences(conn, t, warnings)
        live_columns = {c["name"] for c in inspector.get_columns(t.name, schema=t.schema)}
        for column in ("key_digest",):
            if column in live_columns and not _has_unique(inspector, t, [column]):
                errors.append(
                    f"no unique constraint or unique index on {column}: concurrent first"
                    " requests could both run the view (C8)"
                )
        if "expires_at_ms" in live_columns and not _has_leading_index(
            inspector, t, "expires_at_ms"
        ):
            warnings.append(
                f"no index starting with expires_at_ms (expected ix_{t.name}_expires_at_ms):"
                " prune has to scan the whole table"
            )
        return SchemaReport(t.name, True, tuple(errors), tuple(warnings))

    def check_identity(self) -> IdentityReport:
        """The identity table: there, as the code defines it, and its row (read only:
        ``check`` never writes the row, the first process that uses Redis does)."""
        return self._run(self._check_identity)

    def _check_identity(self, conn: Connection) -> IdentityReport:
        t = self.identity_table
        if not inspect(conn).has_table(t.name, schema=t.schema):
            return IdentityReport(t.name, False, (), (), None)
        warnings: list[str] = []
        errors = _column_differences(conn, t, warnings)
        identity = None if errors else read_identity(conn, t)
        return IdentityReport(t.name, True, tuple(errors), tuple(warnings), identity)


def _column_differences(conn: Connection, table: Table, warnings: list[str]) -> list[str]:
    """Column-level differences, through Alembic's autogenerate comparison when installed.

    Alembic knows which reflected types are equivalent on each dialect
    (``BIGINT`` for ``BigInteger``, ``BYTEA`` for ``LargeBinary``…); without it
    only names and nullability are compared.
    """
    try:
        from alembic.autogenerate import compare_metadata
        from alembic.migration import MigrationContext
    except ImportError:  # pragma: no cover - alembic ships with Flask-Migrate
        return _column_names_and_nullability(conn, table, warnings)

    expected = MetaData()
    table.to_metadata(expected)

    def only_our_table(name: str | None, type_: str, parent_names: Any) -> bool:
        return type_ != "table" or name == table.name

    context = MigrationContext.configure(
        conn,
        opts={
            "compare_type": True,
            "compare_server_default": False,
            "include_name": only_our_table,
            "include_schemas": False,
        },
    )
    errors: list[str] = []
    for diff in _flatten(compare_metadata(context, expected)):
        kind = diff[0]
        if kind == "add_column":
            errors.append(f"missing column {diff[3].name} ({_type_name(diff[3].type, conn)})")
        elif kind == "remove_column":
            column = diff[3]
            message = f"unexpected column {column.name}"
            if not column.nullable and column.server_default is None:
                errors.append(message + ": NOT NULL without a default, so every insert fails")
            else:
                warnings.append(message + " (not used by this version)")
        elif kind == "modify_type":
            live, wanted = _type_name(diff[5], conn), _type_name(diff[6], conn)
            errors.append(f"column {diff[3]} is {live}, expected {wanted}")
        elif kind == "modify_nullable":
            live, wanted = diff[5], diff[6]
            errors.append(
                f"column {diff[3]} is {'NULL' if live else 'NOT NULL'},"
                f" expected {'NULL' if wanted else 'NOT NULL'}"
            )
        # Constraints and indexes are checked by meaning below, not by name:
        # an application's naming convention may rename them legitimately.
    return errors


def _type_name(type_: Any, conn: Connection) -> str:
    """A column type as this database spells it (``BYTEA`` on PostgreSQL, ``LONGBLOB`` on
    MySQL), not SQLAlchemy's generic name (``BLOB`` for every ``LargeBinary``)."""
    try:
        return str(type_.compile(dialect=conn.dialect))
    except Exception:  # a type this dialect cannot render: its generic name
        return str(type_)


def _flatten(diffs: list[Any]) -> Iterator[tuple[Any, ...]]:
    """Alembic nests column modifications in lists; yield every diff as one tuple."""
    for diff in diffs:
        if isinstance(diff, list):
            yield from diff
        else:
            yield diff


def _column_names_and_nullability(
    conn: Connection, table: Table, warnings: list[str]
) -> list[str]:  # pragma: no cover - only without alembic
    live = {c["name"]: c for c in inspect(conn).get_columns(table.name, schema=table.schema)}
    errors = []
    for column in table.columns:
        found = live.get(column.name)
        if found is None:
            errors.append(f"missing column {column.name} ({_type_name(column.type, conn)})")
        elif bool(found["nullable"]) != bool(column.nullable) and not column.primary_key:
            errors.append(f"column {column.name} nullability differs from the expected")
    for name in sorted(set(live) - set(table.columns.keys())):
        warnings.append(f"unexpected column {name} (not used by this version)")
    return errors


def _has_unique(inspector: Any, table: Table, columns: list[str]) -> bool:
    for constraint in inspector.get_unique_constraints(table.name, schema=table.schema):
        if list(constraint["column_names"]) == columns:
            return True
    for index in inspector.get_indexes(table.name, schema=table.schema):
        if index.get("unique") and list(index["column_names"]) == columns:
            return True
    return False


def _has_leading_index(inspector: Any, table: Table, column: str) -> bool:
    for index in inspector.get_indexes(table.name, schema=table.schema):
        names = list(index["column_names"])
        if names and names[0] == column:
            return True
    return False


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _case_one(condition: Any) -> Any:
    return case((condition, 1), else_=0)


def _when(condition: Any, value: Any) -> Any:
    return case((condition, value), else_=None)
