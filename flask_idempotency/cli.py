"""The ``flask idempotency`` command group (CONTRACT C28–C29).

Every command reports a database it cannot reach as one ``Error:`` line and
exit status 1, and none of them creates the table unless told to with
``create-table``. Records are named as the request path names them: the digest
of (scope, key), so the operator gives the raw key and the scope it was sent in.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, TypeVar

import click
from flask import current_app
from flask.cli import AppGroup
from sqlalchemy.exc import InterfaceError, OperationalError

from .fingerprint import ANONYMOUS_SCOPE, key_digest
from .keys import InvalidKey, parse_key
from .store.maintenance import Maintenance, MaintenanceError, RecordView, TableMissing

F = TypeVar("F", bound=Callable[..., Any])

idempotency_cli = AppGroup("idempotency", help="Maintain the Flask-Idempotency records.")

#: Without a terminal, ``prune`` prints a progress line this often instead of a bar.
_PROGRESS_EVERY_SECONDS = 5.0


# -- plumbing --------------------------------------------------------------------------


def _state() -> Any:
    state = current_app.extensions.get("idempotency")
    if state is None:
        raise click.ClickException(
            "Flask-Idempotency is not initialised on this app: call Idempotency(app)"
            " or idempotency.init_app(app) in the app factory."
        )
    return state


def _maintenance() -> Maintenance:
    return Maintenance(_state().store)


def _uses_migrations() -> bool:
    """``Idempotency(db=...)``: the table lives on the app's metadata and its migrations."""
    return bool(_state().has_db)


