"""The durable store: the source of truth for claims, leases and results.

CONTRACT C8, C13–C14, C20–C21, C25–C26, C45.

One SQL implementation (:mod:`.sql`) with a small part per database
(:mod:`.dialects`), the table (:mod:`.table`), the database clock (:mod:`.clock`),
the fast path on psycopg2 (:mod:`.direct`) and the operator's statements
(:mod:`.maintenance`); :class:`.interface.Store` is what the rest of the package
asks of it. The names below are what the rest of the package uses.
"""

from typing import TYPE_CHECKING

from .errors import StoreError, StoreMisconfigured, StoreRefused
from .interface import Store
from .sql import ClaimUnanswered, DurableStore

if TYPE_CHECKING:  # the SQL implementation is a Store
    _IS_A_STORE: type[Store] = DurableStore

__all__ = [
    "ClaimUnanswered",
    "DurableStore",
    "Store",
    "StoreError",
    "StoreMisconfigured",
    "StoreRefused",
]
