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

from dispatchd.daemon.gitguard import fs, objectstore, reflock, refsback, refvalues, reftemp

MAX_BYTES = 1 << 20  # ~6,000 stashes; a larger list is not kept (said at the baseline)
MAX_KEPT = 1000  # distinct stashes of a replaced log kept as refs; the rest counted, the log itself kept whole
LOG = "logs/refs/stash"
LOCK_LEFT = LOG + ".lock"  # git's lock of the log itself, made under refs/stash.lock
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
        data = fs.read_all(fd, limit + 1)  # grown while read: one byte over says so
        if len(data) > limit:
            raise Unkept(f"{LOG} is larger than {limit >> 20} MiB")
        return data
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


def put_back(common: str, kept: Kept | None, stamp: str, ref: str | None = None,
             store: objectstore.Store | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """The baseline's stash list made the repository's again (see the
    module). ``ref``: ``refs/stash`` at the baseline (``refsback`` has put
    it back), set again under the same hold of its lock as the list: a
    stash the user's git pushed between the two holds was left the ref,
    with the list not naming it. ``store``: the repository's objects (an
    entry naming none is not kept: ``reftemp.keep_displaced``). Returns
    what was done and what failed."""
    if kept is None:
        return [], []
    want = kept.data if kept.present else None
    if _now(common) == (want, "") and not os.path.lexists(os.path.join(common, LOCK_LEFT)):
        return [], []  # the usual case, told without the lock
    path = os.path.join(common, LOG)
    try:
        with reflock.held(common, "refs/stash", ref or "") as lock:  # git's lock: no stash drop writes meanwhile
            left = _lock_left(common)
            now, unread = _now(common)  # under the lock: what git has now
            if (now, unread) == (want, ""):
                return ([(LOG, f"git's lock {LOCK_LEFT}, left by a git that was killed (it blocked your git stash "
                               f"drop and pop), moved to {left} in the git directory")] if left else []), []
            found = now or b""
            listed = stashes(found)
            at = refsback.read_refs(common, ("refs/stash",)).get("refs/stash")
            if at is not None and at != ref and at not in listed and refvalues.is_id(at):
                listed.append(at)  # the ref moved since its put back, by a push the list does not name
            before = set(stashes(kept.data))
            new = _distinct([(n, i) for n, i in enumerate(listed) if i not in before])
            names = _keep(common, stamp, new[:MAX_KEPT], store)
            aside = _move_out(common) if os.path.lexists(path) else ""
            if kept.present:
                reftemp.make_room(common, LOG)
                if fs.is_dir(path):  # a directory of the session's in the way
                    fs.move_aside(path)
                reftemp.write_file(path, kept.data)
            if at != ref and ref is not None and refvalues.writable(ref):
                lock.commit()  # the ref as the list's top says
            elif at is not None and ref is None and not kept.present:
                lock.remove()  # pushed since newrefs took the session's out: none at the baseline
    except reflock.Held as exc:
        return _held(common, kept, stamp, store, exc)
    except OSError as exc:
        return [], [f"{LOG}: the stash list cannot be put back ({exc.strerror})"]
    said = _said(kept, found, len(new), names, unread, aside)
    return [(LOG, said + (f"; git's lock {LOCK_LEFT}, left by a git that was killed, moved to {left}" if left else ""))], []


def _keep(common: str, stamp: str, new: list[tuple[int, str]], store: objectstore.Store | None) -> list[str]:
    """Each of ``new`` (``stash@{N}``, id) kept as ``.../stash-entries/N``,
    but one kept so already (an end cut short by the daemon's death, done
    again at the next start under another TIME): the names written."""
    if not new:
        return []
    known = refsback.read_refs(common, (reftemp.DISPLACED,))  # once: each keep looked names up in all of it
    already = {v for n, v in known.items() if f"/{ENTRIES}/" in n}
    names = []
    for n, value in new:
        if value not in already:  # a thousand lines naming one commit: kept once
            already.add(value)
            names.append(reftemp.keep_displaced(common, stamp, f"{ENTRIES}/{n}", value, store, known))
    return [n for n in names if n]


def _distinct(entries: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Each id once, at its first (newest) place."""
    first: dict[str, int] = {}
    for n, i in entries:
        first.setdefault(i, n)
    return [(n, i) for i, n in first.items()]


def _lock_left(common: str) -> str:
    """``logs/refs/stash.lock``, which git makes only while it holds
    ``refs/stash.lock`` (held here): one there now was left by a git that
    was killed, and blocks every later ``git stash drop`` and ``pop``.
    Moved to the git directory's top; returns its name there, or ""."""
    if not os.path.lexists(os.path.join(common, LOCK_LEFT)):
        return ""
    return _move_out(common, "stash.lock", "stash-log-lock")


def _held(common: str, kept: Kept, stamp: str, store: objectstore.Store | None,
          exc: reflock.Held) -> tuple[list[tuple[str, str]], list[str]]:
    """The list could not be put back (git's lock held past its wait):
    each stash of the baseline's kept as a ref instead, so that none is
    left named by nothing."""
    try:  # the user's own values: kept whatever a look at the objects says (a session can cloud it)
        names = _keep(common, stamp, [(n, i) for n, i in enumerate(stashes(kept.data))], None)
    except OSError as kept_exc:
        return [], [f"{LOG}: the stash list not put back ({exc.strerror}), and your stashes could not be kept "
                    f"({kept_exc.strerror})"]
    where = f"; your {len(names)} stashes kept as {names[0].rsplit('/', 1)[0]}/N" if names else ""
    return [(LOG, f"the stash list not put back: {exc.strerror}{where}")], []


def _now(common: str) -> tuple[bytes | None, str]:
    """The log's bytes now (None: absent) and, where it cannot be read whole, why."""
    try:
        return _read(common, MAX_BYTES), ""
    except Unkept as exc:
        return None, str(exc)


def _move_out(common: str, leaf: str = "stash", called: str = "stash-log") -> str:
    """The log found (or ``leaf`` beside it) moved to the git directory's
    top, out of ``logs/`` (where git reads a reflog); returns its name there."""
    src = fs.parent_at(os.path.join(common, os.path.dirname(LOG)))
    try:
        return fs.move_to_top(common, src, leaf, called)
    finally:
        os.close(src)


def _said(kept: Kept, found: bytes, new: int, names: list[str], unread: str, aside: str) -> str:
    # "While a session ran": the user's own git in another worktree of the repository looks the same.
    gone = len(set(stashes(kept.data)) - set(stashes(found))) if not unread else 0
    what = (unread if unread else
            f"{gone} of your stashes taken out of it while a session ran" if gone else "changed while a session ran")
    back = "put back as it was" if kept.present else "taken out (there was none)"
    parts = [f"the stash list: {what}; {back}"]
    if names:
        first = names[0].rsplit("/", 1)[0]
        parts.append(f"{len(names)} stashes made since kept as {first}/N (git stash apply {names[0]})")
    if new > len(names):
        parts.append(f"{new - len(names)} {'other ' if names else ''}stashes made since not kept here "
                     f"(kept already, naming no object, or past the first {MAX_KEPT})")
    if aside:
        parts.append(f"the list found moved to {aside} in the git directory")
    return "; ".join(parts)
