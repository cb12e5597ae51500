"""Wake-ups: how a parked duplicate learns that the original finished (C10–C12).

Within a process the :class:`~.hub.WakeupHub` wakes the parked requests of a record;
across processes a :class:`~.hub.CrossProcessChannel` carries the wake-up: Redis
pub/sub on one node or Sentinel (:mod:`.redis`), sharded pub/sub on a Cluster
(:mod:`.cluster`), read by one listener thread per process (:mod:`.listener`).
Without a channel, waiters poll the store. Only the hub is imported here; the Redis
parts are loaded by the tier that builds them.
"""

from __future__ import annotations

from .hub import (
    CrossProcessChannel,
    Parked,
    PollSchedule,
    TooManyWaiters,
    WakeupHub,
    wait_for_owner,
)

__all__ = [
    "CrossProcessChannel",
    "Parked",
    "PollSchedule",
    "TooManyWaiters",
    "WakeupHub",
    "wait_for_owner",
]
