"""The durable store: the source of truth for claims, leases and results (CONTRACT C8, C13–C14,
C20–C21, C26, C45)."""

from .sql import DurableStore, StoreError, StoreMisconfigured, _describe, _sqlstate

__all__ = ["DurableStore", "StoreError", "StoreMisconfigured", "_describe", "_sqlstate"]
