"""What ``dispatch mcp`` answers for a line it cannot read as a JSON-RPC message.

The MCP SDK's stdio transport hands a line that does not parse (invalid JSON,
JSON nested deeper than its parser goes: pydantic-core stops at 200 levels,
or JSON that is no JSON-RPC message) to the session as an exception, and the
session drops it: an MCP host then waits for ever for that request's answer.
``refusal`` says what to answer instead; ``mcp.py`` sends it and goes on.
The SDK also reads a request whose ``id`` is neither a string nor an integer
(``1.5``, ``null``, ``true``, an object) as a notification, and would run it
unanswered; ``bad_id`` finds those among what it read as notifications.

Guarantees:
- a line that is, or may be, a request gets one JSON-RPC error: ``-32700``
  (parse error) for text that is not JSON, ``-32600`` (invalid request) for
  a message nested too deeply or not a JSON-RPC 2.0 message; with the
  request's ``id`` when a shallow scan of the line's top level reads one (a
  string or an integer, as MCP's ids are), else ``null``, as JSON-RPC 2.0
  says for an id that could not be read;
- a message with an ``id`` member that is neither a string nor an integer
  is a request (JSON-RPC 2.0: only a message with no ``id`` at all is a
  notification) and gets ``-32600`` with ``id`` ``null``, never run;
- a line recognisably a notification (a ``method`` and no ``id``) or a
  response (``result`` or ``error``, no ``method``) is not answered
  (JSON-RPC forbids answering a notification; answering a response could
  start two peers answering each other): it is only noted;
- a line that is not UTF-8 is refused whole (``-32700``, naming the first
  bad byte's offset from 0), never read with its bytes replaced: a file a
  call would write then holds what was sent or nothing (``not_utf8``);
- a batch (a top-level array; MCP's stdio carries one message a line) gets
  ``-32600`` "batches are not supported" for each element that is a request,
  one answer a line, with that element's id; none of them is run; an array
  with no request in it gets one answer with ``id`` ``null``, unless it only
  holds notifications or responses (``batch``);
- a ``tools/call`` whose ``params`` is not an object, or whose ``name`` is no
  string or ``arguments`` no object, gets ``-32602`` saying which, with its
  id, never run (``bad_call``);
- a line longer than ``_mcp_stdio.MAX_LINE`` (a little over the largest
  frame dispatchd takes) gets ``-32600`` naming its size, with the id its
  first 4 KiB hold at the top level or its last 4 KiB as the object's last
  member (else ``null``: it is answered unless it shows a response, as a
  request's id may be in what was dropped), never run (``too_long``);
- every refusal has a one-line note for stderr;
- the scan never recurses and never builds the nested values it skips: a
  line nested 100,000 deep costs one pass over its characters.
"""

from __future__ import annotations

import json
import json.decoder
import re
from collections.abc import Callable
from typing import Any, NamedTuple

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
NO_BATCHES = "Invalid Request: batches are not supported; send each message on a line of its own"

_WS = re.compile(r"[ \t\n\r]*")
_STRUCTURE = re.compile(r'["\[\]{}]')
_SCALARS = json.JSONDecoder()
_NESTED = object()  # a member whose value is an array or object, skipped unread
# One JSON string from just past its opening quote: (its text, where it ends).
# The json module's own (in C), which typeshed does not declare.
scanstring: Callable[[str, int], tuple[str, int]] = getattr(json.decoder, "scanstring")


class Refusal(NamedTuple):
    """The error to answer with (``answer`` False: none, a note only)."""

    id: str | int | None
    code: int
    message: str
    answer: bool

    def note(self) -> str:
        """The line for stderr."""
        if not self.answer:
            return f"dispatch mcp: ignored a message it cannot read (not a request): {self.message}"
        return f"dispatch mcp: answered id {json.dumps(self.id)} with error {self.code}: {self.message}"


