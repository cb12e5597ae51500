"""The example's database: one Flask-SQLAlchemy ``db`` and the ``Payment`` model.

The idempotency records table is defined on the same ``db.metadata`` by
``Idempotency(db=db)``, so ``flask db migrate`` sees both tables.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import DateTime, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

db = SQLAlchemy()

#: ``datetime.UTC`` only exists from Python 3.11; the package supports 3.10.
UTC = timezone.utc


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Payment(db.Model):  # type: ignore[name-defined,misc]
    """A charge the (simulated) gateway accepted: the side effect a retry must not repeat."""

    __tablename__ = "payments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    amount_cents: Mapped[int] = mapped_column(Integer, nullable=False)
    currency: Mapped[str] = mapped_column(String(3), nullable=False)
    description: Mapped[str | None] = mapped_column(String(255), nullable=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="succeeded")
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=_utcnow
    )

    def to_json(self) -> dict[str, Any]:
        """The public representation, the same on the first answer and on a replay."""
        created = self.created_at
        if created.tzinfo is None:  # SQLite hands back naive datetimes
            created = created.replace(tzinfo=UTC)
        return {
            "id": self.id,
            "amount_cents": self.amount_cents,
            "currency": self.currency,
            "description": self.description,
            "status": self.status,
            "created_at": created.isoformat().replace("+00:00", "Z"),
        }
