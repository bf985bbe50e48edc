"""A ref's value as git reads it, from a line of ``packed-refs`` or a loose
ref file: what the end compares with the baseline, so that a ref git reads
one way is never taken for unchanged because it reads another way here.

Git (its files and packed backends) reads:
- a ``packed-refs`` record, when it looks a name up, as the object id (the
  repository's 40 or 64 hex digits, either case), then any one character
  (a space, a tab, an ``x``: its binary search takes the name from there
  on), then the name up to ``\\n``; lines are split at ``\\n`` only;
- a loose ref as a symbolic ref when it begins ``ref:`` (the target after
  any whitespace, trailing whitespace cut), else as the object id at its
  start followed by the end or whitespace and then anything at all (``<id>
  junk`` is that id); anything else is a broken ref, which hides a packed
  one of the same name and lets git's look go on to the next place. Its
  whitespace is git's own: space, tab, LF, CR, never ``\\v`` or ``\\f``;
- a symlink below ``refs`` through its target (or, naming ``refs/...``, as
  a symbolic ref).

``loose`` gives every loose ref a value: the id (lowercase), ``ref: TARGET``,
or for anything git reads otherwise (a symlink, a broken file, no regular
file) a value no baseline id or symbolic ref equals, so the end takes it
for changed and writes the baseline's value back (a loose ref wins); and
None for a name listed that is gone when read (git packed and pruned it, or
deleted the ref): the reader then takes ``packed-refs``' value, as git does.
"""

from __future__ import annotations

import errno
import os
import re

from dispatchd.daemon.gitguard import fs

# git's own isspace (sane_ctype): space, tab, LF, CR; not \v or \f.
_SPACE = " \t\n\r"
_LOOSE_ID = re.compile(r"([0-9a-fA-F]{40}(?:[0-9a-fA-F]{24})?)(?:[ \t\n\r]|$)")
_HEX = re.compile(r"[0-9a-fA-F]+")
# What git's check_refname_format refuses, of the parts that matter for a path
# (``..``, a leading dot, ``//``, a ``.lock`` part, control characters...):
# git resolves no such ref, and its name is never made into a path here.
_BAD_NAME = re.compile(r"(^|/)\.|\.\.|//|\.lock(/|$)|[\x00-\x20\x7f~^:?*\[\\]|@\{|/$")
_ID = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")


def packed_record(line: str, hexsz: int = 40) -> tuple[str, str] | None:
    """``(id, name)`` of a ``packed-refs`` line (no ``\\n`` in it) of a
    repository whose ids are ``hexsz`` digits, as git's lookup of a name
    reads it: the id, then *any* one character (the binary search takes the
    name from ``hexsz + 1`` on; only a listing insists on a space), then the
    name; the id lowercase. None for the header, a peeled line, or one no
    lookup reads."""
    if not line or line[0] in "#^" or len(line) < hexsz + 2 or not _HEX.fullmatch(line[:hexsz]):
        return None
    return line[:hexsz].lower(), line[hexsz + 1:]


def packed_out_of_order(text: str, hexsz: int = 40) -> bool:
    """Whether a ``packed-refs`` whose header says ``sorted`` is not: git
    then looks a name up by binary search and misses records out of place
    (a tag moved to the end was no tag to git, and a file of the session's
    at ``.git/v1.0`` took its name), where a reading line by line finds them."""
    lines = text.split("\n")
    # git's traits: the header's text after "with:" cut at each space (``with:sorted`` is sorted).
    if not lines or not lines[0].startswith("# pack-refs with:") or \
            "sorted" not in lines[0][len("# pack-refs with:"):].split(" "):
        return False
    names = [record[1] for record in (packed_record(line, hexsz) for line in lines[1:]) if record is not None]
    return any(a.encode("utf-8", "surrogateescape") >= b.encode("utf-8", "surrogateescape")
               for a, b in zip(names, names[1:]))


def parse_loose(text: str) -> str:
    """A loose ref file's content -> its value (see the module)."""
    if text.startswith("ref:"):
        return "ref: " + text[4:].strip(_SPACE)
    m = _LOOSE_ID.match(text)
    return m.group(1).lower() if m else "broken: " + repr(text[:80])


def read_text(path: str, limit: int = 4096) -> str | None:
    """A ref file's text (a loose ref, ``HEAD``, ``packed-refs``: at most
    ``limit`` bytes), or None (``fs.read_regular``). A ref name that is not
    UTF-8 is read whole (``surrogateescape``), as the names of loose refs
    are listed: one read with U+FFFD in place of its bytes named another
    ref, which the end then wrote back in place of the user's."""
    read = fs.read_regular(path, limit=limit)
    return read[0].decode("utf-8", "surrogateescape") if read is not None else None


def loose(path: str) -> str | None:
    """The value of the loose ref at ``path`` (not followed if a symlink),
    or None when no file has that name now: git pruned it after a listing
    named it (``git pack-refs``, ``git gc``: its value is in ``packed-refs``
    by then), or deleted the ref. Read from one descriptor, so that a file
    gone between a look and the read is never taken for an empty one."""
    try:
        opened = fs.open_regular(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            try:
                return "symlink to " + os.readlink(path)
            except FileNotFoundError:
                return None
            except OSError:
                return "symlink"
        return "unreadable: " + (exc.strerror or str(exc.errno))
    if opened is None:
        return "not a regular file"
    fd, _st = opened
    try:
        data = fs.read_all(fd, 4096)
    except OSError as exc:
        return "unreadable: " + (exc.strerror or str(exc.errno))
    finally:
        os.close(fd)
    return parse_loose(data.decode("utf-8", "surrogateescape"))


def safe_name(name: str) -> bool:
    """Whether ``name`` is a ref name git resolves, and so one the end may
    write or remove by path (``refs/remotes/../../config`` in a session's
    ``packed-refs`` is neither)."""
    return _BAD_NAME.search(name) is None


def is_id(value: str) -> bool:
    """Whether ``value`` is an object id (lowercase, SHA-1 or SHA-256)."""
    return _ID.fullmatch(value) is not None


def writable(value: str) -> bool:
    """Whether ``value`` can be written back as a loose ref: an id, or a
    symbolic ref to a name below ``refs/``."""
    return is_id(value) or (value.startswith("ref: refs/") and "\n" not in value)
