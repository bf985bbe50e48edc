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


def _members(text: str) -> dict[str, Any]:
    """The members of the JSON object ``text`` holds, read at its top level
    only: scalars decoded, arrays and objects skipped (``_NESTED``) without
    recursion. What was read before a syntax error is kept."""
    members: dict[str, Any] = {}
    pos = _ws(text, 0)
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
                pos = _skip(text, pos)
                value: Any = _NESTED
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
