"""The user's reflogs put back at the last end (``history.restore``, once
the refs are back), from the copies ``reflogs.record`` kept at the baseline.

Guarantees of ``put_back``:
- a reflog whose content now starts with the kept bytes (git only
  appended to it, its normal use) is left as it is: not written, not
  moved. Its stat unchanged since the baseline, it is not even read;
- any other (lines taken out or changed, emptied in place, removed, or a
  symlink, FIFO or directory in its place) is written back as the kept
  lines followed by the lines it holds now that are not among them (a
  commit since the baseline, in order): whole or not at all (a temporary
  file of ours, renamed over it: ``reftemp.write_at``), under git's lock of
  its ref (``reflock.held``: ``HEAD.lock`` for ``logs/HEAD``), as git's own
  ``reflog expire`` rewrites it. What was there and is not a regular file
  (or is larger than ``reflogs.MAX_FILE``) is moved to the git directory's
  top (git reads no reflog there), never deleted; nothing is read or
  written through a symlink (``fs.parent_at``, ``O_NOFOLLOW``);
- the same run again (a daemon killed half way: the next start's restore)
  finds the reflogs it wrote starting with the kept bytes, and the others
  as the first run did: no line lost, none twice;
- a reflog of a linked worktree that is gone since (``git worktree
  remove``) is not put back: its directory would be git's no more;
- said in one line for the repository: how many reflogs, how many lines.
"""

from __future__ import annotations

import os
import stat

from dispatchd.daemon.gitguard import fs, reflock, reflogs, reftemp

_MOST_NAMED = 5


def put_back(common: str, kept: reflogs.Kept | None) -> tuple[list[tuple[str, str]], list[str]]:
    """The kept reflogs a session cut made whole again (see the module).
    Returns what was done and what failed."""
    if kept is None:
        return [], []
    cut = [(rel, log) for rel, log in sorted(kept.logs.items()) if not _intact(common, rel, log)]
    if not cut:
        return [], []  # the usual case: a stat each
    names: list[str] = []
    lines = 0
    aside: list[str] = []
    gone_worktree = 0
    failed: list[str] = []
    lost: list[str] = []
    for rel, log in cut:
        if rel.startswith("worktrees/") and not fs.is_dir(os.path.join(common, *rel.split("/")[:2])):
            gone_worktree += 1
            continue
        data = reflogs.kept_bytes(kept, rel, log)
        if data is None:
            # Said, not failed: no later check could find the copy either, and a failed check
            # refuses the worktree until one passes (every start, for good).
            lost.append(rel)
            continue
        try:
            done = _put_one(common, rel, log, data)
        except OSError as exc:
            failed.append(f"{rel}: the reflog cannot be put back ({exc.strerror})")
            continue
        if done is not None:
            names.append(reflogs.refname(rel))
            lines += done[0]
            aside += done[1]
    said = [("logs", _said(names, lines, aside, gone_worktree))] if names or gone_worktree else []
    if lost:
        said.append(("logs", f"{len(lost)} reflogs cut by a session not put back: their copies kept at the baseline "
                              f"are gone (a crash of the machine before they were written?): {', '.join(lost[:5])}"
                              + (", ..." if len(lost) > 5 else "")))
    return said, failed


def _intact(common: str, rel: str, log: reflogs.Log) -> bool:
    """Whether ``rel`` still starts with the kept bytes (its stat as at the baseline: not read)."""
    try:
        st = os.lstat(os.path.join(common, rel))
    except OSError:
        return False
    if stat.S_ISREG(st.st_mode) and (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) == log.st:
        return True
    if st.st_size > reflogs.MAX_FILE:
        return False  # grown past the bound: the next baseline would keep it no more (a session's 17 MB)
    kind, data = _current(common, rel, log.size)
    return kind == "file" and len(data) == log.size and reflogs.digest(data) == log.digest


def _current(common: str, rel: str, limit: int) -> tuple[str, bytes]:
    """``rel`` as it is now: ``("file", its first limit bytes)``,
    ``("absent", b"")`` (its directory too, or a symlink on the way there:
    ``reftemp.make_room`` moves that aside), or ``("other", b"")`` (a
    symlink, FIFO, directory, or unreadable)."""
    try:
        parent = fs.parent_at(os.path.dirname(os.path.join(common, rel)))
    except OSError:
        return "absent", b""
    try:
        try:
            fd = os.open(os.path.basename(rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=parent)
        except FileNotFoundError:
            return "absent", b""
        except OSError:
            return "other", b""  # a symlink (ELOOP), a socket (ENXIO), a mode a session set
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "other", b""
            return "file", fs.read_all(fd, limit)
        except OSError:
            return "other", b""
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def _put_one(common: str, rel: str, log: reflogs.Log, data: bytes) -> tuple[int, list[str]] | None:
    """``rel`` written back under its ref's lock (see the module): the
    count of kept lines it lacked and where what was there went; None when
    it is whole after all (the user's git, meanwhile)."""
    leaf = os.path.basename(rel)
    with reflock.held(common, reflogs.refname(rel)):  # no git writes the ref, nor so its log, meanwhile
        kind, now = _current(common, rel, reflogs.MAX_FILE + 1)
        big = kind == "file" and len(now) > reflogs.MAX_FILE  # moved out, the kept lines alone written back
        if kind == "file" and now[:log.size] == data and not big:
            return None
        path = reftemp.make_room(common, rel)  # its directories; a file or symlink in the way of one moved aside
        parent = fs.parent_at(os.path.dirname(path))
        try:
            aside = [fs.move_to_top(common, parent, leaf, f"reflog-{leaf}")] if kind == "other" or big else []
            _sweep(parent, os.path.dirname(path), leaf)  # what a write of ours a killed daemon cut left
            found = now.split(b"\n") if kind == "file" and not big else []
            ours = set(data.split(b"\n"))
            body = data if data.endswith(b"\n") else data + b"\n"
            body += b"".join(line + b"\n" for line in found if line and line not in ours)
            reftemp.write_at(parent, leaf, body)
            return len(ours - set(found) - {b""}), aside
        finally:
            os.close(parent)


def _sweep(parent: int, path: str, leaf: str) -> None:
    """Our temporary files of ``leaf`` a killed daemon left in ``parent`` removed (``reftemp.sweep_names``)."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)
    try:
        reftemp.sweep_names(fd, path, [n for n in os.listdir(fd) if n.startswith(leaf + ".dispatchd-")], {leaf})
    finally:
        os.close(fd)


def _said(names: list[str], lines: int, aside: list[str], gone_worktree: int) -> str:
    parts = []
    if names:
        shown = ", ".join(names[:_MOST_NAMED]) + (", ..." if len(names) > _MOST_NAMED else "")
        parts.append(f"{len(names)} reflogs a session cut put back ({lines} lines of your `git reflog`, and the "
                     f"commits only they name): {shown}")
    if aside:
        parts.append(f"what was found in place of {len(aside)} of them moved to the git directory: "
                     + ", ".join(aside[:_MOST_NAMED]) + (", ..." if len(aside) > _MOST_NAMED else ""))
    if gone_worktree:
        parts.append(f"{gone_worktree} reflogs of a linked worktree removed since not put back")
    return "; ".join(parts)
