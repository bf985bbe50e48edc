"""Tool output made safe to hand to an MCP client, which may show it on a terminal.

A command's output is the session's to choose: written raw into an MCP
client's view it could move the cursor and erase what came before, write
the clipboard (OSC 52), set the window's title, or reorder what is shown
(bidi controls). The model reads the same text, so what is escaped stays
readable.

Guarantees of ``for_client(text)`` (``for_client_all`` applies it to every
string of a JSON-like value: a result's structured content names files and
hosts the session chose):
- colour and style sequences (CSI ... ``m``) are dropped: a model reads the
  words, not their colour;
- every other control character is written as an escape, ``\\xNN`` (ESC
  is ``\\x1b``), ``\\r`` for a carriage return not followed by a newline,
  ``\\uNNNN`` for C1 controls, format characters (category Cf: the bidi
  controls, zero-width characters) and the line and paragraph separators;
  newline, tab and ``\\r\\n`` are kept;
- backslashes are left as they are (output is full of them); text with
  nothing to escape, in any script, costs one regular expression search
  (its class made at the first text, from this Python's Unicode tables:
  0.1 s, paid once by a ``dispatch mcp`` that hands out a result).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from typing import Any

__all__ = ["for_client", "for_client_all"]

_STYLE = re.compile(r"\x1b\[[0-9;:]*m")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _class() -> str:
    """A character class of every character escaped but newline and tab,
    made once from this Python's Unicode tables: letters of every script
    then never reach a Python callback."""
    ranges: list[str] = []
    start = -1
    for code in range(0x110000 + 1):
        escaped = code <= 0x10FFFF and code not in (0x0A, 0x09) and \
            unicodedata.category(chr(code)) in _ESCAPED_CATEGORIES
        if escaped and start < 0:
            start = code
        elif not escaped and start >= 0:
            ranges.append(f"\\U{start:08x}-\\U{code - 1:08x}" if code - 1 > start else f"\\U{start:08x}")
            start = -1
    return "[" + "".join(ranges) + "]"


@functools.cache
def _suspect() -> re.Pattern[str]:
    return re.compile(_class())


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if c == "\r":
        return "\r" if match.string.startswith("\n", match.end()) else "\\r"
    code = ord(c)
    if code < 0x80:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def for_client(text: str) -> str:
    """``text`` as an MCP client may show it (see the module)."""
    suspect = _suspect()
    if suspect.search(text) is None:
        return text
    return suspect.sub(_escape, _STYLE.sub("", text))


def for_client_all(value: Any) -> Any:
    """``value`` with ``for_client`` applied to every string in it, keys
    included (dicts, lists and tuples walked; anything else as it is)."""
    if isinstance(value, str):
        return for_client(value)
    if isinstance(value, dict):
        return {for_client_all(k): for_client_all(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [for_client_all(v) for v in value]
    return value
