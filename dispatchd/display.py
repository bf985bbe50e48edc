"""Text a session chose, made fit to show to a person: on a terminal and in the log.

A session names files, directories, refs and job commands; the daemon and
``dispatch`` put those names in lines a person reads as dispatchd's own
words (the close's report, ``dispatch status``, a restore's refs, the job
list, the log). Written raw, a name could move the cursor and erase
earlier lines, forge a whole line with a newline, write the clipboard
(OSC 52), set the window's title, or reorder what is shown (bidi controls).

Guarantees:
- ``shown(text)`` holds no character a terminal acts on or hides: every
  control (C0 with newline, carriage return, tab and ESC; DEL; C1, U+0080 to
  U+009F), every format character (Unicode category Cf: the bidi controls
  U+061C, U+200E/F, U+202A-202E and U+2066-2069, the zero-width U+200B-200D,
  U+2060, U+FEFF, the soft hyphen, the tag characters), the line and
  paragraph separators U+2028/2029 and every lone surrogate is written as an
  escape: ``\\n``, ``\\r``, ``\\t``, ``\\xNN`` below U+0080, ``\\uNNNN`` or
  ``\\UNNNNNNNN`` above; a surrogate U+DC80-U+DCFF (a byte that was not UTF-8,
  as ``os.fsdecode`` keeps it) as that byte, ``\\xNN`` with NN at least 80;
- ``shown`` doubles every backslash, so the escapes cannot be forged: two
  different texts are never shown alike (a name holding the four characters
  ``\\x1b`` is shown ``\\\\x1b``, one holding ESC ``\\x1b``);
- ``one_line(text)`` escapes the same characters but leaves backslashes as
  they are: one line stays one line and a terminal acts on nothing, for a
  line that is a summary anyway (the log, the job list, whose commands are
  full of backslashes a reader wants to see once);
- letters of every script, accents, CJK, emoji without joiners, spaces
  (U+0020 and the other space separators) are left as they are. The usual
  text (printable ASCII) costs two string tests.
"""

from __future__ import annotations

import unicodedata

__all__ = ["one_line", "shown"]

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    """The escape for one character ``_needs_escape`` picked."""
    if c in _NAMED:
        return _NAMED[c]
    code = ord(c)
    if code < 0x80:
        return f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's surrogateescape: the byte itself
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _needs_escape(c: str) -> bool:
    if c < "\x80":
        return c < " " or c == "\x7f"
    return unicodedata.category(c) in _ESCAPED_CATEGORIES


def _escaped(text: str, backslash: str) -> str:
    return "".join(backslash if c == "\\" else _escape(c) if _needs_escape(c) else c for c in text)


def shown(text: str) -> str:
    """``text`` with what a terminal acts on or hides escaped, and
    backslashes doubled (see the module)."""
    if text.isascii() and text.isprintable() and "\\" not in text:  # the usual text, untouched
        return text
    return _escaped(text, "\\\\")


def one_line(text: str) -> str:
    """``text`` with what a terminal acts on or hides escaped, backslashes
    kept (see the module)."""
    if text.isascii() and text.isprintable():
        return text
    return _escaped(text, "\\")
