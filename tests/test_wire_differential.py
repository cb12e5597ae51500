"""Differential tests of the hand-written wire code against the libraries it stands in for
(issue 21 item 3; CONTRACT C51).

:mod:`flask_idempotency._wire` writes by hand some of what psycopg2, psycopg 3 and
redis-py would otherwise write. Each test here fuzzes values (hypothesis, derandomized:
the same examples on every run, so a CI verdict does not depend on luck) and asserts that
the hand-written side gives exactly what the library gives:

* psycopg2 (``_wire/psycopg2.py``): it writes ``PREPARE``/``EXECUTE`` by hand and lets
  psycopg2 quote the values (its literal writer went in issue 21: it saved less than the
  noise); plain, prepared and prefixed runs give the row psycopg2 gives for SQLAlchemy's
  statement and parameters, or fail the same way, under every client encoding
  PostgreSQL accepts from psycopg2 and ``standard_conforming_strings`` on and off.
* psycopg 3 (``_wire/psycopg.py``): it binds through psycopg but sends statement texts
  it encoded itself; rows and column names come back as from psycopg's own cursor,
  prepared or not, and through the client-side-binding cursor of the asynchronous claim.
* Redis (``_wire/redis.py``): the pre-packed ``GET`` is byte for byte redis-py's
  ``pack_command``, and the reader's replies (one by one, or with error replies kept as
  values) are what redis-py's own client reads, in RESP2 and RESP3.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine
from sqlalchemy.engine import URL

from flask_idempotency.store import DurableStore

from .conftest import driver_url

#: Every encoding of PostgreSQL 15 (``pg_encoding_to_char(0..41)``): checked against the
#: server by :func:`test_i21_3_every_postgresql_encoding_is_covered`.
POSTGRES_ENCODINGS = (
    "SQL_ASCII", "EUC_JP", "EUC_CN", "EUC_KR", "EUC_TW", "EUC_JIS_2004", "UTF8",
    "MULE_INTERNAL", "LATIN1", "LATIN2", "LATIN3", "LATIN4", "LATIN5", "LATIN6", "LATIN7",
    "LATIN8", "LATIN9", "LATIN10", "WIN1256", "WIN1258", "WIN866", "WIN874", "KOI8R",
    "WIN1251", "WIN1252", "ISO_8859_5", "ISO_8859_6", "ISO_8859_7", "ISO_8859_8", "WIN1250",
    "WIN1253", "WIN1254", "WIN1255", "WIN1257", "KOI8U", "SJIS", "BIG5", "GBK", "UHC",
    "GB18030", "JOHAB", "SHIFT_JIS_2004",
)  # fmt: skip
#: Client encodings a psycopg2 connection to a UTF8 database cannot use at all: psycopg2
#: knows no Python codec for EUC_TW, and the server converts no UTF8 to MULE_INTERNAL.
#: (Neither can the store's engine then: nothing is written in them.)
NOT_CLIENT_ENCODINGS = ("EUC_TW", "MULE_INTERNAL")
CLIENT_ENCODINGS = tuple(e for e in POSTGRES_ENCODINGS if e not in NOT_CLIENT_ENCODINGS)
#: Encodings where Python's codec (psycopg2's side) and PostgreSQL's conversion disagree
#: on some characters (SJIS: "¢" comes back "￠"; SHIFT_JIS_2004: "~" comes back "‾"),
#: or where the server refuses some characters Python encodes: psycopg2's own parameters
#: do not round-trip there either. Everywhere else text comes back exactly.
INEXACT_ENCODINGS = frozenset(
    {"EUC_JP", "EUC_KR", "EUC_JIS_2004", "SJIS", "BIG5", "JOHAB", "SHIFT_JIS_2004"}
)

FUZZ = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

#: Text as it breaks quoting: quotes, backslashes, placeholders, NUL, non-ASCII.
AWKWARD = st.sampled_from(
    ["'", "''", "\\", "\\'", "E'", "%", "%%", "%s", "%(p_scope)s", "\x00", "\\x00", "~", "é",
     "€", "¥", "‾", "\u3000", "表", "ソ", "\U0001f600", "\t", "\n", "\r", "\x7f", " -1"]
)  # fmt: skip
TEXT = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),  # plain
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.lists(st.one_of(AWKWARD, st.text(max_size=4)), max_size=8).map("".join),
)
# -- psycopg2 --------------------------------------------------------------------------


def libpq_url(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def psycopg2_cursor(pg_database: URL, encoding: str, conforming: str) -> Iterator[Any]:
    """A cursor of a psycopg2 connection in ``encoding`` with ``standard_conforming_strings``
    set to ``conforming`` (libpq's quoting follows the setting the server reports)."""
    dsn = libpq_url(driver_url(pg_database, "psycopg2"))  # without the driver: CI fails, else skip
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        conn.set_client_encoding(encoding)
        cursor = conn.cursor()
        cursor.execute(f"SET standard_conforming_strings = {conforming}")
        assert conn.get_parameter_status("standard_conforming_strings") == conforming
        yield cursor
    finally:
        conn.close()


@pytest.mark.postgres
def test_i21_3_every_postgresql_encoding_is_covered(pg_database: URL) -> None:
    """The encodings the tests below run through are all of the server's, and the two
    they leave out cannot be a psycopg2 connection's client encoding at all."""
    import psycopg2

    with psycopg2_cursor(pg_database, "UTF8", "on") as cursor:
        cursor.execute(
            "SELECT pg_encoding_to_char(i) FROM generate_series(0, 63) AS i"
            " WHERE pg_encoding_to_char(i) <> ''"
        )
        assert tuple(row[0] for row in cursor.fetchall()) == POSTGRES_ENCODINGS
        cursor.execute("SHOW server_encoding")
        assert cursor.fetchone()[0] == "UTF8"
        for encoding in NOT_CLIENT_ENCODINGS:
            with pytest.raises((psycopg2.OperationalError, psycopg2.NotSupportedError)):
                cursor.connection.set_client_encoding(encoding)
            cursor.connection.rollback()


def differential_statement(dialect: Any, prefix: str, make: Callable[..., Any]) -> tuple[Any, Any]:
    """A statement of every kind of value the store binds (and a constant of its own, as
    the claim's state), compiled for ``dialect``; ``make(compiled, prefix)`` is the
    direct path's form of it. Returns (that form, SQLAlchemy's compilation)."""
    import sqlalchemy as sa

    statement = sa.select(
        sa.bindparam("p_text", type_=sa.Text).label("text"),
        sa.bindparam("p_int", type_=sa.BigInteger).label("number"),
        sa.bindparam("p_body", type_=sa.LargeBinary).label("body"),
        sa.bindparam("p_flag", type_=sa.Boolean).label("flag"),
        # (cast: as an untyped literal a float comes back as numeric, typed it does not)
        sa.cast(sa.bindparam("p_float", type_=sa.Float), sa.Float).label("real"),
        sa.literal("in_progress ~ o'brien %").label("state"),
        sa.bindparam("p_text", type_=sa.Text).label("again"),  # one value in two places
    )
    compiled = statement.compile(dialect=dialect)
    return make(compiled, prefix), compiled


#: Values of every kind a statement of the store binds, fuzzed.
BOUND = st.fixed_dictionaries(
    {
        "p_text": st.one_of(TEXT, st.none()),
        "p_int": st.one_of(st.integers(-(2**64), 2**64), st.none()),
        "p_body": st.one_of(st.binary(max_size=40), st.none()),
        "p_flag": st.one_of(st.booleans(), st.none()),
        "p_float": st.one_of(st.floats(allow_nan=False), st.none()),
    }
)


@pytest.mark.postgres
@pytest.mark.parametrize("encoding", CLIENT_ENCODINGS)
def test_i21_3_psycopg2_statements_give_what_psycopg2s_own_execution_gives(
    pg_database: URL, encoding: str
) -> None:
    """``_wire/psycopg2.py`` writes ``PREPARE``/``EXECUTE`` by hand (psycopg2 has no API
    for them) and lets psycopg2 quote every value: for fuzzed values, its plain, prepared
    (first use on a connection, then again) and prefixed (the asynchronous claim's
    setting) runs give the row psycopg2 gives for SQLAlchemy's statement run with
    SQLAlchemy's parameters, or fail the same way, in ``encoding`` with
    ``standard_conforming_strings`` on and off. Values have their parameter's type, as
    the store's do (a prepared statement's parameters are typed; a plain statement's
    literals are not, so ``1`` for a boolean differs there by PostgreSQL's rules)."""
    import psycopg2
    from sqlalchemy.dialects.postgresql import psycopg2 as dialect_module

    from flask_idempotency._wire import psycopg2 as wire
    from flask_idempotency.store.dialects.postgresql import _ASYNC_PREFIX

    dialect = dialect_module.dialect()

    def make(compiled: Any, prefix: str) -> Any:
        return wire.DirectSQL(compiled, dialect, None, prefix)

    direct, compiled = differential_statement(dialect, "", make)
    prefixed, _ = differential_statement(dialect, _ASYNC_PREFIX, make)

    def result(run: Callable[..., Any], *args: Any) -> Any:
        try:
            row = run(*args)
        except (psycopg2.Error, UnicodeEncodeError, ValueError) as exc:
            return type(exc), getattr(exc, "pgcode", None)
        return tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)

    def own(cursor: Any, sql: str, params: dict[str, Any]) -> Any:
        cursor.execute(sql, params)
        return cursor.fetchone()

    def fuzz_on(cursor: Any) -> None:
        @settings(FUZZ, max_examples=10)
        @given(BOUND)
        @example(
            {"p_text": "é~\\'%", "p_int": -1, "p_body": b"\x00", "p_flag": True, "p_float": 1.5}
        )
        @example(
            {"p_text": "a\x00b", "p_int": 2**63, "p_body": b"", "p_flag": None, "p_float": -0.0}
        )
        @example(
            {
                "p_text": "%(p_int)s %s %%",
                "p_int": 0,
                "p_body": b"'\\",
                "p_flag": True,
                "p_float": 0.0,
            }
        )
        def check(params: dict[str, Any]) -> None:
            merged = {**compiled.params, **params}
            reference = result(own, cursor, compiled.string, merged)
            # The connection's info (which statements its server holds), as the pool
            # keeps it: the first prepared run sends PREPARE with its EXECUTE.
            cursor.execute("DEALLOCATE ALL")
            info: dict[str, Any] = {}
            for prepare in (False, True, True):
                ours = result(wire.fetchone, cursor, info, direct, params, prepare)
                assert ours == reference, (prepare, params)
            # One simple query is one implicit transaction: the SET LOCAL holds in it.
            reference = result(own, cursor, _ASYNC_PREFIX + compiled.string, merged)
            ours = result(wire.fetchone, cursor, info, prefixed, params, True)
            assert ours == reference, ("prefixed, prepared before", params)
            cursor.execute("DEALLOCATE ALL")
            ours = result(wire.fetchone, cursor, {}, prefixed, params, True)
            assert ours == reference, ("prefixed, first", params)

        check()

    for conforming in ("on", "off"):
        with psycopg2_cursor(pg_database, encoding, conforming) as cursor:
            fuzz_on(cursor)


