"""dispatch/_mcp_unreadable.py: what ``dispatch mcp`` answers for a line the
SDK's transport could not read, from the exception the transport raised
(the SDK's own parser, as ``dispatch mcp`` runs it)."""

from __future__ import annotations

import mcp_types
import pytest

from dispatch._mcp_unreadable import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    NO_BATCHES,
    PARSE_ERROR,
    Refusal,
    _members,
    bad_call,
    bad_id,
    not_utf8,
    refusal,
    refusals,
    too_long,
)


def _refusal_of(line: str) -> Refusal:
    with pytest.raises(Exception) as info:
        mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    return refusal(info.value)


def test_the_top_level_is_read_without_its_nested_values() -> None:
    line = ('{"s": "[{\\"", "p": ["]]]", {"a": "}"}], "id": 5, "method": "m", "x": '
            + "[" * 100_000 + "]" * 100_000 + ', "t": true}')
    members = _members(line)
    assert (members["s"], members["id"], members["method"], members["t"]) == ('[{"', 5, "m", True)
    assert set(members) == {"s", "p", "id", "method", "x", "t"}


def test_what_came_before_a_break_stands() -> None:
    assert _members('{"id": "a", "method": "x", "params": [[[') == {"id": "a", "method": "x"}
    assert _members('  {"id": 7, "method":') == {"id": 7}
    assert _members("[1, 2]") == {} and _members("garbage") == {} and _members("") == {}


def test_a_deep_request_is_answered_with_its_id() -> None:
    r = _refusal_of('{"jsonrpc":"2.0","id":"x","method":"tools/call","params":' + "[" * 300 + "]" * 300 + "}")
    assert (r.id, r.code, r.answer) == ("x", INVALID_REQUEST, True)
    assert r.message.startswith("Invalid Request: the message is nested too deeply to read (recursion limit exceeded ")


def test_an_id_that_is_no_request_id_is_null() -> None:
    for rid in ("true", "1.5", "[1]", "null"):
        r = _refusal_of('{"jsonrpc":"2.0","id":%s,"method":"m","params":%s}' % (rid, "[" * 300 + "]" * 300))
        assert (r.id, r.answer) == (None, True), rid


def test_deep_notifications_and_responses_are_noted_not_answered() -> None:
    deep = "[" * 300 + "]" * 300
    note = _refusal_of('{"jsonrpc":"2.0","method":"notifications/x","params":{"a":%s}}' % deep)
    response = _refusal_of('{"jsonrpc":"2.0","id":4,"result":{"a":%s}}' % deep)
    error = _refusal_of('{"jsonrpc":"2.0","id":4,"error":{"code":1,"message":"m","data":%s}}' % deep)
    assert [r.answer for r in (note, response, error)] == [False, False, False]
    assert note.note().startswith("dispatch mcp: ignored a message it cannot read (not a request): Invalid Request: ")


def test_not_json_and_not_a_message() -> None:
    assert _refusal_of("garbage") == Refusal(None, PARSE_ERROR, "Parse error: expected value at line 1 column 1", True)
    r = _refusal_of('{"jsonrpc":"1.0","id":3,"method":"ping"}')
    assert (r.id, r.code, r.answer) == (3, INVALID_REQUEST, True)
    assert r.note() == ('dispatch mcp: answered id 3 with error -32600: Invalid Request: not a JSON-RPC 2.0 message '
                        '(it needs "jsonrpc": "2.0", a "method" and an "id" that is a string or an integer)')


def test_an_exception_of_another_kind_is_a_parse_error_with_a_null_id() -> None:
    assert refusal(ValueError("odd")) == Refusal(None, PARSE_ERROR, "Parse error: ValueError: odd", True)


def _read_as_a_notification(line: str) -> str:
    assert isinstance(mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False),
                      mcp_types.JSONRPCNotification)
    return line


@pytest.mark.parametrize(("rid", "shown"), [("1.5", "1.5"), ("null", "null"), ("true", "true"), ("3.0", "3.0"),
                                            ("1e3", "1000.0"), ("NaN", "NaN"), ('{"a": 1}', "an object or an array"),
                                            ("[1]", "an object or an array")])
def test_a_request_whose_id_mcp_cannot_carry_is_refused_with_a_null_id(rid: str, shown: str) -> None:
    line = _read_as_a_notification('{"jsonrpc":"2.0","id":%s,"method":"tools/call","params":{"name":"x"}}\n' % rid)
    assert bad_id(line) == Refusal(None, INVALID_REQUEST, f'Invalid Request: its "id" ({shown}) is neither a string '
                                                          'nor an integer; a message with no "id" is a notification',
                                   True)


def test_a_true_notification_is_left_alone() -> None:
    assert bad_id(_read_as_a_notification('{"jsonrpc":"2.0","method":"notifications/initialized"}\n')) is None
    # An "id" nested in its params is not the message's.
    assert bad_id(_read_as_a_notification('{"jsonrpc":"2.0","method":"n","params":{"id":1.5}}')) is None


