"""What the checks of a baseline domain report (``Protected``), as the close's
reply and ``status`` carry it: every name readable and sendable, bounded,
and never cut without saying so.

A session chooses the names in these reports (a directory ``bad\\xff`` that
holds the ``.envrc`` it planted, a branch), and how many there are (one
``.envrc`` in each of 20,000 directories). Guarantees:

- ``readable``: each report's path and why as ``fsnames.shown`` gives them:
  every byte kept, and text any reply, status and log line can encode;
- ``bounded``: one check's reports, a worktree NOT checked whole first,
  always, and never cut (one a part at most, its text bounded:
  ``parts.failures_said``), so that no number of other reports a session
  makes can push the failure out of the close's reply and let ``dispatch
  exec`` exit 0; then those about the repository and git's own files (refs
  put back, history, configuration, hooks), then the files the user's tools
  run (``Protected.bulk``), each group in the order found; at most ``KEPT``
  of these. What does not fit becomes one more report, which says how many
  were left out, of which kinds, and that the daemon's log names each;
- ``Reports``: a domain's reports since it began, the last ``DOMAIN_KEPT``
  of them in memory. A position counts every report ever added, those let
  go included: ``since`` a session's position is exactly what came after
  it, led by a report of how many of those are no longer held.
"""

from __future__ import annotations

import errno
import time
from collections import Counter
from collections.abc import Callable

import msgspec

from dispatchd.daemon.gitguard.parts import NOT_WHOLE, Protected
from dispatchd.fsnames import shown

__all__ = ["DOMAIN_KEPT", "KEPT", "Reports", "bounded", "readable", "unrewritten"]

KEPT = 200  # of one check's reports, in its reply
DOMAIN_KEPT = 2 * KEPT  # of a domain's, for status: a whole check's, and the one before it
_KINDS_SAID = 3  # kinds of report named in the count of those left out


def readable(found: list[Protected]) -> list[Protected]:
    """``found`` with each path and why as ``fsnames.shown`` gives them."""
    return [p if p.path.isascii() and p.why.isascii() else
            msgspec.structs.replace(p, path=shown(p.path), why=shown(p.why)) for p in found]


def unrewritten(path: str, exc: OSError) -> Protected:
    """What a session's end that is not its domain's last says of the
    record at ``path`` it could not rewrite without the session (a full
    disk): the record on disk still names the session, which is on the safe
    side (a restart's check reads its parts, whatever sessions it names)."""
    code = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return Protected(path=path, time=time.time(), why=(
        f"the worktree's baseline record could not be rewritten without this session ({exc.strerror}, {code}): "
        "this end's check ran all the same (the rest of this list); the record still names the session, which "
        "changes no check, and the next end rewrites it"))


def bounded(found: list[Protected], where: str, now_t: float, kept: int = KEPT) -> list[Protected]:
    """At most ``kept`` of one check's reports, then one that counts the rest
    (see the module); ``where``: the worktree that report names."""
    failed = [p for p in found if p.why.startswith(NOT_WHOLE)]
    ordered = [p for p in found if not p.bulk and not p.why.startswith(NOT_WHOLE)] + [p for p in found if p.bulk]
    if len(ordered) <= kept:
        return failed + ordered
    left = ordered[kept:]
    kinds = Counter(p.why for p in left).most_common()
    said = "; ".join(f"{n} {why}" for why, n in kinds[:_KINDS_SAID]) + ("; ..." if len(kinds) > _KINDS_SAID else "")
    return failed + ordered[:kept] + [Protected(path=where, time=now_t, why=(
        f"and {len(left)} more moved aside or put back, not listed here ({said}): the daemon's log names each"))]


class Reports:
    """A domain's reports (see the module); changed and read under the
    baselines' lock."""

    def __init__(self, kept: int = DOMAIN_KEPT) -> None:
        self._items: list[Protected] = []
        self._first = 0  # the position of _items[0]: how many were let go before it
        self._kept = kept

    @property
    def end(self) -> int:
        """The position the next report added takes."""
        return self._first + len(self._items)

    def add(self, found: list[Protected]) -> None:
        self._items += found
        over = len(self._items) - self._kept
        if over > 0:
            del self._items[:over]
            self._first += over

    def since(self, position: int, where: str) -> list[Protected]:
        """The reports from ``position`` on; first, when some of those were
        let go, one that says how many (``where``: the worktree it names)."""
        items = self._items[max(0, position - self._first):]
        missed = self._first - position
        return ([_let_go(missed, items[0].time if items else time.time(), where)] if missed > 0 else []) + items

    def take(self, other: Reports, where: str) -> Callable[[int], int]:
        """``other``'s reports added after these (its domain merged into
        this one's), led by one that counts those it had let go, if any;
        returns what turns a position in ``other`` into one here (one
        before what ``other`` still held: that count's)."""
        start, first = self.end, other._first
        if first:
            self.add([_let_go(first, other._items[0].time if other._items else time.time(), where)])
        offset = self.end - first
        self.add(other._items)
        return lambda position: start if position < first else position + offset


def _let_go(count: int, when: float, where: str) -> Protected:
    return Protected(path=where, time=when, why=(
        f"and {count} earlier ones moved aside or put back, no longer listed here (the last {DOMAIN_KEPT} are): "
        "the daemon's log names each"))
