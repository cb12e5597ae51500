"""The ``flask idempotency`` command group (CONTRACT C28–C29).

Every command reports a database it cannot reach as one ``Error:`` line and
exit status 1, and none of them creates the table unless told to with
``create-table``. Records are named as the request path names them: the digest
of (scope, key), so the operator gives the raw key and the scope it was sent in.

A record holds what a client sent (its path, the scope a loader read from the
request, the response the view made of it), so nothing of it reaches the
operator's terminal raw: control and format characters are escaped
(:func:`printable`), and ``show --body`` writes the stored bytes as they are only
when its output is not a terminal, or with ``--raw`` (issue 26).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from flask import current_app
from flask.cli import AppGroup
from sqlalchemy.exc import InterfaceError, OperationalError

from .cli_render import body_limit, describe_record, iso, moment, printable
from .fingerprint import ANONYMOUS_SCOPE, authorization_scope, key_digest, with_host
from .keys import InvalidKey, parse_key
from .store import StoreError
from .store.identity import missing_help
from .store.maintenance import (
    IdentityReport,
    Maintenance,
    MaintenanceError,
    TableMissing,
)

F = TypeVar("F", bound=Callable[..., Any])

idempotency_cli = AppGroup("idempotency", help="Maintain the Flask-Idempotency records.")

#: Without a terminal, ``prune`` prints a progress line this often instead of a bar.
_PROGRESS_EVERY_SECONDS = 5.0


# -- plumbing --------------------------------------------------------------------------


def _stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


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
            what = printable(str(exc), keep_lines=True)
            if isinstance(cause, (OperationalError, InterfaceError)):
                raise click.ClickException(f"database unavailable: {what}") from None
            raise click.ClickException(f"database error: {what}") from None

    return run  # type: ignore[return-value]


def _missing_table_help(what: str) -> str:
    what = printable(what)
    table = printable(_state().store.table.name)
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
    click.echo(_deleted(deleted, batches))
    if out_of_time:
        click.echo(
            f"Stopped after --max-seconds {max_seconds:g}; about"
            f" {max(estimate - deleted, 0)} expired records remain for the next run."
        )


def _deleted(deleted: int, batches: int) -> str:
    """``Deleted 1 expired record in 1 batch.``; with nothing to delete, it says so (it
    read "Deleted 0 expired records in 1 batches.")."""
    if not deleted:
        return "Deleted 0 expired records: there were none."
    records = "record" if deleted == 1 else "records"
    return f"Deleted {deleted} expired {records} in {batches} batch{'' if batches == 1 else 'es'}."


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
        f"Table {printable(maintenance.table.name)} at {iso(now)} (database clock)",
        f"  records                 {stats.total}",
        f"  completed               {stats.completed}",
        f"  in progress             {stats.in_progress}",
        f"    with a lapsed lease   {stats.stale_leases}",
        f"  expired, awaiting prune {stats.prunable}",
        "  oldest in progress      created " + moment(stats.oldest_in_progress_created_ms, now),
        "  earliest lease expiry   " + moment(stats.oldest_in_progress_lease_ms, now),
        "  earliest record expiry  " + moment(stats.oldest_expiry_ms, now),
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
            help="Without a scope_loader: the request's Authorization header value; '-'"
            " asks for it (hidden) or reads it from stdin, out of the shell's history.",
        ),
        click.option(
            "--host",
            default=None,
            help="Without a scope_loader, on a route with a subdomain or a host (or with"
            " IDEMPOTENCY_SCOPE_HOST): the request's host (the default scope carries it).",
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
    host: str | None = None,
) -> str:
    """The digest the request path would give this (scope, key) (C5, C22)."""
    given = [
        name
        for name, value in (("--scope", scope), ("--authorization", authorization))
        if value is not None
    ] + (["--digest"] if by_digest else [])
    if len(given) > 1:
        raise click.UsageError("Give at most one of --scope, --authorization and --digest.")
    if host is not None and (scope is not None or by_digest):
        raise click.UsageError(
            "--host names a default scope (no scope_loader): it goes with --authorization"
            " or alone, not with --scope or --digest."
        )
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
        if authorization == "-":
            authorization = _read_authorization()
        try:
            full_scope = authorization_scope(authorization, current_app)
        except (RuntimeError, StoreError) as exc:  # (the store's own secret, unreadable)
            raise click.ClickException(printable(str(exc), keep_lines=True)) from None
    else:
        full_scope = ANONYMOUS_SCOPE
    if host is not None:
        full_scope = with_host(full_scope, host)
    return key_digest(full_scope, parsed)


def _read_authorization() -> str:
    """The header value for ``--authorization -``: asked for, unechoed, on a terminal;
    else the first line of stdin. Either way it never lands in the shell's history."""
    if sys.stdin.isatty():
        value: str = click.prompt("Authorization header", hide_input=True, err=True)
    else:
        value = sys.stdin.readline().rstrip("\r\n")
    if not value:
        raise click.BadParameter("no header value was given.", param_hint="--authorization")
    return value


