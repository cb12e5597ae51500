"""Parsing the Idempotency-Key header (C2, C3; spec.md R6–R9 and the vectors of §7).

The library's documented choice in strict mode: a value that does not start with
``"`` is ``InvalidKey`` naming the quoted form (issue 9 item 7). RFC 9651 §4.2 would
have the invalid field ignored, but an ignored key runs the view unprotected, and a
retry runs it again; a client that sent a key is told instead that it is broken.
"""

from __future__ import annotations

from typing import Any

import pytest
from flask import jsonify
from hypothesis import given, settings
from hypothesis import strategies as st

from flask_idempotency import idempotent
from flask_idempotency.keys import InvalidKey, _parse_field, parse_key

UUID = "8e03978e-40d5-43e8-bc93-6894a57f9324"

# -- spec.md §7: (field value, lenient result, strict result) -------------------------
# A str result is the key; INVALID raises InvalidKey; None is "absent".
INVALID = object()

SPEC_VECTORS = [
    pytest.param(f'"{UUID}"', UUID, UUID, id="1-quoted-uuid"),
    pytest.param(UUID, UUID, INVALID, id="2-bare-uuid"),
    pytest.param("KG5LxwFBepaKHyUD", "KG5LxwFBepaKHyUD", INVALID, id="3-bare-token"),
    pytest.param('"abc";v=1', "abc", "abc", id="4-parameter-ignored"),
    pytest.param('"a\\"b"', 'a"b', 'a"b', id="5-escaped-quote"),
    pytest.param('"a\\\\b"', "a\\b", "a\\b", id="6-escaped-backslash"),
    pytest.param('"a\\b"', INVALID, INVALID, id="7-bad-escape"),
    pytest.param('""', INVALID, INVALID, id="8-empty-string"),
    pytest.param('"abc', INVALID, INVALID, id="9-unbalanced-quote"),
    pytest.param('"abc" x', INVALID, INVALID, id="10-trailing-input"),
    pytest.param('"a", "b"', INVALID, INVALID, id="11-list"),
    pytest.param('"f\u00fc\u00fc"', INVALID, INVALID, id="12-non-ascii"),
    pytest.param('"a\tb"', INVALID, INVALID, id="13-tab"),
    pytest.param('"a b"', "a b", "a b", id="14-space"),
    pytest.param('"' + "a" * 255 + '"', "a" * 255, "a" * 255, id="15-255-chars"),
    pytest.param('"' + "a" * 256 + '"', INVALID, INVALID, id="16-256-chars"),
    pytest.param("a,b", INVALID, INVALID, id="17-comma"),
    pytest.param("a;b", INVALID, INVALID, id="18-semicolon"),
]


def outcome(value: str, *, strict: bool, max_length: int = 255) -> object:
    try:
        return parse_key([value], strict=strict, max_length=max_length)
    except InvalidKey:
        return INVALID


@pytest.mark.parametrize(("field", "lenient", "strict"), SPEC_VECTORS)
def test_c2_c3_spec_vectors_lenient(field: str, lenient: object, strict: object) -> None:
    """C2/C3: every vector of spec.md §7 in the default (lenient) mode."""
    assert outcome(field, strict=False) == lenient


@pytest.mark.parametrize(("field", "lenient", "strict"), SPEC_VECTORS)
def test_c2_c3_spec_vectors_strict(field: str, lenient: object, strict: object) -> None:
    """C2/C3: the same vectors with IDEMPOTENCY_STRICT_HEADER (documented choice above)."""
    assert outcome(field, strict=True) == strict


def test_c2_no_header_is_absent() -> None:
    assert parse_key([]) is None
    assert parse_key([], strict=True) is None


@pytest.mark.parametrize("strict", [False, True])
def test_c3_two_field_lines_rejected(strict: bool) -> None:
    """R9: two lines are an error, never a choice between them — even two equal ones."""
    with pytest.raises(InvalidKey):
        parse_key(['"a"', '"b"'], strict=strict)
    with pytest.raises(InvalidKey):
        parse_key(['"a"', '"a"'], strict=strict)