def _not_utf8(raw: bytes) -> Refusal:
    with pytest.raises(UnicodeDecodeError) as info:
        raw.decode("utf-8")
    return not_utf8(raw, info.value)


def test_a_line_not_utf8_is_refused_with_its_id_and_the_first_bad_bytes_offset() -> None:
    assert _not_utf8(b'{"jsonrpc":"2.0","id":3,"method":"m","params":{"c":"\xff"}}') == Refusal(
        3, PARSE_ERROR, "Parse error: the line is not UTF-8 (byte 52)", True)
    # An id holding the bad byte cannot be echoed; a notification is only noted.
    assert _not_utf8(b'{"id":"a\xfe","method":"m"}').id is None
    assert _not_utf8(b'{"jsonrpc":"2.0","method":"m","params":{"c":"\xff"}}').answer is False
    # The twin: the same bytes in UTF-8 are a message the SDK reads.
    mcp_types.jsonrpc_message_adapter.validate_json('{"jsonrpc":"2.0","id":3,"method":"m","params":{"c":"\u00ff"}}')


def _refusals_of(line: str) -> list[Refusal]:
    with pytest.raises(Exception) as info:
        mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    return refusals(info.value, line)


def test_each_request_of_a_batch_is_answered_with_its_id() -> None:
    line = ('[{"jsonrpc":"2.0","id":1,"method":"ping"}, {"jsonrpc":"2.0","id":"b","method":"x","params":%s},'
            '{"jsonrpc":"2.0","method":"note"}, {"jsonrpc":"2.0","id":4,"result":{}}, 7, [1]]'
            ) % ("[" * 150 + "]" * 150)
    assert _refusals_of(line) == [Refusal(rid, INVALID_REQUEST, NO_BATCHES, True) for rid in (1, "b", None, None)]
    assert _refusals_of(" [] ") == [Refusal(None, INVALID_REQUEST, NO_BATCHES, True)]
    # Notifications and responses alone: noted, not answered (JSON-RPC 2.0).
    assert _refusals_of('[{"jsonrpc":"2.0","method":"note"}]') == [Refusal(None, INVALID_REQUEST, NO_BATCHES, False)]
    # An array that is not JSON, or nested too deeply, is refused once, as any such line.
    assert [r.code for r in _refusals_of("[1,")] == [PARSE_ERROR]
    assert len(_refusals_of("[" * 300 + "]" * 300)) == 1
    # The twin: an object that is no message is refused as before, not as a batch.
    assert _refusals_of('{"jsonrpc":"1.0","id":3,"method":"ping"}')[0].message.startswith("Invalid Request: not a JSON")


@pytest.mark.parametrize(("params", "why"), [
    ({"name": "t", "arguments": "x"}, "arguments must be an object, not string"),
    ({"name": "t", "arguments": 1.5}, "arguments must be an object, not number"),
    ({"name": "t", "arguments": True}, "arguments must be an object, not boolean"),
    ({"name": None}, "name must be a string, not null"),
    ({}, 'params has no "name"'),
    (None, 'params must be an object with a "name", not null'),
])
def test_a_call_whose_params_are_of_the_wrong_type_is_told_which(params: object, why: str) -> None:
    assert bad_call("tools/call", params, "r") == Refusal("r", INVALID_PARAMS, f"tools/call: {why}", True)


def test_a_call_the_sdk_serves_and_other_methods_are_left_alone() -> None:
    assert bad_call("tools/call", {"name": "t", "arguments": {}}, 1) is None
    assert bad_call("tools/call", {"name": "t", "arguments": None}, 1) is None
    assert bad_call("tools/call", {"name": "t"}, 1) is None
    assert bad_call("tools/list", None, 1) is None


def test_a_line_too_long_is_refused_with_the_id_its_ends_hold() -> None:
    why = "Invalid Request: the line is 900 bytes, over the 100 this server reads; it was not read"
    head = b'{"jsonrpc":"2.0","method":"tools/call","params":{"x":"yyy'
    assert too_long(900, b'{"jsonrpc":"2.0","id":"a","method":"m","params":{"x":"y', b"yy\"}}", 100) == Refusal(
        "a", INVALID_REQUEST, why, True)
    # The TypeScript SDK's order: the id last, after the params.
    assert too_long(900, head, b'yyy"}},"jsonrpc":"2.0","id":7}\n', 100).id == 7
    assert too_long(900, head, b'yyy"}}, "id" : "z\\"q" }', 100).id == 'z"q'
    # An "id" in the params, or in a string, is not the message's: unknown, null, answered all the same.
    for tail in (b'yyy", "id": 5}}', b'yyy ,\\"id\\":5}"}}', b'yyy", "id": 5.5}', b'yyy"}, "id": "a\xff"}'):
        assert too_long(900, head, tail, 100) == Refusal(None, INVALID_REQUEST, why, True), tail
    # A response is only noted.
    assert too_long(900, b'{"jsonrpc":"2.0","result":{"x":"y', b'yy"}, "id": 3}', 100).answer is False