@idempotency_cli.command("show")
@_record_options
@click.option("--body", "with_body", is_flag=True, help="Also print the stored response body.")
@click.option(
    "--raw",
    is_flag=True,
    help="With --body: write the body's bytes as they are even to a terminal (piped"
    " output always gets them as they are).",
)
@database_errors
def show_command(
    key: str,
    scope: str | None,
    authorization: str | None,
    host: str | None,
    by_digest: bool,
    with_body: bool,
    raw: bool,
) -> None:
    """Show the record of an Idempotency-Key: state, times (UTC), status, body size.

    With neither --scope nor --authorization the key is looked up in the shared
    "anonymous" scope, where requests without credentials land. To a terminal,
    --body shows the body with control characters escaped (as \\x1b, \\u202e);
    piped, or with --raw, it writes the stored bytes.
    """
    if raw and not with_body:
        raise click.UsageError("--raw goes with --body.")
    maintenance = _maintenance()
    maintenance.require_table()
    digest = _resolve_digest(maintenance, key, scope, authorization, by_digest, host)
    record = maintenance.lookup(digest, with_body=with_body)
    if record is None:
        raise _no_record(digest, scope, authorization, by_digest)
    click.echo("\n".join(describe_record(record)))
    if with_body and record.body is not None:
        click.echo("")
        if raw or not _stdout_is_terminal():
            click.echo(record.body)
        else:
            click.echo(printable(record.body.decode("utf-8", "surrogateescape"), keep_lines=True))


@idempotency_cli.command("forget")
@_record_options
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@database_errors
def forget_command(
    key: str,
    scope: str | None,
    authorization: str | None,
    host: str | None,
    by_digest: bool,
    yes: bool,
) -> None:
    """Delete the record of an Idempotency-Key, whatever its state.

    The next request with that key runs the view again: use it only when the
    stored outcome is known to be wrong. The cached copy is dropped as well.
    """
    maintenance = _maintenance()
    maintenance.require_table()
    digest = _resolve_digest(maintenance, key, scope, authorization, by_digest, host)
    record = maintenance.lookup(digest)
    if record is None:
        raise _no_record(digest, scope, authorization, by_digest)
    click.echo("\n".join(describe_record(record)))
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
    """Check the marked routes against the app's settings, the database and the table
    against this version's definition, then the Redis tier."""
    routes = _check_routes()
    maintenance = _maintenance()
    report = maintenance.check_schema()
    if not report.exists:
        raise TableMissing(f"the table {report.table!r} does not exist")
    for warning in report.warnings:
        click.echo(f"warning: {printable(warning)}", err=True)
    if report.errors:
        for error in report.errors:
            click.echo(f"  - {printable(error)}", err=True)
        raise click.ClickException(
            f"the table {report.table!r} does not match what Flask-Idempotency expects"
            f" ({len(report.errors)} problem{'s' if len(report.errors) != 1 else ''} above)."
            " Migrate it to the definition in flask_idempotency/store/table.py."
        )
    click.echo(f"OK: the table {report.table!r} matches what Flask-Idempotency expects.")
    state = _state()
    click.echo(body_limit(state.settings.max_body_bytes, state.store.largest_body()))
    _check_identity(maintenance.check_identity())
    _check_redis_tier()
    routes()


