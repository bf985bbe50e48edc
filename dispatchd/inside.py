"""Is this path inside that one: the one lexical test, for every module.

Guarantees:
- ``is_within(path, top)``: ``path`` is ``top`` or below it; ``is_below``:
  strictly below it; ``overlap(a, b)``: one is within the other.
- A component is never matched in part: ``/a/bc`` is not within ``/a/b``.
- The root works: every absolute path is within ``/`` (its prefix is ``/``,
  not ``//``).

Lexical only, on ``str``: nothing is normalised, resolved or looked up.
Callers pass paths already in the form they compare (resolved, normalised,
or as given) and keep that choice; a trailing ``/`` on ``path`` is not
removed (``/a/b/`` is below ``/a/b``, not equal to it).
"""

from __future__ import annotations

__all__ = ["is_below", "is_within", "overlap"]


def is_within(path: str, top: str) -> bool:
    """``path`` is ``top`` or lies below it."""
    # rstrip keeps the root working: its prefix is "/", not "//".
    return path == top or path.startswith(top.rstrip("/") + "/")


def is_below(path: str, top: str) -> bool:
    """``path`` lies strictly below ``top`` (``/`` is not below itself)."""
    return path != top and is_within(path, top)


def overlap(a: str, b: str) -> bool:
    """One of ``a`` and ``b`` is within the other."""
    return is_within(a, b) or is_within(b, a)
