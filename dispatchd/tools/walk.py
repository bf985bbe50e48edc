"""Which files ``list_files`` and ``search_files`` look at, and in what order.

Guarantees:
- Entries come out in sorted order of their worktree-relative paths (plain
  string order, as ``sorted()`` would give), produced lazily, so a caller that
  stops after N entries has the first N of the sorted listing without walking
  the rest of the tree.
- Symlinks are reported as entries and never followed, so a walk cannot leave
  the worktree or loop.
- Nothing under a ``.git`` directory is visited: it is git's metadata, large,
  and not the model's to read. (A ``.git`` directory itself still shows in a
  non-recursive listing.)
- A subdirectory that cannot be read (a permission the sandbox withholds) is
  skipped; the walk goes on.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Iterator

__all__ = ["GIT_DIR", "Entry", "in_git_dir", "matches", "regular_files", "walk"]

GIT_DIR = ".git"


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    rel: str  # worktree-relative, '/'-separated
    path: str  # absolute
    is_dir: bool  # a real directory (symlinks to directories are not)
    is_file: bool  # a regular file, not through a symlink


def in_git_dir(rel: str) -> bool:
    """Whether a worktree-relative path is, or is inside, a ``.git`` entry."""
    return GIT_DIR in rel.split("/")


def matches(pattern: str | None, rel: str) -> bool:
    """Glob test: against the base name, or the whole path when ``pattern`` has a '/'.

    ``fnmatchcase``: case-sensitive everywhere, and ``*`` crosses '/'.
    """
    if not pattern:
        return True
    target = rel if "/" in pattern else rel.rsplit("/", 1)[-1]
    return fnmatch.fnmatchcase(target, pattern)


def _sorted_entries(directory: str, rel: str) -> list[tuple[str, Entry]]:
    prefix = "" if rel == "." else rel + "/"
    out = []
    with os.scandir(directory) as it:
        for de in it:
            is_dir = de.is_dir(follow_symlinks=False)
            entry = Entry(prefix + de.name, de.path, is_dir, de.is_file(follow_symlinks=False))
            # Sorting a directory's entries by name, with '/' after directory
            # names, makes a depth-first walk come out in the order sorted()
            # would give the full paths ("a.txt" before "a/b").
            out.append((de.name + "/" if is_dir else de.name, entry))
    out.sort(key=lambda pair: pair[0])
    return out


def walk(root: str, top: str, *, recursive: bool) -> Iterator[Entry]:
    """The entries under ``top`` (an absolute directory inside ``root``).

    Recursive: every non-directory entry (files, symlinks, others) below
    ``top``. Not recursive: the entries of ``top`` itself, directories
    included. Errors reading ``top`` itself propagate; later ones are skipped.
    """
    stack: list[Iterator[tuple[str, Entry]]] = [iter(_sorted_entries(top, os.path.relpath(top, root)))]
    while stack:
        pair = next(stack[-1], None)
        if pair is None:
            stack.pop()
            continue
        entry = pair[1]
        if not entry.is_dir or not recursive:
            yield entry
        elif os.path.basename(entry.path) != GIT_DIR:
            try:
                stack.append(iter(_sorted_entries(entry.path, entry.rel)))
            except OSError:
                continue


def _sorted_files(directory: str, rel: str) -> list[tuple[str, str, str, bool]]:
    """``(sort key, rel, path, is_file)`` for the regular files and the
    directories (but ``.git``) in ``directory``, sorted as ``_sorted_entries``
    sorts them (names are unique, so the whole tuples sort by their keys)."""
    prefix = "" if rel == "." else rel + "/"
    out = []
    with os.scandir(directory) as it:
        for de in it:
            name = de.name
            if de.is_dir(follow_symlinks=False):
                if name != GIT_DIR:
                    out.append((name + "/", prefix + name, de.path, False))
            elif de.is_file(follow_symlinks=False):
                out.append((name, prefix + name, de.path, True))
    out.sort()
    return out


def regular_files(root: str, top: str) -> Iterator[tuple[str, str]]:
    """``(rel, path)`` of the regular files under ``top``, as ``walk(root,
    top, recursive=True)`` gives them (the same order, ``.git`` rule and
    errors) but without an ``Entry`` for every entry: what search_files
    reads, for about half the cost of the general walk."""
    stack = [iter(_sorted_files(top, os.path.relpath(top, root)))]
    while stack:
        for _, rel, path, is_file in stack[-1]:
            if is_file:
                yield rel, path
                continue
            try:
                stack.append(iter(_sorted_files(path, rel)))
            except OSError:  # a subdirectory we may not read: skipped
                continue
            break  # go down into it; this directory's iterator resumes after
        else:
            stack.pop()