def _check_routes() -> Callable[[], None]:
    """List what is wrong with the marked routes (C56, C63) now, before anything that may
    fail; return what says the verdict at the end (exit 1 for a route that cannot be
    served). The app's views are final here, as at its first request."""
    from .marks import marked
    from .misuse import findings

    state = _state()
    views = current_app.view_functions
    found = findings(current_app, state.settings, views, has_db=state.has_db)
    for finding in found:
        kind = "error" if finding.error else "warning"
        click.echo(f"{kind}: {printable(finding.message)}", err=True)
    count = sum(1 for view in views.values() if marked(view))
    broken = len({finding.endpoint for finding in found if finding.error})
    unprotected = len({finding.endpoint for finding in found if not finding.error})

    def verdict() -> None:
        if broken:
            raise click.ClickException(
                f"{broken} route{' cannot' if broken == 1 else 's cannot'} be served (above):"
                " each answers 500 route-misconfigured until its options are fixed."
            )
        routes = f"{count} route{'' if count == 1 else 's'} marked @idempotent"
        if unprotected:
            click.echo(f"Routes: {routes}; {unprotected} of them run unprotected (above).")
        else:
            click.echo(f"OK: {routes}, none misconfigured.")

    return verdict


def _check_identity(report: IdentityReport) -> None:
    """The store's identity (``<table>_store``), which names its records in Redis (C41):
    missing is an error with a Redis tier (it stays off until the table is there), a
    warning without one."""
    from .state import redis_target

    state = _state()
    table = printable(report.table)
    if not report.exists:
        help_text = printable(
            missing_help(state.store.table.name, migrations=_uses_migrations()), keep_lines=True
        )
        if redis_target(state.settings, state.extension._redis) is None:
            click.echo(f"warning: {help_text} (needed once IDEMPOTENCY_REDIS_URL is set)", err=True)
            return
        raise click.ClickException(help_text)
    for warning in report.warnings:
        click.echo(f"warning: {printable(warning)}", err=True)
    if report.errors:
        for error in report.errors:
            click.echo(f"  - {printable(error)}", err=True)
        raise click.ClickException(
            f"the table {table!r} does not match what Flask-Idempotency expects"
            " (problems above). Migrate it to the definition in"
            " flask_idempotency/store/identity.py."
        )
    if report.identity is None:
        click.echo(
            f"OK: the table {table!r} is there; the store's identity is written by the"
            " first process that uses Redis."
        )
        return
    secret = (
        "" if report.identity.secret else "; its secret is written by the next process to read it"
    )
    click.echo(
        f"OK: the table {table!r} holds the store's identity {printable(report.identity.id)}"
        f" (written {iso(report.identity.created_at_ms)}){secret}."
    )


@idempotency_cli.command("create-table")
@click.option("--sql", "sql_only", is_flag=True, help="Print the DDL instead of running it.")
@database_errors
def create_table_command(sql_only: bool) -> None:
    """Create the records table and its identity, for apps that do not manage them with
    migrations."""
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
    missing = [
        table.name
        for table, exists in (
            (maintenance.table, maintenance.table_exists()),
            (maintenance.identity_table, maintenance.identity_table_exists()),
        )
        if not exists
    ]
    if not missing:
        if maintenance.add_secret_column():
            click.echo(_SECRET_ADDED.format(maintenance.identity_table.name))
            return
        click.echo(f"The table {maintenance.table.name!r} already exists; nothing to do.")
        return
    secret_added = maintenance.create_table()
    for name in missing:
        what = " (the store's identity, C41)" if name == maintenance.identity_table.name else ""
        click.echo(f"Created the table {name!r}{what}.")
    if secret_added:
        click.echo(_SECRET_ADDED.format(maintenance.identity_table.name))


_SECRET_ADDED = "Added the column 'secret' to {!r} (the store's secret, C60)."


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
    target = None if target is None else printable(target)
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
    from .tier import store_origin

    store = state.store
    origin = store_origin(store.identity().id, store.table.fullname)
    click.echo(f"  origin: {origin} (names this store's records: its identity and table)")


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