def test_c3_invalid_key_says_why() -> None:
    with pytest.raises(InvalidKey, match="more than once"):
        parse_key(["a", "b"])
    with pytest.raises(InvalidKey, match="longer than 255"):
        parse_key(["a" * 256])
    with pytest.raises(InvalidKey, match="empty"):
        parse_key(['""'])


# -- RFC 9651 String (httpwg string.json / string-generated.json) ------------------------


@pytest.mark.parametrize("code", [*range(0x20), 0x7F])
@pytest.mark.parametrize("strict", [False, True])
def test_c3_control_bytes_inside_quotes_fail(code: int, strict: bool) -> None:
    """Every control byte and DEL inside an sf-string fails (string-generated.json)."""
    with pytest.raises(InvalidKey):
        parse_key([f'"a{chr(code)}b"'], strict=strict)


@pytest.mark.parametrize("code", [0x80, 0xA0, 0xFF, 0x100, 0x20AC, 0x1F600])
def test_c3_non_ascii_inside_quotes_fails(code: int) -> None:
    with pytest.raises(InvalidKey):
        parse_key([f'"a{chr(code)}b"'])


@pytest.mark.parametrize("code", range(0x20, 0x7F))
def test_c2_every_printable_ascii_char_inside_quotes(code: int) -> None:
    """Every printable ASCII character is a valid string character (escaped if `"` or `\\`)."""
    char = chr(code)
    escaped = "\\" + char if char in '"\\' else char
    assert parse_key([f'"x{escaped}y"']) == f"x{char}y"


@pytest.mark.parametrize(
    ("field", "key"),
    [
        ('"foo bar"', "foo bar"),
        ('" "', " "),
        ('"  leading and trailing  "', "  leading and trailing  "),
        ('"\\""', '"'),
        ('"\\\\"', "\\"),
        ('"\\\\\\""', '\\"'),
        ('"a\\\\\\\\b"', "a\\\\b"),
        ("\"'single'\"", "'single'"),
        ('"a,b;c=d"', "a,b;c=d"),
    ],
)
def test_c2_rfc9651_strings_that_pass(field: str, key: str) -> None:
    assert parse_key([field]) == key
    assert parse_key([field], strict=True) == key