@pytest.mark.postgres
@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_i21_3_a_table_name_the_client_encoding_writes_differently_still_works(
    pg_database: URL, driver: str
) -> None:
    """The direct path sends its statements as UTF-8 bytes it encoded once; a table name
    that is not ASCII, on a connection whose client encoding is not UTF8, reached the
    server as another name ("relation "idem_Ã©_..." does not exist": a deployment error
    on every request). Such a store keeps SQLAlchemy's ordinary path."""
    from flask_idempotency.records import Identity, Record, StoredResponse

    url = driver_url(pg_database, driver).update_query_dict({"client_encoding": "latin1"})
    name = f"idem_é_{uuid.uuid4().hex[:8]}"
    args = {"prepare_threshold": None} if driver == "psycopg" else {}
    store = DurableStore(
        lambda: create_engine(url, pool_size=2, connect_args=args),
        table_name=name,
        create_table=True,
    )
    try:
        ident = Identity("anonymous", "a" * 64, "f" * 64, "POST", "/é")
        assert store._direct() is None, "SQLAlchemy's path encodes the SQL for the connection"
        claim = store.acquire(ident, ttl=60, lease=30)
        assert not isinstance(claim, Record)
        response = StoredResponse(201, (("Content-Type", "text/plain"),), b"ok")
        assert store.complete(claim, response) == claim.expires_at_ms
        replay = store.acquire(ident, ttl=60, lease=30)
        assert isinstance(replay, Record) and replay.response == response
    finally:
        store.table.drop(store.engine, checkfirst=True)
        store.identity_table.drop(store.engine, checkfirst=True)
        store.engine.dispose()


