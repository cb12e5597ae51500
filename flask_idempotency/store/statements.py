"""The store's statements on the records table, as SQLAlchemy Core constructs.

CONTRACT C13, C14, C20, C21, C44.

The same on every database: what differs is in :mod:`.dialects`. Times come from the
database's clock (:class:`.clock.db_now_ms`, C42). Every write an owner makes is
fenced by its lock token (C14), and the request's values are bound parameters, so
:class:`~flask_idempotency.store.sql.DurableStore` builds each statement of the
request path once and keeps it.
"""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import BigInteger, Table, and_, bindparam, delete, not_, select, update

from ..records import COMPLETED, IN_PROGRESS, Claim, Identity, Record, StoredResponse
from .clock import db_now_ms


def new_token() -> str:
    """A fresh lock token: 128 random bits as 32 hex digits, like ``uuid4().hex`` without
    building a UUID (a few µs per first execution, issue 11)."""
    return os.urandom(16).hex()


# -- the claim --------------------------------------------------------------------------------


def claim_values(t: Table) -> dict[str, Any]:
    """The claim's column values: the request's as parameters, times from the database."""
    now = db_now_ms()
    return {
        "key_digest": bindparam("p_key_digest", type_=t.c.key_digest.type),
        "scope": bindparam("p_scope", type_=t.c.scope.type),
        "fingerprint": bindparam("p_fingerprint", type_=t.c.fingerprint.type),
        "method": bindparam("p_method", type_=t.c.method.type),
        "path": bindparam("p_path", type_=t.c.path.type),
        "state": IN_PROGRESS,
        "lock_token": bindparam("p_lock_token", type_=t.c.lock_token.type),
        "created_at_ms": now,
        "expires_at_ms": now + bindparam("p_ttl_ms", type_=BigInteger()),
        "lease_expires_at_ms": now + bindparam("p_lease_ms", type_=BigInteger()),
    }


def claim_params(ident: Identity, token: str, ttl_ms: int, lease_ms: int) -> dict[str, Any]:
    """The bound values of a claim INSERT, alone or inside the claim-or-read statement."""
    return {
        "p_key_digest": ident.key_digest,
        "p_scope": ident.scope,
        "p_fingerprint": ident.fingerprint,
        "p_method": ident.method,
        "p_path": ident.path[:2048],
        "p_lock_token": token,
        "p_ttl_ms": ttl_ms,
        "p_lease_ms": lease_ms,
    }


def replace_expired(
    t: Table, record: Record, ident: Identity, token: str, ttl_ms: int, lease_ms: int
) -> Any:
    """Turn an expired record into a fresh claim in one conditional UPDATE (C21)."""
    now = db_now_ms()
    return (
        update(t)
        .where(
            t.c.id == record.id,
            t.c.expires_at_ms <= now,
            not_(and_(t.c.state == IN_PROGRESS, t.c.lease_expires_at_ms > now)),
        )
        .values(
            scope=ident.scope,
            fingerprint=ident.fingerprint,
            method=ident.method,
            path=ident.path[:2048],
            state=IN_PROGRESS,
            lock_token=token,
            created_at_ms=now,
            expires_at_ms=now + ttl_ms,
            lease_expires_at_ms=now + lease_ms,
            completed_at_ms=None,
            response_status=None,
            response_headers=None,
            response_body=None,
            body_omitted=False,
        )
    )


def take_over(t: Table, record: Record, token: str, lease_ms: int) -> Any:
    """Take a lapsed lease with one conditional UPDATE; among racers one wins (C13)."""
    now = db_now_ms()
    return (
        update(t)
        .where(
            t.c.id == record.id,
            t.c.state == IN_PROGRESS,
            t.c.lock_token == record.lock_token,
            t.c.lease_expires_at_ms <= now,
        )
        .values(lock_token=token, lease_expires_at_ms=now + lease_ms)
    )


# -- reads --------------------------------------------------------------------------------------


def select_record(t: Table) -> Any:
    """The record named by the ``p_key_digest`` parameter, with the database's ``now_ms``."""
    return select(t, db_now_ms().label("now_ms")).where(
        t.c.key_digest == bindparam("p_key_digest", type_=t.c.key_digest.type)
    )


