"""Is this path inside that one: the one lexical test, for every module.

Guarantees:
- ``is_within(path, top)``: ``path`` is ``top`` or below it; ``is_below``:
  strictly below it; ``overlap(a, b)``: one is within the other.
- A component is never matched in part: ``/a/bc`` is not within ``/a/b``.
- The root works: every absolute path is within ``/`` (its prefix is ``/``,
  not ``//``).
- ``worktrees_relate``: two worktrees overlap, share a repository's common
  directory, or one holds the other's.
- ``Tops(paths).holds_below(path)`` is ``any(is_below(path, t) for t in
  paths)``, in one lookup per component of ``path``.

Lexical only, on ``str``: nothing is normalised, resolved or looked up.
Callers pass paths already in the form they compare (resolved, normalised,
or as given) and keep that choice; a trailing ``/`` on ``path`` is not
removed (``/a/b/`` is below ``/a/b``, not equal to it).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Tops", "is_below", "is_within", "outermost", "overlap", "worktrees_relate"]


def is_within(path: str, top: str) -> bool:
    """``path`` is ``top`` or lies below it."""
    # rstrip keeps the root working: its prefix is "/", not "//".
    return path == top or path.startswith(top.rstrip("/") + "/")


def is_below(path: str, top: str) -> bool:
    """``path`` lies strictly below ``top`` (``/`` is not below itself)."""
    return path != top and is_within(path, top)


def outermost(paths: Iterable[str]) -> list[str]:
    """``paths`` (relative, "/"-separated), each once, less those within
    another of them; shallowest first, then by name. One set lookup per
    ``/`` of each path, where comparing each with every one kept grew as the
    square of their number (40,000 planted files: 150 s at a session's end)."""
    kept: list[str] = []
    seen: set[str] = set()
    for path in sorted(set(paths), key=lambda p: (p.count("/"), p)):
        i = path.find("/")
        while i >= 0 and path[:i] not in seen:
            i = path.find("/", i + 1)
        if i < 0 and path.rstrip("/") not in seen:
            kept.append(path)
            seen.add(path.rstrip("/"))
    return kept


def overlap(a: str, b: str) -> bool:
    """One of ``a`` and ``b`` is within the other."""
    return is_within(a, b) or is_within(b, a)


def worktrees_relate(root: str, common: str, other_root: str, other_common: str) -> bool:
    """Whether two worktrees (each with its repository's common git
    directory, or "") are one for the checks: they overlap, share a
    repository, or one's repository lies within the other (a linked
    worktree whose repository is inside another worktree: a session there
    can write the repository's files)."""
    return overlap(root, other_root) or bool(common and common == other_common) \
        or bool(common and overlap(common, other_root)) or bool(other_common and overlap(other_common, root))


class Tops:
    """Paths asked, again and again, whether a path lies strictly below one
    of them: ``holds_below(path)`` is ``any(is_below(path, t) for t in
    tops)``, one dictionary lookup per ``/`` in ``path`` instead of a
    comparison with every top (a session's plan asked it of each of its
    twenty-odd binds against the others: 0.1 ms of each open)."""

    def __init__(self, tops: Iterable[str]) -> None:
        # By the prefix is_within compares (the root's is "/", not "//").
        self._by_prefix: dict[str, set[str]] = {}
        for top in tops:
            self._by_prefix.setdefault(top.rstrip("/") + "/", set()).add(top)

    def holds_below(self, path: str) -> bool:
        i = path.find("/")
        while i >= 0:
            found = self._by_prefix.get(path[:i + 1])
            if found and (len(found) > 1 or path not in found):
                return True
            i = path.find("/", i + 1)
        return False