@pytest.mark.parametrize(
    "field",
    [
        '"\\a"',  # unknown escape
        '"\\n"',  # no C-style escapes in sf-strings
        '"\\u0041"',
        '"abc\\"',  # escape eats the closing quote
        '"abc\\',  # ends inside an escape
        '"',  # a lone quote
        '"a"b"',  # trailing input after the string
        '"a""b"',
    ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_c3_rfc9651_strings_that_fail(field: str, strict: bool) -> None:
    with pytest.raises(InvalidKey):
        parse_key([field], strict=strict)


def test_c2_surrounding_whitespace_is_trimmed() -> None:
    """HTTP OWS around the field value is not part of it (spec.md §7 "after OWS trimming")."""
    assert parse_key(['  "abc"  ']) == "abc"
    assert parse_key(["\t abc \t"]) == "abc"
    assert parse_key(['\t"abc"\t'], strict=True) == "abc"


# -- parameters: accepted and ignored for every bare-item type ------------------------


@pytest.mark.parametrize(
    "params",
    [
        ";a=1",
        ";a=-1",
        ";a=0",
        ";a=123456789012345",  # 15 digits: the largest sf-integer
        ";a=1.5",
        ";a=-1.125",
        ";a=123456789012.123",  # 12 integer digits, 3 fraction digits
        ';a="x y"',
        ';a="esc\\"aped"',
        ';a=""',
        ";a=token",
        ";a=*tok/en:x",
        ";a=:aGVsbG8=:",
        ";a=::",
        ";a=?1",
        ";a=?0",
        ";a",  # a bare parameter is Boolean true
        ";a=@1659578233",
        ";a=@-1",
        ';a=%"f%c3%bc"',
        ';a=%""',
        ";*star=1",
        ";a-b_c.d*=1",
        ";a=1;b=2;c",
        "; a=1",  # SP is allowed after ';'
        ";a=1;  b=?0",
    ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_c2_parameters_of_every_type_are_ignored(params: str, strict: bool) -> None:
    assert parse_key(['"abc"' + params], strict=strict) == "abc"


@pytest.mark.parametrize(
    "params",
    [
        ";",  # no key
        ";A=1",  # keys are lowercase
        ";1a=1",  # keys start with lcalpha or *
        ";-a=1",
        ";a=",  # = without a value
        ";a=?2",
        ";a=?",
        ";a=:aGVsbG8=",  # unclosed byte sequence
        ";a=:a b:",
        ";a=1234567890123456",  # 16 digits
        ";a=1.",  # decimal without fraction
        ";a=1.2345",  # 4 fraction digits
        ";a=1234567890123.1",  # 13 integer digits in a decimal
        ";a=-",
        ';a="unterminated',
        ';a="bad\\escape"',
        ";a=@1.5",  # dates are integers
        ";a=@",
        ';a=%"unterminated',
        ';a=%"%zz"',
        ';a=%"%C3%BC"',  # display-string hex is lowercase
        ';a=%"%ff"',  # display-string octets must be UTF-8 (RFC 9651 §4.2.10)
        ';a=%"%c3"',  # a truncated UTF-8 sequence
        ";a=%x",
        ";a=(1 2)",  # inner lists are not bare items
        ";a=1 ;b=2",  # no space before ';'
        " ;a=1",  # no space between the string and its parameters
        ";a=1,",
        ";a=1;",
        ";a=\u00e9",
    ],
)
@pytest.mark.parametrize("strict", [False, True])
def test_c3_malformed_parameters_rejected(params: str, strict: bool) -> None:
    with pytest.raises(InvalidKey):
        parse_key(['"abc"' + params], strict=strict)


# -- length, after unescaping ---------------------------------------------------------


def test_c3_max_length_counts_unescaped_characters() -> None:
    """R8: 255 characters after unescaping pass even though the field is longer."""
    key_255 = "a" * 253 + '"\\'
    field_255 = '"' + "a" * 253 + '\\"\\\\' + '"'
    assert len(field_255) == 259
    assert parse_key([field_255]) == key_255
    field_256 = '"' + "a" * 254 + '\\"\\\\' + '"'
    with pytest.raises(InvalidKey):
        parse_key([field_256])


@pytest.mark.parametrize("strict", [False, True])
def test_c3_max_length_boundary_quoted(strict: bool) -> None:
    assert parse_key(['"' + "k" * 255 + '"'], strict=strict) == "k" * 255
    with pytest.raises(InvalidKey):
        parse_key(['"' + "k" * 256 + '"'], strict=strict)


def test_c3_max_length_boundary_bare() -> None:
    assert parse_key(["k" * 255]) == "k" * 255
    with pytest.raises(InvalidKey):
        parse_key(["k" * 256])


def test_c3_configured_max_length() -> None:
    assert parse_key(['"abcd"'], max_length=4) == "abcd"
    with pytest.raises(InvalidKey):
        parse_key(['"abcde"'], max_length=4)
    assert parse_key(["abcd"], max_length=4) == "abcd"
    with pytest.raises(InvalidKey):
        parse_key(["abcde"], max_length=4)


# -- bare keys --------------------------------------------------------------------------


BARE_ALPHABET = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\,;')


def test_c2_bare_key_accepts_every_allowed_char() -> None:
    assert len(BARE_ALPHABET) == 94 - 4
    assert parse_key([BARE_ALPHABET]) == BARE_ALPHABET


@pytest.mark.parametrize("char", ["\\", ",", ";", " ", "\t", "\x00", "\x7f", "\u00e9", "\x1b"])
def test_c3_bare_key_with_forbidden_char_rejected(char: str) -> None:
    with pytest.raises(InvalidKey):
        parse_key([f"ab{char}cd"])


@pytest.mark.parametrize("char", ["\\", ",", ";", " ", "\u00e9"])
def test_c3_i9_7_strict_bare_value_is_invalid(char: str) -> None:
    """C3, strict mode: anything not starting with ``"`` is not a String, hence invalid."""
    with pytest.raises(InvalidKey):
        parse_key([f"ab{char}cd"], strict=True)


@pytest.mark.parametrize("value", ["", "   ", "\t"])
def test_c3_empty_value(value: str) -> None:
    for strict in (False, True):
        with pytest.raises(InvalidKey, match="empty"):
            parse_key([value], strict=strict)


def test_c2_bare_and_quoted_are_the_same_key() -> None:
    assert parse_key([UUID]) == parse_key([f'"{UUID}"'])


# -- through the app ------------------------------------------------------------------------


@pytest.fixture
def counted_app(make_app):
    app, _ = make_app({"IDEMPOTENCY_WAIT": 0})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return jsonify(n=len(calls)), 201

    return app, calls


@pytest.mark.parametrize(
    "name", ["Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY", "iDeMpOtEnCy-KeY"]
)
def test_c2_header_name_is_case_insensitive(counted_app, name: str) -> None:
    app, calls = counted_app
    client = app.test_client()
    first = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "k1"})
    again = client.post("/pay", json={"a": 1}, headers={name: "k1"})
    assert first.status_code == again.status_code == 201
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.data == first.data
    assert len(calls) == 1


def test_c2_quoted_and_bare_replay_each_other(counted_app) -> None:
    app, calls = counted_app
    client = app.test_client()
    first = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": '"abc"'})
    bare = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "abc"})
    param = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": '"abc";v=2'})
    assert "Idempotent-Replayed" not in first.headers
    assert bare.headers.get("Idempotent-Replayed") == "true"
    assert param.headers.get("Idempotent-Replayed") == "true"
    assert bare.data == param.data == first.data
    assert len(calls) == 1


