"""The host's spool of settlements handed on by a process that ended (C59).

A kept settlement (:mod:`.deferred`) is a fenced write: "complete the record of
this key, if it is still in progress under this lock token" or "delete it, under
the same condition" (C14). Applied late, or twice, or by another process, it does
what it would have done in its owner, or nothing: a record someone else took over
or completed stands. So a process that must end before the store answers (gunicorn's
``--max-requests``, a graceful restart, a rolling deploy, SIGTERM) writes each pending
settlement here instead of dropping it, and the next process of the same app on the
host adopts it: renews its lease by token while the store is still down, lands it
when the store answers, and runs its promotion, wake-up and signals
(:mod:`.inherit`).

On disk: one directory per store (a digest of its database URL without the password
and its table), one JSON file per settlement. A file is written to a temporary name,
flushed to disk, then renamed into place (``os.replace``), and the directory is
flushed too: a reader sees a whole file or none, also after a crash of the host. A
reader claims a file by renaming it to a name of its own first; a rename succeeds
for one of two racing readers only, so no two processes adopt one settlement (were
they to, the fenced write would still land once). A file that does not read back
whole (a torn copy, a full disk, another format) is set aside under ``*.torn``
with a log line, never applied. A claimed file whose claimer died before it had
read it is taken again. An ending process writes its files before its exit flush,
named as its own (``*.leaving-<pid>``): no other process takes one while that process
lives, and once it is gone (ended, or killed in the middle of the flush by a
supervisor's grace period) any process does. A file that has landed meanwhile is
removed; the rest are renamed for anyone to take once the owner stops trying them
(:meth:`.heartbeat.Renewer.hand_over`): at worst the owner's last try, already on
the wire, lands too, and the reader's fenced write then changes nothing. The directory is made
``0700`` and its files ``0600``: they hold stored response bodies and lock tokens,
and a directory another user can write to is refused (its files could have been
planted).

What it cannot do: a host that dies with its spool (or a container whose spool is not
on a volume its successor mounts) loses those settlements, and their keys run again
once their leases lapse, as before the spool existed (docs/guarantees.md).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..records import Claim, Identity, StoredResponse

log = logging.getLogger("flask_idempotency")

#: The format of a spooled settlement; a file of another version is set aside, not read.
VERSION = 1
#: What a spooled settlement does.
ACTIONS = ("complete", "release", "release-unanswered")
_SUFFIX = ".json"
_TAKEN = ".taken-"
_LEAVING = ".leaving-"


@dataclasses.dataclass(frozen=True)
class Handover:
    """A kept settlement as it is handed on: everything its fenced write and what follows
    it need, and nothing that exists only in its owner's process."""

    #: ``"complete"``, ``"release"`` or ``"release-unanswered"`` (by key and token, C58).
    action: str
    claim: Claim
    ident: Identity
    #: The route's lease (seconds): what each renewal extends it to.
    lease: float
    #: The endpoint the signals name.
    route: str | None
    #: When it is given up (wall clock, seconds since the epoch): the owner's start plus
    #: ``IDEMPOTENCY_MAX_RUNTIME``, set when it is spooled (a monotonic clock does not
    #: cross processes).
    give_up_at: float = 0.0
    #: The response a completion stores.
    response: StoredResponse | None = None
    #: A release's reason and status (the ``claim_released`` signal).
    reason: str | None = None
    status: int | None = None
    #: ``"release-unanswered"``: until when a missing record may still appear (wall clock).
    until: float = 0.0

    def to_json(self) -> bytes:
        response = self.response
        payload = {
            "v": VERSION,
            "action": self.action,
            "claim": [
                self.claim.record_id,
                self.claim.lock_token,
                self.claim.expires_at_ms,
                self.claim.how,
            ],
            "ident": [
                self.ident.scope,
                self.ident.key_digest,
                self.ident.fingerprint,
                self.ident.method,
                self.ident.path,
            ],
            "lease": self.lease,
            "route": self.route,
            "give_up_at": self.give_up_at,
            "response": None
            if response is None
            else [
                response.status,
                [list(pair) for pair in response.headers],
                base64.b64encode(response.body).decode("ascii"),
                response.body_omitted,
            ],
            "reason": self.reason,
            "status": self.status,
            "until": self.until,
        }
        body = json.dumps(payload, separators=(",", ":"), sort_keys=True)
        digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
        return json.dumps({"sha256": digest, "payload": body}).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> Handover:
        """Read a spooled settlement back; ``ValueError`` unless it is whole and of this
        version."""
        try:
            outer = json.loads(data)
            body = outer["payload"]
            if hashlib.sha256(body.encode("utf-8")).hexdigest() != outer["sha256"]:
                raise ValueError("its checksum does not match")
            p = json.loads(body)
            if p["v"] != VERSION:
                raise ValueError(f"format version {p['v']!r}, not {VERSION}")
            if p["action"] not in ACTIONS or (p["action"] == "complete") != bool(p["response"]):
                raise ValueError(f"no settlement this version knows: {p['action']!r}")
            response = p["response"]
            return cls(
                action=str(p["action"]),
                claim=Claim(*p["claim"]),
                ident=Identity(*p["ident"]),
                lease=float(p["lease"]),
                route=p["route"],
                give_up_at=float(p["give_up_at"]),
                response=None
                if response is None
                else StoredResponse(
                    int(response[0]),
                    tuple((str(name), str(value)) for name, value in response[1]),
                    base64.b64decode(response[2]),
                    bool(response[3]),
                ),
                reason=p["reason"],
                status=p["status"],
                until=float(p["until"]),
            )
        except ValueError:
            raise
        except Exception as exc:  # a missing field, a wrong type: not a whole file
            raise ValueError(f"{type(exc).__name__}: {exc}") from None