def refusal(exc: Exception) -> Refusal:
    """The answer to the line the transport could not read (``exc``: what it raised)."""
    errors = _errors(exc)
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        why = str(first.get("msg", "")).removeprefix("Invalid JSON: ")
        raw = first.get("input")
        members = _members(raw) if isinstance(raw, str) else {}
        if "recursion limit exceeded" in why:
            return _refuse(members, INVALID_REQUEST, f"Invalid Request: the message is nested too deeply to read ({why})")
        return _refuse(members, PARSE_ERROR, f"Parse error: {why}")
    if errors:
        # Valid JSON, not a message: the object itself is the input of the
        # errors about its own fields (a member's error has the member's value).
        top: dict[str, Any] = next((e["input"] for e in errors if isinstance(e.get("input"), dict) and len(e.get("loc", ())) <= 2), {})
        return _refuse(top, INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message (it needs \"jsonrpc\": "
                                             "\"2.0\", a \"method\" and an \"id\" that is a string or an integer)")
    return _refuse({}, PARSE_ERROR, f"Parse error: {type(exc).__name__}: {exc}")


def refusals(exc: Exception, line: str) -> list[Refusal]:
    """``refusal``, or for JSON that is an array, what ``batch`` answers."""
    errors = _errors(exc)
    if errors and errors[0].get("type") != "json_invalid":  # JSON, read whole: no message
        return batch(line) or [refusal(exc)]
    return [refusal(exc)]


def bad_id(line: str) -> Refusal | None:
    """The answer to ``line``, a message the SDK read as a notification, when
    it has an ``id`` all the same (one MCP cannot carry); None for a true
    notification."""
    members = _members(line)
    if "id" not in members:
        return None
    rid = members["id"]
    if isinstance(rid, (str, int)) and not isinstance(rid, bool):
        return None  # an id the SDK would have read: not this case
    shown = "an object or an array" if rid is _NESTED else json.dumps(rid)
    return Refusal(None, INVALID_REQUEST, f'Invalid Request: its "id" ({shown}) is neither a string nor an '
                                          "integer; a message with no \"id\" is a notification", answer=True)


def not_utf8(raw: bytes, exc: UnicodeDecodeError) -> Refusal:
    """The answer to ``raw``, a line that is not UTF-8: read whole, never
    with its bytes replaced (a write_file would write U+FFFD for them)."""
    return _refuse(_head_members(raw), PARSE_ERROR, f"Parse error: the line is not UTF-8 (byte {exc.start})")


# The id as the last member of the top-level object, at a line's end (where
# the TypeScript SDK puts it): a nested object's last member is followed by
# two braces, an escaped one in a string by a backslash.
_LAST_ID = re.compile(r',[ \t\r\n]*"id"[ \t\r\n]*:[ \t\r\n]*(-?[0-9]+|"(?:[^"\\]|\\.)*")[ \t\r\n]*\}[ \t\r\n]*\Z')


def too_long(size: int, head: bytes, tail: bytes, limit: int) -> Refusal:
    """The answer to a line of ``size`` bytes, over ``limit``, dropped
    unread but for ``head`` and ``tail``, its first and last bytes: its id
    is a top-level member of the head, or the last member at the tail.
    Answered unless the head shows a response: a request's id may be in
    what was dropped, and a host would wait for it for ever."""
    members = _head_members(head, cut=True)
    rid = members.get("id")
    if "id" not in members:
        found = _LAST_ID.search(tail.decode("utf-8", "surrogateescape"))
        rid = _head_members(b'{"id":' + found.group(1).encode("utf-8", "surrogateescape") + b"}").get("id") \
            if found else None
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        rid = None
    response = "method" not in members and ("result" in members or "error" in members)
    return Refusal(rid, INVALID_REQUEST, f"Invalid Request: the line is {size} bytes, over the {limit} this "
                                         "server reads; it was not read", answer=not response)


def _head_members(raw: bytes, *, cut: bool = False) -> dict[str, Any]:
    """``_members`` of bytes that may not be UTF-8: an id holding a bad byte
    is none that can be echoed."""
    members = _members(raw.decode("utf-8", "surrogateescape"), cut=cut)
    rid = members.get("id")
    if isinstance(rid, str) and not _is_utf8(rid):
        members["id"] = None
    return members


def batch(line: str) -> list[Refusal] | None:
    """The answers to ``line`` when it is a JSON array (None when not): one
    for each element that is a request, with its id. The SDK reads one
    message a line; a batch it would answer once, with ``id`` ``null``, and a
    host would wait for ever for the ids it holds."""
    pos = _ws(line, 0)
    if not line.startswith("[", pos):
        return None
    answers, elements = [], 0
    pos += 1
    try:
        while True:
            pos = _ws(line, pos)
            if line.startswith("]", pos):
                break
            elements += 1
            if line.startswith("{", pos):
                refused = _refuse(_members(line, pos), INVALID_REQUEST, NO_BATCHES)
                pos = _skip(line, pos)
            else:  # JSON-RPC 2.0: an element that is no object is an invalid request, id null
                refused = Refusal(None, INVALID_REQUEST, NO_BATCHES, answer=True)
                pos = _skip(line, pos) if line.startswith("[", pos) else _SCALARS.raw_decode(line, pos)[1]
            if refused.answer:
                answers.append(refused)
            pos = _ws(line, pos)
            if not line.startswith(",", pos):
                break
            pos += 1
    except ValueError:  # the line parsed as JSON before this: not reached
        pass
    if not answers and not elements:
        answers.append(Refusal(None, INVALID_REQUEST, NO_BATCHES, answer=True))
    if not answers:
        return [Refusal(None, INVALID_REQUEST, NO_BATCHES, answer=False)]
    return answers


_JSON_TYPES = {str: "string", int: "number", float: "number", bool: "boolean", list: "array", dict: "object"}


def bad_call(method: str, params: Any, rid: str | int) -> Refusal | None:
    """The answer to a ``tools/call`` request whose params the SDK would
    refuse with no word of why ("Invalid request parameters"); None for any
    other request, or a call it can serve."""
    if method != "tools/call":
        return None
    if not isinstance(params, dict):
        why = f"params must be an object with a \"name\", not {_json_type(params)}"
    elif "name" not in params:
        why = 'params has no "name"'
    elif not isinstance(params["name"], str):
        why = f"name must be a string, not {_json_type(params['name'])}"
    elif params.get("arguments") is not None and not isinstance(params["arguments"], dict):
        why = f"arguments must be an object, not {_json_type(params['arguments'])}"
    else:
        return None
    return Refusal(rid, INVALID_PARAMS, f"tools/call: {why}", answer=True)


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _errors(exc: Exception) -> list[dict[str, Any]]:
    """A pydantic ``ValidationError``'s errors (duck-typed: no pydantic import here)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return []
    try:
        found = errors(include_url=False)
    except Exception:  # noqa: BLE001 - not pydantic's after all
        return []
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def _refuse(members: dict[str, Any], code: int, message: str) -> Refusal:
    rid = members.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        rid = None
    notification = "method" in members and "id" not in members
    response = "method" not in members and ("result" in members or "error" in members)
    return Refusal(rid, code, message, answer=not (notification or response))


def _members(text: str, start: int = 0, *, cut: bool = False) -> dict[str, Any]:
    """The members of the JSON object ``text`` holds (from ``start``), read
    at its top level only: scalars decoded, arrays and objects skipped
    (``_NESTED``) without recursion. What was read before a syntax error is
    kept; with ``cut`` (the text is a line's head), a member whose array or
    object is still open at the end too."""
    members: dict[str, Any] = {}
    pos = _ws(text, start)
    if not text.startswith("{", pos):
        return members
    pos += 1
    try:
        while True:
            pos = _ws(text, pos)
            if not text.startswith('"', pos):
                return members
            key, pos = scanstring(text, pos + 1)
            pos = _ws(text, pos)
            if not text.startswith(":", pos):
                return members
            pos = _ws(text, pos + 1)
            if text[pos:pos + 1] in ("[", "{"):
                value: Any = _NESTED
                if cut:
                    members[key] = value  # its value runs past the text's end
                pos = _skip(text, pos)
            else:
                value, pos = _SCALARS.raw_decode(text, pos)
            members[key] = value
            pos = _ws(text, pos)
            if not text.startswith(",", pos):
                return members
            pos += 1
    except ValueError:  # a broken string or scalar, or an unclosed array: what came before stands
        return members


def _ws(text: str, pos: int) -> int:
    """Past the whitespace at ``pos``."""
    found = _WS.match(text, pos)
    return found.end() if found else pos


def _skip(text: str, pos: int) -> int:
    """Where the array or object at ``pos`` ends (ValueError: it does not)."""
    depth = 0
    while True:
        found = _STRUCTURE.search(text, pos)
        if found is None:
            raise ValueError("unclosed")
        pos = found.end()
        char = found.group()
        if char == '"':
            _, pos = scanstring(text, pos)
        elif char in "[{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos
