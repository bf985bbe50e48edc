"""Names read from the file system or from git, as text every reply, status
and log line can carry, without losing a byte.

Linux names are bytes, and need not be UTF-8: ``mkdir $'bad\\xff'`` and
``git branch $'bad\\xff'`` are both accepted. Python reads such a name as a
``str`` holding a lone surrogate (``surrogateescape``: the byte 0xff is
U+DCFF), which it can hand back to the kernel unchanged, but which msgspec,
JSON and a UTF-8 log file refuse to encode: one such name in a reply made
the reply unsendable (and, the worktree's reports being shared, every
``status`` with it).

Guarantees of ``shown``:
- its result always encodes as UTF-8;
- text that is valid UTF-8 is returned unchanged (the common case costs a
  test of ``isascii``);
- a byte that is not part of valid UTF-8 is written ``\\xNN`` (two lowercase
  hex digits): ``bad\\xff`` for the name ``bad`` followed by the byte 0xff;
  every other character stays as it is, so no byte of the name is lost;
- it is idempotent: what it returns, given again, comes back unchanged.

It is for people (the close's reply, status, the log), never read back as a
name: the daemon keeps names to act on as they were read, and its records
on disk keep them whole (``dispatchd.recordjson``).
"""

from __future__ import annotations

__all__ = ["shown"]


def shown(name: str) -> str:
    """``name`` as the module says: its undecodable bytes as ``\\xNN``."""
    if name.isascii():
        return name
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no file name made (not U+DC80-U+DCFF): as its code point
        raw = name.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")
