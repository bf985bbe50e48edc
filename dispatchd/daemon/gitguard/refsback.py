"""The refs the user had: read as git reads them at a baseline, put back
at the end (``history.restore`` calls ``put_back`` once the objects are).

- ``read_refs``: branches, tags, remote-tracking branches, notes, the
  stash and the values the daemon kept under ``refs/dispatchd/``
  (``PROTECTED_PREFIXES``), each valued as git reads it
  (``refvalues``), in git's order: loose refs (which win), then
  ``packed-refs``, the whole read done again while ``packed-refs``
  changes under it; loose ones only below real directories, bounded;
- ``put_back``: what stands in front of a short name of the user's taken
  out (``shadows``); each ref that is gone or moved written back as a loose
  ref under git's own lock (``reflock``; one held by the user's git left,
  its baseline's value kept, and said), read again under it, the value it
  was moved to kept as ``refs/dispatchd/displaced/TIME/
  NAME`` (nothing lost either way), but for a branch that only moved
  forward (kept, and said: the user's own commits in another worktree look
  the same) and the branches the sessions had checked out (``own``: theirs
  to move); new remote-tracking refs, notes and stash taken out
  (``newrefs``);
- ``read_all`` and ``keep_moved``: around a checkpoint's restore, which
  writes ``.git`` back as the checkpoint had it (refs, ``packed-refs``,
  logs): each ref it moved other than forward, or deleted, kept as
  ``refs/dispatchd/displaced/TIME/NAME`` by the same writer
  (``reftemp.keep_displaced``), and the displaced refs it removed written
  back: a commit made beside a session stays reachable.
"""

from __future__ import annotations

import os
import time

from dispatchd.daemon.gitguard import configs, fs, newrefs, objectstore, reflock, refvalues, reftemp, shadows

_MAX_REFS = 100_000
# Branches, tags, remote-tracking branches (a plain `git merge` takes the upstream's), notes, the stash.
# refs/dispatchd/: the values the daemon kept (``reftemp.DISPLACED``), which may be
# all that names a commit of the user's; put back as a branch is, and a new one stays.
PROTECTED_PREFIXES = ("refs/heads/", "refs/tags/", "refs/remotes/", "refs/notes/", "refs/stash", "refs/dispatchd/")


_MAX_REF_DIRS = 100_000  # directories of loose refs looked at


def _real_dirs(common: str, rel: str) -> bool:
    """Whether every component of ``rel`` below ``common`` is a directory,
    not a symlink to one (``.git/refs/heads -> /`` walked the whole disk)."""
    path = common
    for part in rel.split("/"):
        path = os.path.join(path, part)
        if not fs.is_dir(path):
            return False
    return True


class OverBound(Exception):
    """More refs than a read looks at (``_MAX_REFS``), or more directories of
    loose refs (``_MAX_REF_DIRS``): what it returned would be part of them."""


def read_refs(common: str, prefixes: tuple[str, ...] = PROTECTED_PREFIXES, *, whole: bool = False) -> dict[str, str]:
    """Branches and tags (the refs below ``prefixes``), each valued as git reads it (``refvalues``),
    read in git's order so that the user's own ``git pack-refs`` (``git gc``)
    running beside the read never makes a ref look changed or gone: the
    loose refs first (only below real directories, at most
    ``_MAX_REF_DIRS`` of them), then ``packed-refs``, whose value a loose one
    hides. Git packs a ref (writes ``packed-refs``) before it prunes the
    loose file, so a loose file listed and gone when read (``refvalues.loose``:
    None) has its value in the ``packed-refs`` read after it; one read before
    would miss it, and the reading of a pruned name as a file gave "not a
    regular file". Where ``packed-refs`` changed during a read (its inode,
    size or mtime), the whole read is done again, up to ``_READS`` times: a
    read is one state of the refs, not half of two. A name ``packed-refs``
    gives two values has neither (git's binary search finds one or the
    other): it differs from any baseline. ``whole``: ``OverBound`` where
    the bounds cut the read (a baseline's: a session that made 100,000
    branches pushed the user's own out of the next session's baseline, and
    their deletion by that session was then not put back); else the refs
    read within the bounds."""
    refs: dict[str, str] = {}
    packed_path = os.path.join(common, "packed-refs")
    cut: list[str] = []
    for _attempt in range(_READS):
        cut = []
        before = _stamp(packed_path)
        loose = _read_loose(common, prefixes, cut)
        text, read_from = _read_packed(packed_path)
        refs = _packed_values(common, text, prefixes, cut)
        refs.update(loose)  # a loose ref wins, as in git
        if read_from == before and _stamp(packed_path) == before:
            break
    if len(refs) > _MAX_REFS:
        cut.append(f"more than {_MAX_REFS:,} refs")
    if cut and whole:
        raise OverBound(cut[0])
    return dict(list(refs.items())[:_MAX_REFS])


