"""Tool output made safe to hand to an MCP client, which may show it on a terminal.

A command's output is the session's to choose: written raw into an MCP
client's view it could move the cursor and erase what came before, write
the clipboard (OSC 52), set the window's title, or reorder what is shown
(bidi controls). The model reads the same text, so what is escaped stays
readable.

Guarantees of ``for_client(text)``:
- colour and style sequences (CSI ... ``m``) are dropped: a model reads the
  words, not their colour;
- every other control character is written as an escape, ``\\xNN`` (ESC
  is ``\\x1b``), ``\\r`` for a carriage return not followed by a newline,
  ``\\uNNNN`` for C1 controls, format characters (category Cf: the bidi
  controls, zero-width characters) and the line and paragraph separators;
  newline, tab and ``\\r\\n`` are kept;
- backslashes are left as they are (output is full of them); the usual text
  (printable ASCII and newlines) costs a regular expression search.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["for_client"]

_STYLE = re.compile(r"\x1b\[[0-9;:]*m")
_SUSPECT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]|[^\x00-\x7f]")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    if c == "\r":
        return "\r" if match.string.startswith("\n", match.end()) else "\\r"
    code = ord(c)
    if code < 0x80:
        return f"\\x{code:02x}"
    if unicodedata.category(c) not in _ESCAPED_CATEGORIES:
        return c  # letters of every script, emoji, spaces
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def for_client(text: str) -> str:
    """``text`` as an MCP client may show it (see the module)."""
    if _SUSPECT.search(text) is None:
        return text
    return _SUSPECT.sub(_escape, _STYLE.sub("", text))