def database_errors(command: F) -> F:
    """Turn a database failure into one clear line and exit status 1, never a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except TableMissing as exc:
            raise click.ClickException(_missing_table_help(str(exc))) from None
        except MaintenanceError as exc:
            cause = exc.__cause__
            if isinstance(cause, (OperationalError, InterfaceError)):
                raise click.ClickException(f"database unavailable: {exc}") from None
            raise click.ClickException(f"database error: {exc}") from None

    return run  # type: ignore[return-value]


def _missing_table_help(what: str) -> str:
    table = _state().store.table.name
    if _uses_migrations():
        return (
            f"{what}. Idempotency(db=...) defines it on your app's metadata; create it"
            f" with a migration:\n"
            f'  flask db migrate -m "add {table} table"\n'
            f"  flask db upgrade"
        )
    return (
        f"{what}. Create it with:\n"
        f"  flask idempotency create-table\n"
        f"or have your DBA run the statements of `flask idempotency create-table --sql`."
    )


def _iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _relative(ms: int | None, now_ms: int) -> str:
    if ms is None:
        return ""
    delta = (ms - now_ms) / 1000
    span = _span(abs(delta))
    return f" (in {span})" if delta >= 0 else f" ({span} ago)"


def _moment(ms: int | None, now_ms: int) -> str:
    """ISO-8601 UTC, and how far from now: what an operator reading a record wants."""
    return _iso(ms) + _relative(ms, now_ms)


def _span(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m {seconds % 60:.0f}s"
    if seconds < 86400:
        return f"{seconds // 3600:.0f}h {seconds % 3600 // 60:.0f}m"
    return f"{seconds // 86400:.0f}d {seconds % 86400 // 3600:.0f}h"


# -- prune -----------------------------------------------------------------------------


@idempotency_cli.command("prune")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Rows deleted per transaction; smaller batches hold row locks for less time.",
)
@click.option("--dry-run", is_flag=True, help="Only count the records that would be deleted.")
@click.option(
    "--max-seconds",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Stop after this many seconds; the next run carries on.",
)
@click.option(
    "--pause",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="Seconds to sleep between batches, to spare a busy database.",
)
@database_errors
def prune_command(batch_size: int, dry_run: bool, max_seconds: float | None, pause: float) -> None:
    """Delete expired records in bounded batches.

    A record in progress whose lease is still live is never deleted, even past
    its expiry. Safe to run from several hosts at once: on PostgreSQL each batch
    skips rows another prune (or a request) holds locked.
    """
    maintenance = _maintenance()
    maintenance.require_table()
    if dry_run:
        count = maintenance.count_prunable()
        click.echo(f"{count} expired records would be deleted (dry run, nothing deleted).")
        return
    estimate = maintenance.count_prunable()
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    deleted = batches = 0
    out_of_time = False
    resume_at: int | None = None
    with _progress(estimate, show=estimate > batch_size) as advance:
        while True:
            try:
                batch = maintenance.prune_batch(batch_size, from_expiry=resume_at)
            except MaintenanceError:
                if deleted:
                    click.echo(f"Deleted {deleted} expired records before the error.", err=True)
                raise
            count, resume_at = batch.deleted, batch.last_expiry
            deleted += count
            batches += 1
            advance(count)
            if count < batch_size:
                break  # nothing (unlocked) left to delete
            if deadline is not None and time.monotonic() >= deadline:
                out_of_time = True
                break
            if pause:
                time.sleep(pause)
    click.echo(f"Deleted {deleted} expired records in {batches} batches.")
    if out_of_time:
        click.echo(
            f"Stopped after --max-seconds {max_seconds:g}; about"
            f" {max(estimate - deleted, 0)} expired records remain for the next run."
        )


@contextmanager
def _progress(total: int, *, show: bool) -> Iterator[Callable[[int], None]]:
    """A bar on a terminal, a line every few seconds in a log, nothing for short runs."""
    if not show:
        yield lambda count: None
        return
    if sys.stderr.isatty():
        with click.progressbar(length=total, label="Pruning", file=sys.stderr) as bar:
            yield bar.update
        return
    done = 0
    last = time.monotonic()

    def advance(count: int) -> None:
        nonlocal done, last
        done += count
        if time.monotonic() - last >= _PROGRESS_EVERY_SECONDS:
            last = time.monotonic()
            click.echo(f"pruned {done} of about {total} expired records…", err=True)

    yield advance


# -- stats -----------------------------------------------------------------------------


@idempotency_cli.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")
@database_errors
def stats_command(as_json: bool) -> None:
    """Records by state, the oldest claim in progress, and what prune would delete."""
    maintenance = _maintenance()
    maintenance.require_table()
    stats = maintenance.stats()
    if as_json:
        click.echo(json.dumps(stats.__dict__, sort_keys=True))
        return
    now = stats.now_ms
    lines = [
        f"Table {maintenance.table.name} at {_iso(now)} (database clock)",
        f"  records                 {stats.total}",
        f"  completed               {stats.completed}",
        f"  in progress             {stats.in_progress}",
        f"    with a lapsed lease   {stats.stale_leases}",
        f"  expired, awaiting prune {stats.prunable}",
        "  oldest in progress      created " + _moment(stats.oldest_in_progress_created_ms, now),
        "  earliest lease expiry   " + _moment(stats.oldest_in_progress_lease_ms, now),
        "  earliest record expiry  " + _moment(stats.oldest_expiry_ms, now),
    ]
    click.echo("\n".join(lines))


# -- show / forget ---------------------------------------------------------------------


def _record_options(command: F) -> F:
    """The options that name a record the way the request path does."""
    options = [
        click.argument("key"),
        click.option(
            "--scope",
            default=None,
            help="The value your scope_loader returned for the request (tenant, user…).",
        ),
        click.option(
            "--authorization",
            default=None,
            help="Without a scope_loader: the request's Authorization header value.",
        ),
        click.option(
            "--digest",
            "by_digest",
            is_flag=True,
            help="KEY is a record digest, or its first 8+ characters as logged.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _resolve_digest(
    maintenance: Maintenance,
    key: str,
    scope: str | None,
    authorization: str | None,
    by_digest: bool,
) -> str:
    """The digest the request path would give this (scope, key) (C5, C22)."""
    given = [
        name
        for name, value in (("--scope", scope), ("--authorization", authorization))
        if value is not None
    ] + (["--digest"] if by_digest else [])
    if len(given) > 1:
        raise click.UsageError("Give at most one of --scope, --authorization and --digest.")
    if by_digest:
        prefix = key.strip().lower()
        if len(prefix) < 8 or any(c not in "0123456789abcdef" for c in prefix):
            raise click.BadParameter(
                "a digest is hexadecimal, at least 8 characters.", param_hint="KEY"
            )
        if len(prefix) == 64:
            return prefix
        matches = maintenance.digests_starting_with(prefix)
        if not matches:
            raise click.ClickException(f"no record has a digest starting with {prefix}.")
        if len(matches) > 1:
            raise click.ClickException(f"several records start with {prefix}; give more of it.")
        return matches[0]
    try:
        parsed = parse_key([key], strict=False, max_length=4096)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc), param_hint="KEY") from None
    assert parsed is not None  # a non-empty value is never "absent" outside strict mode
    if scope is not None:
        full_scope = "scope:" + scope
    elif authorization is not None:
        full_scope = "auth:" + hashlib.sha256(authorization.encode("latin-1")).hexdigest()
    else:
        full_scope = ANONYMOUS_SCOPE
    return key_digest(full_scope, parsed)


def _describe_record(record: RecordView) -> list[str]:
    now = record.now_ms
    lines = [
        f"digest         {record.key_digest}",
        f"scope          {record.scope}",
        f"state          {record.state}",
        f"request        {record.method} {record.path}",
        f"created        {_iso(record.created_at_ms)}{_relative(record.created_at_ms, now)}",
        f"expires        {_iso(record.expires_at_ms)}{_relative(record.expires_at_ms, now)}",
    ]
    if record.lease_expires_at_ms is not None:
        lines.append(
            f"lease until    {_iso(record.lease_expires_at_ms)}"
            f"{_relative(record.lease_expires_at_ms, now)}"
        )
    if record.completed_at_ms is not None:
        lines.append(
            f"completed      {_iso(record.completed_at_ms)}{_relative(record.completed_at_ms, now)}"
        )
    if record.response_status is not None:
        size = record.body_size or 0
        omitted = (
            " (body omitted: larger than IDEMPOTENCY_MAX_BODY_BYTES)" if record.body_omitted else ""
        )
        lines.append(f"status         {record.response_status}")
        lines.append(f"body           {size} bytes{omitted}")
        if record.response_headers:
            headers = ", ".join(name for name, _ in json.loads(record.response_headers))
            lines.append(f"headers        {headers}")
    return lines


@idempotency_cli.command("show")
@_record_options
@click.option("--body", "with_body", is_flag=True, help="Also print the stored response body.")
@database_errors
def show_command(
    key: str, scope: str | None, authorization: str | None, by_digest: bool, with_body: bool
) -> None:
    """Show the record of an Idempotency-Key: state, times (UTC), status, body size.

    With neither --scope nor --authorization the key is looked up in the shared
    "anonymous" scope, where requests without credentials land.
    """
    maintenance = _maintenance()
    maintenance.require_table()
    digest = _resolve_digest(maintenance, key, scope, authorization, by_digest)
    record = maintenance.lookup(digest, with_body=with_body)
    if record is None:
        raise _no_record(digest, scope, authorization, by_digest)
    click.echo("\n".join(_describe_record(record)))
    if with_body and record.body is not None:
        click.echo("")
        click.echo(record.body)


@idempotency_cli.command("forget")
@_record_options
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@database_errors
def forget_command(
    key: str, scope: str | None, authorization: str | None, by_digest: bool, yes: bool
) -> None:
    """Delete the record of an Idempotency-Key, whatever its state.

    The next request with that key runs the view again: use it only when the
    stored outcome is known to be wrong. The cached copy is dropped as well.
    """
    maintenance = _maintenance()
    maintenance.require_table()
    digest = _resolve_digest(maintenance, key, scope, authorization, by_digest)
    record = maintenance.lookup(digest)
    if record is None:
        raise _no_record(digest, scope, authorization, by_digest)
    click.echo("\n".join(_describe_record(record)))
    lease_live = (
        record.state == "in_progress"
        and record.lease_expires_at_ms is not None
        and record.lease_expires_at_ms > record.now_ms
    )
    if lease_live:
        click.echo(
            "warning: a request holds this key right now; forgetting it lets a retry run"
            " the view a second time while the first is still running.",
            err=True,
        )
    if not yes:
        click.confirm("Forget this record so the key runs the view again?", abort=True)
    deleted = maintenance.forget(digest)
    _state().cache.discard(digest)
    if deleted:
        click.echo(f"Forgot the record {digest[:16]}.")
    else:
        click.echo(f"The record {digest[:16]} was already gone.")


# -- schema ----------------------------------------------------------------------------


@idempotency_cli.command("check")
@database_errors
def check_command() -> None:
    """Check the database and the table against this version's definition, then the Redis tier."""
    maintenance = _maintenance()
    report = maintenance.check_schema()
    if not report.exists:
        raise TableMissing(f"the table {report.table!r} does not exist")
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)
    if report.errors:
        for error in report.errors:
            click.echo(f"  - {error}", err=True)
        raise click.ClickException(
            f"the table {report.table!r} does not match what Flask-Idempotency expects"
            f" ({len(report.errors)} problem{'s' if len(report.errors) != 1 else ''} above)."
            " Migrate it to the definition in flask_idempotency/store/table.py."
        )
    click.echo(f"OK: the table {report.table!r} matches what Flask-Idempotency expects.")
    _check_redis_tier()