_READS = 5  # whole reads of the refs tried while packed-refs keeps changing under them
_PACKED_MAX = 64 * 1024 * 1024  # bytes of packed-refs read (replacerefs reads as many)


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    """What tells one ``packed-refs`` from the next (git renames a new one
    into place: a new inode), or None when there is none."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _read_packed(path: str) -> tuple[str, tuple[int, int, int, int] | None]:
    """``packed-refs``' text ("" when absent, not a regular file or
    unreadable) and the stamp of the very file read (``_stamp``)."""
    try:
        opened = fs.open_regular(path)
    except OSError:
        return "", None
    if opened is None:
        return "", _stamp(path)
    fd, st = opened
    try:
        data = fs.read_all(fd, _PACKED_MAX)
    except OSError:
        data = b""
    finally:
        os.close(fd)
    return data.decode("utf-8", "surrogateescape"), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _packed_values(common: str, text: str, prefixes: tuple[str, ...], cut: list[str]) -> dict[str, str]:
    """The refs below ``prefixes`` that ``packed-refs``' ``text`` names, valued as git's lookup reads them."""
    refs: dict[str, str] = {}
    hexsz = configs.object_id_size(common) * 2
    unsorted = refvalues.packed_out_of_order(text, hexsz)  # git's binary search misses what we read
    for line in text.split("\n"):
        record = refvalues.packed_record(line, hexsz)
        if record is not None and record[1].startswith(prefixes) and refvalues.safe_name(record[1]):
            oid, name = record
            refs[name] = "out of order in a sorted packed-refs" if unsorted else \
                oid if refs.get(name, oid) == oid else "named twice in packed-refs"
            if len(refs) > _MAX_REFS:
                cut.append(f"more than {_MAX_REFS:,} refs in packed-refs")
                break
    return refs


def _read_loose(common: str, prefixes: tuple[str, ...], cut: list[str]) -> dict[str, str]:
    """The loose refs below ``prefixes``; a name listed whose file is gone
    when read (pruned, deleted) is left out: ``packed-refs``, read after,
    has it if git packed it. What a bound left unread is said in ``cut``."""
    refs: dict[str, str] = {}
    dirs = 0
    for prefix in prefixes:
        if not prefix.endswith("/"):  # one ref, not a directory of them (refs/stash)
            parent = os.path.dirname(prefix)
            if _real_dirs(common, parent):
                value = refvalues.loose(os.path.join(common, prefix))
                if value is not None:
                    refs[prefix] = value
            continue
        if not _real_dirs(common, prefix.rstrip("/")):
            continue
        top = os.path.join(common, prefix.rstrip("/"))
        pending = [(top, prefix.rstrip("/"))]
        while pending:
            if len(refs) > _MAX_REFS or dirs >= _MAX_REF_DIRS:
                cut.append(f"more than {_MAX_REFS:,} loose refs" if dirs < _MAX_REF_DIRS
                           else f"more than {_MAX_REF_DIRS:,} directories of loose refs")
                break
            path, name = pending.pop()
            dirs += 1
            try:
                entries = fs.scanned(path)
            except OSError:
                continue
            for entry in entries:
                full = f"{name}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, full))
                elif refvalues.safe_name(full):  # not git's own lock while it writes (``.lock``), no ref
                    value = refvalues.loose(entry.path)
                    if value is not None:
                        refs[full] = value
    return refs


def checked_out(gitdir: str) -> str:
    """The branch a git directory's HEAD names (``refs/heads/...``), or ""."""
    text = (refvalues.read_text(os.path.join(gitdir, "HEAD")) or "").strip()
    return text[5:].strip() if text.startswith("ref: refs/heads/") else ""