def test_c2_escaped_key_is_distinct_from_its_escape(counted_app) -> None:
    """``"a\\"b"`` is the key ``a"b``; it must not collide with the bare
    ``a\\"b``-like spellings."""
    app, calls = counted_app
    client = app.test_client()
    client.post("/pay", json={}, headers={"Idempotency-Key": '"a\\"b"'})
    client.post("/pay", json={}, headers={"Idempotency-Key": '"a\\\\b"'})
    assert len(calls) == 2


def test_c3_two_header_lines_through_the_app(counted_app) -> None:
    app, calls = counted_app
    response = app.test_client().post(
        "/pay", json={}, headers=[("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')]
    )
    assert response.status_code == 400
    assert response.json["code"] == "invalid-key"
    assert calls == []


def test_c3_i9_7_strict_mode_bare_key_is_invalid_when_required(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_STRICT_HEADER": True, "IDEMPOTENCY_REQUIRED": True})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return "ok"

    client = app.test_client()
    bare = client.post("/pay", headers={"Idempotency-Key": UUID})
    assert bare.status_code == 400
    assert bare.json["code"] == "invalid-key"
    missing = client.post("/pay")
    assert missing.status_code == 400
    assert missing.json["code"] == "missing-key"
    broken = client.post("/pay", headers={"Idempotency-Key": '"abc'})
    assert broken.status_code == 400
    assert broken.json["code"] == "invalid-key"
    quoted = client.post("/pay", headers={"Idempotency-Key": f'"{UUID}"'})
    assert quoted.status_code == 200
    assert calls == [1]


def test_c2_configured_header_name(make_app) -> None:
    app, _ = make_app({"IDEMPOTENCY_HEADER": "X-Request-Key", "IDEMPOTENCY_WAIT": 0})
    calls: list[int] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        return "ok", 201

    client = app.test_client()
    client.post("/pay", headers={"X-Request-Key": "k"})
    again = client.post("/pay", headers={"x-request-key": '"k"'})
    assert again.headers.get("Idempotent-Replayed") == "true"
    client.post("/pay", headers={"Idempotency-Key": "k"})  # the default name is now ignored
    assert len(calls) == 2


# -- the named cases of httpwg structured-field-tests string.json -------------------------------

HTTPWG_STRING_CASES = [
    ("basic string", '"foo bar"', "foo bar"),
    ("whitespace string", '"   "', "   "),
    ("string quoting", '"foo \\"bar\\" \\\\ baz"', 'foo "bar" \\ baz'),
    ("long string", '"' + "foo " * 65 + '"', "foo " * 65),
    ("empty string", '""', INVALID),  # a valid sf-string, but never a usable key
    ("non-ascii string", '"f\u00fc\u00fc"', INVALID),
    ("tab in string", '"\\t"', INVALID),
    ("newline in string", '" \n "', INVALID),
    ("unbalanced string", '"foo', INVALID),
    ("bad string quoting", '"foo \\,"', INVALID),
    ("ending string quote", '"foo \\"', INVALID),
    ("abruptly ending string quote", '"foo \\', INVALID),
]


@pytest.mark.parametrize(
    ("field", "expected"),
    [pytest.param(field, expected, id=name) for name, field, expected in HTTPWG_STRING_CASES],
)
@pytest.mark.parametrize("strict", [False, True])
def test_c2_httpwg_string_cases(field: str, expected: object, strict: bool) -> None:
    assert outcome(field, strict=strict, max_length=300) == expected


def test_c2_single_quoted_string() -> None:
    """httpwg "single quoted string" is not an sf-string: invalid in strict mode, while
    the lenient mode reads ``'foo'`` as a bare key (quotes included)."""
    with pytest.raises(InvalidKey, match='"key"'):
        parse_key(["'foo'"], strict=True)
    assert parse_key(["'foo'"]) == "'foo'"


# -- issue 9 item 7 and issue 14 item 4: strict mode and messages that are true -----------


@pytest.mark.parametrize("field", [UUID, "KG5LxwFBepaKHyUD", "abc"])
def test_i9_7_c2_c3_strict_mode_refuses_a_bare_key_naming_the_quoted_form(field: str) -> None:
    """C2/C3: with IDEMPOTENCY_STRICT_HEADER a bare key is invalid, never "absent"."""
    with pytest.raises(InvalidKey, match='"key"'):
        parse_key([field], strict=True)


@pytest.mark.parametrize("char", ["\u00fc", "\u20ac", "\x7f", "\x01", "\u00e9"])
def test_i14_4_c3_non_ascii_bare_key_is_not_told_that_quoting_helps(char: str) -> None:
    """C3: quoting does not let non-ASCII through, so the bare-key message must not say so."""
    with pytest.raises(InvalidKey) as bare:
        parse_key([f"f{char}r"])
    with pytest.raises(InvalidKey) as quoted:
        parse_key([f'"f{char}r"'])
    for exc in (bare.value, quoted.value):
        message = str(exc)
        assert "ASCII" in message
        assert "quote" not in message.lower(), message


@pytest.mark.parametrize("char", [" ", '"', "\\", ";"])
def test_i14_4_c2_bare_key_told_to_quote_only_what_quoting_allows(char: str) -> None:
    """C2: what the bare-key message says to quote really parses once quoted."""
    with pytest.raises(InvalidKey, match="quoted") as info:
        parse_key([f"a{char}b"])
    assert "sent more than once" not in str(info.value)
    escaped = "\\" + char if char in '"\\' else char
    assert parse_key([f'"a{escaped}b"']) == f"a{char}b"


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    "field",
    [
        "a,b",  # gunicorn and Werkzeug's server join two lines with ","
        "a, b",  # Werkzeug's test client joins with ", "
        '"a","b"',
        '"a", "b"',
        '"a";x=1, "b"',
        'a, "b"',
    ],
)
def test_i14_4_c3_two_header_lines_joined_by_the_server_are_sent_twice(
    field: str, strict: bool
) -> None:
    """C3: a WSGI server joins repeated lines with commas; the message names both causes."""
    with pytest.raises(InvalidKey, match="more than once") as info:
        parse_key([field], strict=strict)
    assert "comma" in str(info.value)


def test_i14_4_c2_a_comma_inside_a_quoted_key_is_one_key() -> None:
    """C2: the list check looks only outside quoted strings."""
    assert parse_key(['"a, b"']) == "a, b"
    assert parse_key(['"a\\", b"'], strict=True) == 'a", b'


@pytest.mark.parametrize(
    "headers",
    [
        [("Idempotency-Key", "a"), ("Idempotency-Key", "b")],
        [("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')],
        [("Idempotency-Key", "a"), ("idempotency-key", "a")],
    ],
)
def test_i14_4_c3_two_header_lines_answer_sent_twice(make_app, headers) -> None:
    """C3: two key header lines on a request: 400 invalid-key saying it was sent twice."""
    app, _ = make_app({"TESTING": False})
    calls: list[str] = []

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append("pay")
        return jsonify(ok=True), 201

    response = app.test_client().post("/pay", headers=headers)
    assert response.status_code == 400
    assert response.json["code"] == "invalid-key"
    assert "more than once" in response.json["detail"]
    assert calls == []


@pytest.mark.parametrize("required", [False, True])
def test_i9_7_c2_c3_strict_header_bare_key_is_400_and_the_view_never_runs(
    make_app, required: bool
) -> None:
    """C2/C3: strict mode, bare key, optional or required key: 400 invalid-key, no run."""
    app, _ = make_app({"TESTING": False, "IDEMPOTENCY_STRICT_HEADER": True})
    calls: list[str] = []

    @app.post("/pay")
    @idempotent(required=required)
    def pay():
        calls.append("pay")
        return jsonify(ok=True), 201

    client = app.test_client()
    for _ in range(2):
        response = client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": UUID})
        assert response.status_code == 400, response.data
        assert response.mimetype == "application/problem+json"
        assert response.json["code"] == "invalid-key"
        assert '"key"' in response.json["detail"]
    assert calls == []
    quoted = client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": f'"{UUID}"'})
    again = client.post("/pay", json={"amount": 1}, headers={"Idempotency-Key": f'"{UUID}"'})
    assert quoted.status_code == again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert calls == ["pay"]


# -- the two regular expressions agree with the parser (issue 11) ------------------------

#: Characters that matter to the parser, and a few that it must refuse.
_FIELD_CHARS = st.sampled_from(list('abcXYZ019-_.*~!#%/:=?@"\\,; \t()\x00\x7f\u00e9\u20ac'))


def _by_the_parser(field: str, *, strict: bool, max_length: int) -> str:
    """What ``parse_key`` answered before its fast paths: the character-by-character parser."""
    key = _parse_field(field.strip(" \t"), strict=strict)
    if len(key) > max_length:
        raise InvalidKey(f"The Idempotency-Key is longer than {max_length} characters.")
    return key


def _answer(parse: Any, field: str, **options: Any) -> tuple[str, str]:
    try:
        return "key", parse(field, **options)
    except InvalidKey as exc:
        return "invalid", str(exc)


@settings(max_examples=600, deadline=None)
@given(
    field=st.one_of(
        st.text(_FIELD_CHARS, max_size=12),
        st.text(_FIELD_CHARS, max_size=12).map(lambda text: f'"{text}"'),
        st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12).map(
            lambda text: f'"{text}"'
        ),
    ),
    strict=st.booleans(),
    max_length=st.integers(1, 12),
)
def test_c2_c3_parse_key_answers_what_the_parser_answers(
    field: str, strict: bool, max_length: int
) -> None:
    """Same key or the same error message, for any field, in both modes."""
    options = {"strict": strict, "max_length": max_length}
    fast = _answer(lambda value, **kw: parse_key([value], **kw), field, **options)
    assert fast == _answer(_by_the_parser, field, **options)