def expiry_of(t: Table, record_id: Any) -> Any:
    """The expiry of one record (read back where ``UPDATE … RETURNING`` is missing)."""
    return select(t.c.expires_at_ms).where(t.c.id == record_id)


# -- the owner's writes, fenced by its token ----------------------------------------------------


def fenced_completion(
    t: Table, record_id: Any, lock_token: Any, status: Any, headers: Any, body: Any, omitted: Any
) -> Any:
    """The fenced UPDATE that completes a record with the response."""
    # The completed row keeps its owner's token, so that a completion whose COMMIT
    # reply was lost recognises its own write when retried (C14); a completed
    # record itself is never written again.
    return (
        update(t)
        .where(t.c.id == record_id, t.c.lock_token == lock_token, t.c.state == IN_PROGRESS)
        .values(
            state=COMPLETED,
            response_status=status,
            response_headers=headers,
            response_body=body,
            body_omitted=omitted,
            completed_at_ms=db_now_ms(),
            lease_expires_at_ms=None,
        )
    )


def bound_completion(t: Table) -> Any:
    """:func:`fenced_completion` with the claim's and response's values as parameters."""
    return fenced_completion(
        t,
        bindparam("p_record_id", type_=t.c.id.type),
        bindparam("p_lock_token", type_=t.c.lock_token.type),
        bindparam("p_status", type_=t.c.response_status.type),
        bindparam("p_headers", type_=t.c.response_headers.type),
        bindparam("p_body", type_=t.c.response_body.type),
        bindparam("p_body_omitted", type_=t.c.body_omitted.type),
    )


def completion_of(t: Table, claim: Claim, response: StoredResponse) -> Any:
    """:func:`fenced_completion` with the claim's and response's values written in."""
    return fenced_completion(
        t,
        claim.record_id,
        claim.lock_token,
        response.status,
        response.headers_json(),
        response.body,
        response.body_omitted,
    )


def completion_params(claim: Claim, response: StoredResponse) -> dict[str, Any]:
    """The fenced completion's bound values, on either execution path."""
    return {
        "p_record_id": claim.record_id,
        "p_lock_token": claim.lock_token,
        "p_status": response.status,
        "p_headers": response.headers_json(),
        "p_body": response.body,
        "p_body_omitted": response.body_omitted,
    }


def applied_expiry(t: Table) -> Any:
    """The expiry of a record this claim has completed (a retried completion's check)."""
    return select(t.c.expires_at_ms).where(
        t.c.id == bindparam("p_record_id", type_=t.c.id.type),
        t.c.lock_token == bindparam("p_lock_token", type_=t.c.lock_token.type),
        t.c.state == COMPLETED,
    )


def owner_params(claim: Claim) -> dict[str, Any]:
    """The bound values naming the owner's record: its id and lock token."""
    return {"p_record_id": claim.record_id, "p_lock_token": claim.lock_token}


def fenced_release(t: Table) -> Any:
    """The owner's fenced DELETE, with the claim's id and token as parameters."""
    return delete(t).where(
        t.c.id == bindparam("p_record_id", type_=t.c.id.type),
        t.c.lock_token == bindparam("p_lock_token", type_=t.c.lock_token.type),
        t.c.state == IN_PROGRESS,
    )


def still_there(t: Table) -> Any:
    """Whether the record is still there (a retried release's check)."""
    return select(t.c.id).where(t.c.id == bindparam("p_record_id", type_=t.c.id.type))


def fenced_renewal(t: Table, lease: float) -> Any:
    """The fenced UPDATE that extends a lease to ``lease`` seconds from now (C44)."""
    return (
        update(t)
        .where(
            t.c.id == bindparam("p_record_id", type_=t.c.id.type),
            t.c.lock_token == bindparam("p_lock_token", type_=t.c.lock_token.type),
            t.c.state == IN_PROGRESS,
        )
        .values(lease_expires_at_ms=db_now_ms() + int(lease * 1000))
    )