def put_back(common: str, refs: dict[str, str], own: list[str], head: str, shadows_before: list[str] | None,
             borrowed: list[str], there: objectstore.Store | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """Put back ``refs`` (the baseline's) as the module says; ``own``: the
    branches the sessions had checked out; ``head``: the common directory's
    HEAD as it was; ``shadows_before``: what stood in front of the short
    names at the baseline (None: an older record's, not looked at);
    ``borrowed``: the object stores the user's alternates name; ``there``:
    the caller's ``objectstore.finder`` (None: one made here)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    objects = os.path.join(common, "objects")
    try:  # a ref of the session's in front of a short name of the user's
        moved, bad = ([], []) if shadows_before is None else shadows.clear(common, list(refs), shadows_before)
        done, failed = done + moved, failed + bad
    except Exception as exc:  # noqa: BLE001 - reported; the refs are still put back below
        failed.append(f"{common}: the look at refs in front of yours failed: {exc!r}")
    try:
        for sub in ("refs/heads", "refs/tags"):
            os.makedirs(os.path.join(common, sub), exist_ok=True)
        if head and not os.path.lexists(os.path.join(common, "HEAD")):
            reftemp.write_ref(common, "HEAD", head.strip())
            done.append((os.path.join(common, "HEAD"), "deleted by a session; put back"))
    except OSError as exc:
        failed.append(f"{common}: refs or HEAD cannot be made again ({exc.strerror})")
    # One store for every moved branch (its packs' indexes read once) and one
    # deadline for all of them: past it, a branch is put back without asking
    # whether it was fast-forwarded (is_ancestor says "not known").
    store = objectstore.Store(objects, deadline=time.monotonic() + objectstore.BUDGET_S * 2, alternates=borrowed)
    there = there or objectstore.finder(objects, borrowed)  # whether a value to keep names an object at all
    now = read_refs(common)
    known = {n: v for n, v in now.items() if n.startswith(reftemp.DISPLACED)}  # read once for every keep
    stamp = reftemp.stamp()
    for name, old in sorted(refs.items()):
        if name in own or now.get(name) == old:
            continue
        said, bad = _put_one(common, name, old, now.get(name), _Forward(objects, store, there, known), stamp)
        done += said
        failed += bad
    moved, bad = newrefs.clear(common, now, refs, stamp, there, known)  # new upstream-tracking refs, notes, stash
    return done + moved, failed + bad


class _Forward:
    """Whether a branch moved only forward (``objectstore.is_ancestor``), in one store."""

    def __init__(self, objects: str, store: objectstore.Store, there: objectstore.Store,
                 known: dict[str, str]) -> None:
        self.objects, self.store, self.there, self.known = objects, store, there, known

    def __call__(self, name: str, old: str, new: str | None) -> bool:
        return new is not None and name.startswith("refs/heads/") and refvalues.is_id(old) and \
            refvalues.is_id(new) and objectstore.is_ancestor(self.objects, old, new, self.store) is True


def _put_one(common: str, name: str, old: str, new: str | None, forward: _Forward, stamp: str
             ) -> tuple[list[tuple[str, str]], list[str]]:
    """One ref of the baseline (``old``) that reads ``new`` now, put back
    under git's own lock (``reflock``), read again once the lock is ours:
    the value it replaces is what git has then, and is always kept as
    ``refs/dispatchd/displaced/TIME/NAME`` (an id or a symbolic ref; a
    broken file or a symlink names nothing). Returns what was done and
    what failed."""
    if not refvalues.writable(old):
        # Nothing to write back, and nothing of the user's lost by leaving it: the baseline's
        # value named no commit (a file git reads as no ref; or, in a record of an older daemon,
        # a loose ref read while the user's git packed it). Said, not failed: a check that
        # failed here refused the worktree at every open, and at every start after.
        left = "gone" if new is None else f"at {new[:12]}" if refvalues.is_id(new) else f"as {new[:60]}"
        return [(name, f"its value at the baseline ({old[:60]}) names no commit, so none is written back; "
                       f"left {left} (git reflog {name} names what it held)")], []
    if forward(name, old, new):  # told before the lock: the ancestry's walk never holds the user's git up
        return [(name, _FORWARD.format(old=old[:12], new=new[:12] if new else ""))], []
    try:
        with reflock.held(common, name, old) as lock:
            left = f"; git's lock {name}.lock, left in the way, moved aside to {lock.moved}" if lock.moved else ""
            now = read_refs(common, (name,)).get(name)  # under the lock: what git has now
            if now == old:
                return [(name, f"left at its value{left}")] if left else [], []
            if now != new and forward(name, old, now):  # moved again since the first read
                return [(name, _FORWARD.format(old=old[:12], new=now[:12] if now else "") + left)], []
            if now is not None and refvalues.writable(now) and \
                    not reftemp.keep_displaced(common, stamp, name, now, forward.there, forward.known):
                left += f"; {now[:12]} names no object here, so it is not kept"
            lock.commit()
    except reflock.Held as exc:
        # Never written without the lock: left as it is, the baseline's value kept instead,
        # so that nothing of the user's is lost whoever's value the ref holds now.
        try:
            kept = reftemp.keep_displaced(common, stamp, name, old, known=forward.known)
        except OSError as kept_exc:
            return [], [f"{name}: not put back ({exc.strerror}), and its value at the baseline ({old[:12]}) "
                        f"could not be kept ({kept_exc.strerror})"]
        return [(name, f"not put back: {exc.strerror}; its value at the baseline kept as {kept} "
                       f"(git update-ref {name} {kept} puts it back)")], []
    except OSError as exc:
        return [], [f"{name}: {exc.strerror}"]
    what = "deleted" if now is None else f"moved to {now[:12]}" if refvalues.is_id(now) else f"made {now[:60]}"
    return [(name, f"{what} by a session; put back at {old[:12] if refvalues.is_id(old) else old}{left}")], []


_FORWARD = ("moved forward while a session ran, kept (a fast-forward; your own commits look the same): "
            "review git log {old}..{new}")  # what it carries goes where it goes


def read_all(common: str) -> dict[str, str]:
    """Every ref below ``refs/`` (the displaced ones included), and ``HEAD``
    when it is detached (a commit made there is named by nothing else)."""
    refs = read_refs(common, ("refs/",))
    head = (refvalues.read_text(os.path.join(common, "HEAD")) or "").strip()
    if refvalues.is_id(head):
        refs["HEAD"] = head
    return refs


def keep_moved(common: str, before: dict[str, str], borrowed: list[str] | None = None,
               when: str = "") -> tuple[list[str], list[str]]:
    """After a restore wrote ``common``'s refs back: each ref of ``before``
    (``read_all`` just before it) that it deleted or moved other than
    forward kept as ``refs/dispatchd/displaced/TIME/NAME``, as the end's put
    back keeps a session's moves (``reftemp.keep_displaced``); one moved
    forward is not (its old value is still reachable: an ancestor). A
    displaced ref the restore removed or changed (made after the checkpoint)
    is written back under its own name. Returns the names written and what
    failed. An ancestry that cannot be told in time keeps the value.
    ``borrowed``: the object stores the user's alternates named at the
    baseline (``history.borrowed``), as ``put_back`` asks them: a shared
    clone's commits are there, and a move along them is forward.
    ``when``: the TIME of the names (``reftemp.stamp``; "": now). A restore
    gives the one its record holds, so that finishing it after a daemon's
    death writes the names the cut run wrote, with the same values."""
    now = read_all(common)
    objects = os.path.join(common, "objects")
    store = objectstore.Store(objects, deadline=time.monotonic() + objectstore.BUDGET_S * 2, alternates=borrowed)
    when = when or reftemp.stamp()
    there = objectstore.finder(objects, borrowed)
    kept: list[str] = []
    failed: list[str] = []
    for name, old in sorted(before.items()):
        new = now.get(name)
        if new == old or not refvalues.is_id(old):
            continue  # unmoved, or a symbolic ref: nothing it names becomes unreachable
        try:
            if name.startswith(reftemp.DISPLACED):
                reftemp.write_ref(common, name, old)  # ours: a restore never takes one away
                kept.append(name)
            elif not (new is not None and refvalues.is_id(new) and objectstore.is_ancestor(objects, old, new, store)):
                # A session's value may name nothing (a random id): not kept then.
                named = reftemp.keep_displaced(common, when, name, old, there)
                kept += [named] if named else []
        except OSError as exc:
            failed.append(f"{name}: its value {old[:12]} could not be kept ({exc.strerror})")
    return kept, failed
