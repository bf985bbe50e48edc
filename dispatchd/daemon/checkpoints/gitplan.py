"""Which of a worktree's ``.git`` a restore writes as files, which as refs,
and which it leaves alone; the refs a checkpoint saw. Pure: no I/O.

- **Another worktree's state is never written.** ``.git/worktrees/NAME/``
  (a linked worktree's index, ``HEAD``, logs, ``ORIG_HEAD``...) belongs to
  the user's other checkouts of the repository: a restore of this worktree
  neither writes nor removes anything there (``files_only`` drops it from
  the file plan, and ``changed_since`` never counts it as work to protect).
- **Reflogs are appended to, never replaced** (``.git/logs``): the user's
  entries stay; a ref the restore moves gets an entry of its own.
- **The values a restore or an end kept** (``.git/refs/dispatchd``) are
  never removed by a restore: they may be all that names a commit.
- **Refs are written as refs** (``.git/HEAD``, ``.git/packed-refs``, every
  file below ``.git/refs``): not copied back as files but set to the
  checkpoint's values one by one, each under git's lock (``gitrefs``), so
  that a value the user's git wrote meanwhile is read under that lock and
  kept, and a branch checked out in another worktree is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable

from dispatchd.daemon.gitguard import refvalues

from dispatchd.daemon.checkpoints.plan import Entry, RestorePlan, plan_restore

_LEFT = (b".git/worktrees", b".git/logs", b".git/refs/dispatchd")
_REFS = b".git/refs"
_HEAD = b".git/HEAD"
_PACKED = b".git/packed-refs"


def _under(path: bytes, top: bytes) -> bool:
    return path == top or path.startswith(top + b"/")


def is_ref(e: Entry) -> bool:
    """A file the restore writes as a ref (``gitrefs``), not as a file."""
    return e.kind == "f" and (e.path in (_HEAD, _PACKED) or (e.path.startswith(_REFS + b"/")
                                                             and not _under(e.path, b".git/refs/dispatchd")))


def by_files(e: Entry) -> bool:
    """Whether the file plan (``plan_restore``) handles ``e``: not what is
    left alone (``_LEFT``), not a ref, nor a directory below ``.git/refs``
    (made as refs need them, left when the user's refs are in them).
    A symlink or FIFO at a ref's name is the file plan's: removed as itself."""
    if any(_under(e.path, top) for top in _LEFT):
        return False
    if is_ref(e):
        return False
    return not (e.kind == "d" and e.path.startswith(_REFS + b"/"))


def files_only(entries: list[Entry]) -> list[Entry]:
    """``entries`` the file plan handles (``by_files``)."""
    return [e for e in entries if by_files(e)]


def plan_files(saved: list[Entry], now: list[Entry]) -> RestorePlan:
    """The file plan of a restore (``plan_restore``) of what it writes as files (``by_files``)."""
    return plan_restore(files_only(saved), files_only(now))


def ref_name(e: Entry) -> str:
    """The ref an entry of ``is_ref`` holds ("HEAD", "refs/heads/main")."""
    return e.path[len(b".git/"):].decode("utf-8", "surrogateescape")


def wanted(name: str) -> bool:
    """A ref a restore sets: ``HEAD`` and the refs below ``refs/`` git
    resolves, but the kept values (``refs/dispatchd/``, never taken away)."""
    return name == "HEAD" or (name.startswith("refs/") and not name.startswith("refs/dispatchd/")
                              and refvalues.safe_name(name))


def saved_refs(entries: list[Entry], read: Callable[[Entry], bytes], hexsz: int) -> dict[str, str]:
    """The refs as the checkpoint saw them: ``packed-refs``' records, then
    the loose refs (which win, as in git), ``HEAD``; ``read`` gives a saved
    file's bytes."""
    refs: dict[str, str] = {}
    loose = [e for e in entries if is_ref(e)]
    for e in loose:
        if e.path == _PACKED:
            for line in read(e).decode("utf-8", "surrogateescape").split("\n"):
                record = refvalues.packed_record(line, hexsz)
                if record is not None and wanted(record[1]):
                    refs[record[1]] = record[0]
    for e in loose:
        name = ref_name(e)
        if e.path != _PACKED and wanted(name):
            refs[name] = refvalues.parse_loose(read(e).decode("utf-8", "surrogateescape"))
    return refs


def ref_dirs_gone(saved: list[Entry], now: list[Entry]) -> list[bytes]:
    """Directories below ``.git/refs`` (not the kept values') the checkpoint
    did not have, deepest first: removed once empty, after the refs in them
    are deleted (one could stand where the checkpoint had a ref's file)."""
    had = {e.path for e in saved if e.kind == "d"}
    return sorted((e.path for e in now if e.kind == "d" and e.path.startswith(_REFS + b"/")
                   and not _under(e.path, b".git/refs/dispatchd") and e.path not in had), reverse=True)


def settable(value: str) -> bool:
    """A value a ref can be set to: an id, or a symbolic ref below ``refs/``."""
    return refvalues.writable(value)


def refs_changed(before: dict[str, str], want: dict[str, str], now: dict[str, str], elsewhere: set[str]) -> list[str]:
    """For a restore finished after a daemon's death: the refs someone set
    after it began (``before``: the record's), that hold neither their value
    then nor the checkpoint's (``want``), or were deleted though the
    checkpoint has them: finishing would move that work aside. A branch
    checked out in another worktree (``elsewhere``) is no restore's to
    move, whatever it holds; ``HEAD`` is looked at where detached."""
    names = {n for n in set(before) | set(now) if wanted(n) and n not in elsewhere}
    found = []
    for name in sorted(names):
        value = now.get(name)
        if value is None and name == "HEAD":
            continue  # a symbolic HEAD: the file plan's comparison sees it
        if value != before.get(name) and value != want.get(name):
            found.append(name)
    return found