def default_root() -> Path:
    """Where spools live unless ``IDEMPOTENCY_SPOOL_DIR`` says: the system's temporary
    directory, one per user (another user's workers can neither read nor plant files)."""
    return Path(tempfile.gettempdir()) / f"flask-idempotency-spool-{os.getuid()}"


def store_key(url: str, table: str) -> str:
    """The name of one store's directory: its database (password hidden) and its table."""
    return hashlib.sha256(f"{url}\x00{table}".encode()).hexdigest()[:24]


def directory(root: Path, key: str) -> Path:
    """The store's spool directory under ``root``, made private if it is new; ``OSError``
    when it cannot be made or another user could write to it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / key
    path.mkdir(mode=0o700, exist_ok=True)
    for where in (root, path):
        info = where.stat()
        if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PermissionError(
                f"{where} belongs to another user or others may write to it; a spool there"
                " could hold planted files"
            )
    return path


def write(path: Path, handover: Handover, *, leaving: bool = False) -> Path:
    """Write one settlement into the store's directory ``path``, whole or not at all.

    ``leaving``: under a name that marks it as still this process's (``*.leaving-<pid>``),
    which no other process takes while this one lives (:func:`publish` hands it on now).
    """
    name = f"{int(handover.give_up_at)}-{os.getpid()}-{secrets.token_hex(8)}"
    tmp = path / f".{name}.tmp"
    final = path / (f"{name}{_LEAVING}{os.getpid()}" if leaving else f"{name}{_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(handover.to_json())
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _sync_directory(path)
    return final


def publish(leaving: Path) -> Path:
    """Hand a file written with ``leaving=True`` on to any process now."""
    final = leaving.with_name(leaving.name.split(_LEAVING)[0] + _SUFFIX)
    os.replace(leaving, final)
    _sync_directory(leaving.parent)
    return final


def take(path: Path) -> Iterator[tuple[Handover, Path]]:
    """Claim and read each whole settlement in ``path``, one at a time, with the name it
    is claimed under: the caller removes it (:func:`remove`) once it has adopted it.

    A file another process claimed first is skipped (its rename fails here); one a
    claimer that died left behind is claimed again, and so is one this process claimed
    and could not adopt; one that does not read back whole is set aside as ``*.torn``
    with an ERROR line.
    """
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    me = os.getpid()
    for name in sorted(names):
        if name.endswith(_SUFFIX):
            source = name
        elif _TAKEN in name and _claimer_gone(name, _TAKEN, mine=True):
            source = name  # its claimer died before it had read it (or it is ours)
        elif _LEAVING in name and _claimer_gone(name, _LEAVING, mine=False):
            source = name  # its process was killed in its exit flush: handed on
        else:
            continue  # a temporary file being written, a torn one, another's claim
        stem = name.split(_TAKEN)[0].split(_LEAVING)[0].removesuffix(_SUFFIX)
        claimed = path / f"{stem}{_TAKEN}{me}"
        try:
            os.rename(path / source, claimed)
        except FileNotFoundError:
            continue  # another process claimed it first
        try:
            handover = Handover.from_json(claimed.read_bytes())
        except (OSError, ValueError) as exc:
            torn = path / f"{stem}.torn"
            os.replace(claimed, torn)
            log.error(
                "idempotency: the spooled settlement %s is not whole (%s); it is set aside,"
                " not applied: its key runs again once its lease lapses",
                torn,
                exc,
            )
            continue
        yield handover, claimed


def remove(claimed: Path) -> None:
    """Forget a claimed file whose settlement this process now keeps."""
    try:
        os.unlink(claimed)
    except FileNotFoundError:
        pass


def _claimer_gone(name: str, marker: str, *, mine: bool) -> bool:
    """Whether the process named after ``marker`` is gone (or is this one, if ``mine``)."""
    try:
        pid = int(name.rsplit(marker, 1)[1])
    except ValueError:
        return False
    if pid == os.getpid():
        return mine
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _sync_directory(path: Path) -> None:
    """Flush the directory entry of a renamed file to disk (a rename is durable only then)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