@idempotency_cli.command("create-table")
@click.option("--sql", "sql_only", is_flag=True, help="Print the DDL instead of running it.")
@database_errors
def create_table_command(sql_only: bool) -> None:
    """Create the records table, for apps that do not manage it with migrations."""
    maintenance = _maintenance()
    if sql_only:
        click.echo(maintenance.create_ddl())
        return
    if _uses_migrations():
        raise click.ClickException(
            "this app passes db= to Idempotency, so the table belongs in its migrations:\n"
            f'  flask db migrate -m "add {maintenance.table.name} table"\n'
            "  flask db upgrade\n"
            "or, without Flask-Migrate, db.create_all() in an app context;"
            " `flask idempotency create-table --sql` prints the DDL."
        )
    if maintenance.table_exists():
        click.echo(f"The table {maintenance.table.name!r} already exists; nothing to do.")
        return
    maintenance.create_table()
    click.echo(f"Created the table {maintenance.table.name!r}.")


#: How long ``check`` gives the wake-up listener to confirm its subscription.
LISTENER_CHECK_SECONDS = 5.0


def _check_redis_tier() -> None:
    """Report the Redis tier: configured, reachable, prefix, wake-up listener live (C10, C24).

    Requests never fail because Redis is down (C24), which is exactly why the
    operator's check must say so: a configured tier that does not answer exits 1.
    """
    from .state import redis_target

    state = _state()
    target = redis_target(state.settings, state.extension._redis)
    if target is None:
        click.echo(
            "Redis tier: none (IDEMPOTENCY_REDIS_URL is not set): no cache; wake-ups reach"
            " only requests in the same process, others poll the database."
        )
        return
    click.echo(f"Redis tier: configured, {target}, prefix {state.settings.redis_prefix!r}")
    if not state.cache.ping():
        click.echo("  reachable: NO")
        raise click.ClickException(
            f"Redis at {target} does not answer. Requests still work, from the database"
            " alone and slower; fix the URL or the server."
        )
    click.echo("  reachable: yes (PING answered)")
    channel = state.wakeups.channel
    channel.ensure_listening(state.wakeups)
    listener = channel.listener
    if not listener.wait_until_live(LISTENER_CHECK_SECONDS):
        click.echo("  wake-up listener: NOT live")
        raise click.ClickException(
            f"the wake-up listener did not subscribe to {listener.channel!r} within"
            f" {LISTENER_CHECK_SECONDS:g} s: waiting duplicates will poll instead"
            " (is pub/sub allowed on this Redis?)."
        )
    click.echo(f"  wake-up listener: live (subscribed to {listener.channel!r})")


def _no_record(
    digest: str, scope: str | None, authorization: str | None, by_digest: bool
) -> click.ClickException:
    """ "No record", naming the scope searched and how to search another (C56)."""
    if by_digest:
        return click.ClickException(f"no record has the digest {digest[:16]}… (any longer).")
    if scope is not None:
        where = f"in scope {scope!r} (as the scope_loader returned it)"
    elif authorization is not None:
        where = "in the scope of that Authorization header"
    else:
        where = "in the shared 'anonymous' scope, where requests without credentials land"
    return click.ClickException(
        f"no record for that key {where} (digest {digest[:16]}). A key belongs to the scope"
        " its request had: give --scope VALUE (what the app's scope_loader returned for"
        " the request), or --authorization VALUE (no scope_loader: the request's"
        " Authorization header), or --digest PREFIX (from a log line)."
    )