# -- psycopg 3 -------------------------------------------------------------------------


@contextmanager
def psycopg_connection(pg_database: URL, encoding: str, conforming: str) -> Iterator[Any]:
    """A psycopg 3 connection as the store's engine makes it (autocommit, no preparation
    by psycopg itself) in ``encoding``, ``standard_conforming_strings`` ``conforming``."""
    dsn = libpq_url(driver_url(pg_database, "psycopg"))
    import psycopg

    conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None, client_encoding=encoding)
    try:
        conn.execute(f"SET standard_conforming_strings = {conforming}")
        yield conn
    finally:
        conn.close()


def psycopg_statement(pg_database: URL, prefix: str) -> tuple[Any, Any]:
    """:func:`differential_statement` compiled for psycopg 3's direct path."""
    from flask_idempotency._wire.psycopg import PsycopgSQL

    engine = create_engine(driver_url(pg_database, "psycopg"))
    try:
        dialect = engine.dialect
    finally:
        engine.dispose()
    return differential_statement(
        dialect, prefix, lambda compiled, prefix: PsycopgSQL(compiled, None, prefix)
    )


def psycopg_outcome(run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``: the row and column names it gives, or its failure's type and SQLSTATE."""
    import psycopg

    try:
        return run(*args)
    except (psycopg.Error, UnicodeEncodeError, ValueError) as exc:
        return type(exc), getattr(exc, "sqlstate", None)


def described(cursor: Any, row: Any) -> tuple[Any, list[str]]:
    return row, [column.name for column in cursor.description]


def psycopg_own(cursor: Any, query: str, values: list[Any]) -> Any:
    """psycopg's own cursor running the statement as text (psycopg encodes it)."""
    return described(cursor, cursor.execute(query, values).fetchone())


def psycopg_own_prefixed(client: Any, query: str, values: list[Any]) -> Any:
    """psycopg's client-side-binding cursor running the setting and the statement as text."""
    client.execute(query, values)
    client.nextset()
    return described(client, client.fetchone())


def direct_run(
    cursor: Any, info: dict[str, Any], statement: Any, params: Any, prepare: bool
) -> Any:
    from flask_idempotency._wire import psycopg as wire

    row = wire.fetchone(cursor, info, statement, params, prepare)
    # The asynchronous claim runs on the connection's client-side-binding cursor.
    return described(info.get(wire._CLIENT_CURSOR, cursor), row)


#: The asynchronous claim's setting (``IDEMPOTENCY_ASYNC_CLAIM``), run before a statement.
ASYNC_PREFIX = "SET LOCAL synchronous_commit = off; "


@pytest.mark.postgres
@pytest.mark.parametrize("encoding", CLIENT_ENCODINGS)
def test_i21_3_psycopg3_statements_give_what_psycopgs_own_cursor_gives(
    pg_database: URL, encoding: str
) -> None:
    """``_wire/psycopg.py`` binds through psycopg but sends a statement text it encoded
    once (UTF-8 bytes): for fuzzed values, its plain, prepared, pipelined (first use on a
    connection) and prefixed (the asynchronous claim, psycopg's client-side binding) runs
    give the rows and column names psycopg's own cursors give for the statement as text,
    or fail the same way, in ``encoding`` with ``standard_conforming_strings`` on and off."""
    import psycopg

    from flask_idempotency._wire import psycopg as wire
    from flask_idempotency._wire.compiled import PLACEHOLDER

    if not wire.USABLE:
        pytest.fail("this psycopg lacks what the direct path uses")
    direct, compiled = psycopg_statement(pg_database, "")
    prefixed, _ = psycopg_statement(pg_database, ASYNC_PREFIX)
    text_query = PLACEHOLDER.sub("%s", compiled.string)
    names = PLACEHOLDER.findall(compiled.string)

    def fuzz_on(conn: Any) -> None:
        cursor = conn.cursor()
        client = psycopg.ClientCursor(conn)
        kept: dict[str, Any] = {}  # the pooled connection's info: prepared once

        @settings(FUZZ, max_examples=10)
        @given(BOUND)
        @example({"p_text": "é~\\'%", "p_int": -1, "p_body": b"\x00", "p_flag": 1, "p_float": 1.5})
        @example(
            {"p_text": "a\x00b", "p_int": 2**63, "p_body": b"", "p_flag": None, "p_float": -0.0}
        )
        def check(params: dict[str, Any]) -> None:
            values = [{**compiled.params, **params}[name] for name in names]
            reference = psycopg_outcome(psycopg_own, cursor, text_query, values)
            for prepare, info in ((False, {}), (True, kept), (True, {})):
                ours = psycopg_outcome(direct_run, cursor, info, direct, params, prepare)
                assert ours == reference, (prepare, params)
            reference = psycopg_outcome(
                psycopg_own_prefixed, client, ASYNC_PREFIX + text_query, values
            )
            ours = psycopg_outcome(direct_run, cursor, {}, prefixed, params, True)
            assert ours == reference, ("prefixed", params)

        check()

    for conforming in ("on", "off"):
        with psycopg_connection(pg_database, encoding, conforming) as conn:
            fuzz_on(conn)


# -- Redis -----------------------------------------------------------------------------


class _Sent:
    """A pooled connection that keeps what is sent on it (for :class:`_Reader`)."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_packed_command(self, packed: Any) -> None:
        self.sent.append(packed)

    def read_response(self) -> None:
        return None

    def disconnect(self) -> None:  # pragma: no cover - nothing fails here
        pass


class _OnePool:
    max_connections = 4
    connection_class = object

    def __init__(self) -> None:
        self.connection = _Sent()

    def get_connection(self) -> _Sent:
        return self.connection

    def release(self, conn: _Sent) -> None:  # pragma: no cover - kept aside, not released
        pass


@settings(FUZZ, max_examples=300)
@given(st.one_of(st.binary(max_size=80), st.text(st.characters(codec="utf-8"), max_size=40)))
@example(b"")
@example(b"*1\r\n$3\r\nGET\r\n")
@example(b"k" * 7000)  # redis-py sends a value above 6000 bytes as a buffer of its own
@example("clé:\x00\r\n")
def test_i21_3_the_pre_packed_get_is_redis_pys_own_packing(name: bytes | str) -> None:
    """``_Reader.get`` writes ``GET`` by hand: byte for byte what redis-py's
    ``Connection.pack_command`` writes for the same key (a text key as the cache and the
    cluster pass it, UTF-8 encoded, as redis-py's default encoder encodes it)."""
    from redis.connection import Connection

    from flask_idempotency._wire.redis import _Reader

    pool = _OnePool()
    key = name.encode("utf-8") if isinstance(name, str) else name
    assert _Reader(pool).get(key) is None
    [packed] = pool.connection.sent
    assert b"".join(packed) == b"".join(Connection().pack_command("GET", name))


#: Keys the fuzzed commands share (so they meet each other's values and types).
REDIS_KEYS = (b"k", b"h", b"s", b"l", b"z", "clé", b"\r\n$3\r\nGET\r\n\x00")
REDIS_VALUE = st.one_of(
    st.binary(max_size=30),
    st.text(st.characters(codec="utf-8"), max_size=10),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
)
REDIS_KEY = st.sampled_from(REDIS_KEYS)
REDIS_SCORE = st.floats(allow_nan=False)
#: Commands whose replies are of every type: simple strings, bulk strings, nil, integers,
#: doubles (RESP3), arrays, maps and sets (RESP3), and error replies (wrong type, not an
#: integer, unknown command, a negative expiry).
REDIS_COMMAND = st.one_of(
    st.tuples(st.just("SET"), REDIS_KEY, REDIS_VALUE),
    st.tuples(st.just("SET"), REDIS_KEY, REDIS_VALUE, st.just("PX"), st.integers(-1, 10**6)),
    st.tuples(st.sampled_from(["GET", "EXISTS", "DEL", "INCR", "STRLEN", "TYPE"]), REDIS_KEY),
    st.tuples(st.sampled_from(["HGETALL", "SMEMBERS", "TTL"]), REDIS_KEY),
    st.tuples(st.just("APPEND"), REDIS_KEY, REDIS_VALUE),
    st.tuples(st.just("HSET"), REDIS_KEY, REDIS_VALUE, REDIS_VALUE),
    st.tuples(st.just("SADD"), REDIS_KEY, REDIS_VALUE),
    st.tuples(st.just("RPUSH"), REDIS_KEY, REDIS_VALUE),
    st.tuples(st.just("LRANGE"), REDIS_KEY, st.just(0), st.just(-1)),
    st.tuples(st.just("ZADD"), REDIS_KEY, REDIS_SCORE, REDIS_VALUE),
    st.tuples(st.just("ZSCORE"), REDIS_KEY, REDIS_VALUE),
    st.tuples(st.just("ZRANGE"), REDIS_KEY, st.just(0), st.just(-1), st.just("WITHSCORES")),
    st.tuples(st.just("INCRBYFLOAT"), REDIS_KEY, st.floats(-1e6, 1e6)),
    st.tuples(st.sampled_from(["ECHO", "NOSUCHCOMMAND"]), REDIS_VALUE),
)


def redis_outcome(value: Any) -> Any:
    """A reply as compared: an error reply by its type and message."""
    if isinstance(value, Exception):
        return type(value), str(value)
    return value


@pytest.mark.redis
@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
def test_i21_3_replies_read_by_the_reader_are_what_redis_py_reads(
    redis_server: Any, protocol: int
) -> None:
    """Fuzzed commands sent together by the reader (``run_together``: error replies kept
    as values, every reply read) give, reply for reply, what redis-py's own client gives
    for each command (its response callbacks off: the raw reply, as the reader returns
    it); and the hand-packed ``GET`` of every key returns, or raises, what ``client.get``
    does. Two databases of one server hold the same data: the reader's and redis-py's."""
    import redis

    from flask_idempotency._wire.redis import _reader_for

    base = redis_server.url.rsplit("/", 1)[0]
    ours = redis.Redis.from_url(f"{base}/0", protocol=protocol)
    theirs = redis.Redis.from_url(f"{base}/1", protocol=protocol)
    theirs.response_callbacks.clear()  # the parsed reply itself, not a Python convenience
    reader = _reader_for(ours)
    assert reader is not None, "a plain client reads through the fast path"

    def own(command: tuple[Any, ...]) -> Any:
        try:
            return theirs.execute_command(*command)
        except redis.ResponseError as exc:
            return exc

    def own_get(key: bytes) -> Any:
        try:
            return theirs.get(key)
        except redis.ResponseError as exc:
            return exc

    def fast_get(key: bytes) -> Any:
        try:
            return reader.get(key)
        except redis.ResponseError as exc:
            return exc

    @settings(FUZZ, max_examples=60)
    @given(st.lists(REDIS_COMMAND, min_size=1, max_size=8))
    @example([("SET", b"k", b"v"), ("INCR", b"k"), ("GET", b"k"), ("RPUSH", b"l", 1)])
    @example([("HSET", b"h", "f", 1.5), ("HGETALL", b"h"), ("ZADD", b"z", 0.5, b"m")])
    def check(commands: list[tuple[Any, ...]]) -> None:
        ours.flushall()
        replies = reader.run_together(commands)
        expected = [own(command) for command in commands]
        assert [redis_outcome(r) for r in replies] == [redis_outcome(r) for r in expected]
        for name in REDIS_KEYS:
            key = name.encode("utf-8") if isinstance(name, str) else name
            assert redis_outcome(fast_get(key)) == redis_outcome(own_get(key)), key

    try:
        check()
    finally:
        ours.close()
        theirs.close()
