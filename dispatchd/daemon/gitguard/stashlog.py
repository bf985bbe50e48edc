"""The user's stash list, kept across a session: ``git stash list`` reads
nothing but the reflog ``logs/refs/stash``, and each of its lines is all
that names the work it holds (``stash@{1}`` and below are named by no ref).
A session's ``git stash clear``, ``git stash drop`` or ``git reflog
expire`` took the user's stashes out of reach (``git gc`` then drops them),
and the end, putting ``refs/stash`` back, left an empty list beside it.

- ``read``: the log's bytes at the baseline (a regular file, at most
  ``MAX_BYTES``; none there is recorded too), or None where it cannot be
  kept (the caller says why);
- ``put_back``: at the end, once the refs are back (``refsback``): a log
  that is not the baseline's is moved out of ``logs/`` to the git
  directory's top (``fs.aside_name``; git reads no reflog there), each
  stash it held that the baseline's did not (a session's, or one the user
  made in another worktree meanwhile: they look the same) kept as
  ``refs/dispatchd/displaced/TIME/stash-entries/N`` (``N``: its
  ``stash@{N}`` then), and the baseline's written back whole. All of it
  under git's lock of ``refs/stash``, as git's own ``stash drop`` rewrites
  the log; nothing is deleted.

The other reflogs are ``reflogs.py``'s (which leaves this one out): theirs
are put back as the kept lines and those since, where this list is written
back exactly.
"""

from __future__ import annotations

import errno
import os
import stat

import msgspec

from dispatchd.daemon.gitguard import fs, reflock, refvalues, reftemp

MAX_BYTES = 1 << 20  # ~6,000 stashes; a larger list is not kept (said at the baseline)
MAX_KEPT = 1000  # entries of a replaced log kept as refs; the rest counted, the log itself kept whole
LOG = "logs/refs/stash"
ENTRIES = "stash-entries"


class Kept(msgspec.Struct, frozen=True):
    present: bool  # False: no stash list at the baseline
    data: bytes = b""


class Unkept(Exception):
    """The log cannot be kept: not a regular file, or too large."""


def _read(common: str, limit: int) -> bytes | None:
    """The log's bytes (None: absent); raises ``Unkept`` for anything else
    than a regular file of at most ``limit`` bytes, or one unreadable."""
    try:
        fd = os.open(os.path.join(common, LOG), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unkept(f"{LOG} is a symlink") from None
        raise Unkept(f"{LOG}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unkept(f"{LOG} is not a regular file")
        if st.st_size > limit:
            raise Unkept(f"{LOG} is larger than {limit >> 20} MiB")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise Unkept(f"{LOG} is larger than {limit >> 20} MiB")
        return b"".join(chunks)
    except OSError as exc:
        raise Unkept(f"{LOG}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read(common: str) -> tuple[Kept | None, str]:
    """The stash list as the baseline has it, and what is not kept (or "")."""
    try:
        data = _read(common, MAX_BYTES)
    except Unkept as exc:
        return None, f"the stash list not kept: {exc}"
    return Kept(present=data is not None, data=data or b""), ""


def stashes(data: bytes) -> list[str]:
    """The ids a log names, ``stash@{0}`` first (its last line's)."""
    ids = []
    for line in data.splitlines():
        fields = line.split(b" ", 2)
        if len(fields) == 3 and refvalues.is_id(fields[1].decode("ascii", "replace")):
            ids.append(fields[1].decode("ascii"))
    return ids[::-1]


def put_back(common: str, kept: Kept | None, stamp: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The baseline's stash list made the repository's again (see the
    module). Returns what was done and what failed."""
    if kept is None:
        return [], []
    want = kept.data if kept.present else None
    if _now(common) == (want, ""):  # the usual case, told without the lock
        return [], []
    path = os.path.join(common, LOG)
    try:
        with reflock.held(common, "refs/stash"):  # git's lock of the ref: no stash drop writes the log meanwhile
            now, unread = _now(common)  # under the lock: what git has now
            if (now, unread) == (want, ""):
                return [], []
            found = now or b""
            before = set(stashes(kept.data))
            new = [(n, i) for n, i in enumerate(stashes(found)) if i not in before]
            names = [reftemp.keep_displaced(common, stamp, f"{ENTRIES}/{n}", value) for n, value in new[:MAX_KEPT]]
            aside = _move_out(common) if os.path.lexists(path) else ""
            if kept.present:
                reftemp.make_room(common, LOG)
                if fs.is_dir(path):  # a directory of the session's in the way
                    fs.move_aside(path)
                reftemp.write_file(path, kept.data)
    except OSError as exc:
        return [], [f"{LOG}: the stash list cannot be put back ({exc.strerror})"]
    return [(LOG, _said(kept, found, len(new), names, unread, aside))], []


def _now(common: str) -> tuple[bytes | None, str]:
    """The log's bytes now (None: absent) and, where it cannot be read whole, why."""
    try:
        return _read(common, MAX_BYTES), ""
    except Unkept as exc:
        return None, str(exc)


def _move_out(common: str) -> str:
    """The log found moved to the git directory's top; returns its name there."""
    src = fs.parent_at(os.path.join(common, os.path.dirname(LOG)))
    try:
        dst = fs.parent_at(common)
        try:
            name = fs.aside_name("stash-log")
            os.rename("stash", name, src_dir_fd=src, dst_dir_fd=dst)
            return name
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _said(kept: Kept, found: bytes, new: int, names: list[str], unread: str, aside: str) -> str:
    gone = len(set(stashes(kept.data)) - set(stashes(found))) if not unread else 0
    what = (unread if unread else
            f"{gone} of your stashes taken out of it by a session" if gone else "changed by a session")
    back = "put back as it was" if kept.present else "taken out (there was none)"
    parts = [f"the stash list: {what}; {back}"]
    if names:
        first = names[0].rsplit("/", 1)[0]
        parts.append(f"{new} stashes made since kept as {first}/N (git stash apply {names[0]})"
                     + (f", the first {MAX_KEPT} of them" if new > MAX_KEPT else ""))
    if aside:
        parts.append(f"the list found moved to {aside} in the git directory")
    return "; ".join(parts)
