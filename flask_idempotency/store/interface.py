"""What the rest of the package asks of a durable store (CONTRACT C8, C13–C14, C20–C21, C44).

The lifecycle, ``once()``, the heartbeat and atomic mode use only these; the SQL
implementation (:class:`~flask_idempotency.store.sql.DurableStore`) is the one store.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import Engine, Table

from ..records import Claim, Identity, Record, StoredResponse


class Store(Protocol):
    """The durable store's interface: claims, reads and the owner's fenced writes."""

    table: Table

    @property
    def engine(self) -> Engine:
        """The engine for transactions (heartbeats make their own pool from it)."""
        ...

    def engine_without_setup(self) -> Engine:
        """The engine, without creating the table on first use (operator commands)."""
        ...

    def create_table(self) -> None:
        """Create the table if it is missing."""
        ...

    def acquire(
        self, ident: Identity, *, ttl: float, lease: float, guard_locks: bool = False
    ) -> Claim | Record:
        """Claim the record for ``ident``, or return the record in the way (C8, C13, C21)."""
        ...

    def get(self, key_digest: str) -> Record | None:
        """The record named ``key_digest``, read with the database clock."""
        ...

    def complete(self, claim: Claim, response: StoredResponse, *, kept: bool = False) -> int | None:
        """Complete the record; its expiry, or ``None`` if the lease was lost (C14).
        ``kept``: a kept settlement's try, which recognises an earlier try's landing (C58)."""
        ...

    def complete_in(self, executor: Any, claim: Claim, response: StoredResponse) -> int | None:
        """:meth:`complete` inside the caller's transaction (atomic mode, C40)."""
        ...

    def fitting(self, response: StoredResponse) -> StoredResponse:
        """``response``, its body omitted (C33) where the database would refuse it (C58)."""
        ...

    def largest_body(self) -> int | None:
        """The largest body this database takes in one completion; ``None``: unknown."""
        ...

    def release(self, claim: Claim, *, kept: bool = False) -> bool:
        """Delete the owner's record; ``False`` if the lease was lost (C20).
        ``kept``: a kept settlement's try, which recognises an earlier try's landing (C58)."""
        ...

    def renew(self, claims: list[Claim], lease: float, *, engine: Engine | None = None) -> set[int]:
        """Extend the leases of ``claims``; the ids of the records renewed (C44)."""
        ...
