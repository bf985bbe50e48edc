"""Refs a session made where the user's git takes them for the upstream's,
for notes or for a stash: taken out at the end.

A new branch or tag is a session's work, and stays. But a new
remote-tracking branch (``refs/remotes/origin/feature``) is what the user's
``git checkout feature`` makes a branch from, taking it for the remote's;
new notes (``refs/notes/commits``) show under the user's commits in ``git
log``; a new ``refs/stash`` is what ``git stash pop`` applies. Each such
ref the baseline did not have is taken out: its value kept as
``refs/dispatchd/displaced/TIME/NAME`` (nothing is lost), its loose file
removed, its ``packed-refs`` record taken out (kept in a file beside:
``replacerefs.drop_packed``). Changed ones the baseline had are put back by
``history.restore`` with the branches and tags.

Bounded: at most ``MAX_KEPT`` values are kept at one end (``to_keep``), as
``stashlog`` keeps at most as many stashes. A session's ``packed-refs`` of
100,000 new records cost the end as many fsynced refs of ours, left in the
user's repository for good (every ``git for-each-ref`` and ``git log --all``
walks them). Past the bound, one ref a distinct value is kept (the commits
they name stay reachable) to ``MAX_KEPT`` of them; every other ref is taken
out all the same, not kept, and counted in one line of the report. The
records go in one rewrite of ``packed-refs`` however many there are; a
loose ref is removed under its own lock, as git deletes one (nothing
written, nothing fsynced). Where there are at most ``MAX_KEPT``, each is
kept under its own name, as ever.
"""

from __future__ import annotations

import os

from dispatchd.daemon.gitguard import objectstore, reflock, refvalues, reftemp
from dispatchd.daemon.gitguard.replacerefs import drop_named, packed_names

TAKEN = ("refs/remotes/", "refs/notes/", "refs/stash")
MAX_KEPT = 1000  # values kept as refs at one end (stashlog's bound); past it, taken out and counted
_WHY = "made by a session where your git takes it for the upstream's, for notes or for a stash"


def clear(common: str, now: dict[str, str], baseline: dict[str, str], stamp: str,
          store: objectstore.Store | None = None, known: dict[str, str] | None = None
          ) -> tuple[list[tuple[str, str]], list[str]]:
    """Take out each ref of ``now`` under ``TAKEN`` that ``baseline`` has
    not; ``store``: the repository's objects (a value naming none is not
    kept); ``known``: the displaced refs, as ``reftemp.keep_displaced``
    takes them. One line of the report a ref whose value is kept (or names
    nothing), one for all those past the bound; a ref that cannot be taken
    out (its value not kept) is left, and said as failed."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    new = sorted(n for n in now if n.startswith(TAKEN) and n not in baseline)
    if not new:
        return done, failed
    keep = to_keep(new, now)
    unkept: list[str] = []
    left: set[str] = set()
    for name in new:
        try:
            value, kept = _take_out(common, name, now[name], stamp, store, known, name in keep)
        except OSError as exc:
            failed.append(f"{name}: {_WHY}, cannot be taken out ({exc.strerror})")
            left.add(name)  # its record stays too: its value was not kept
            continue
        if name not in keep:
            unkept.append(name)
        else:
            done.append((name, f"{_WHY}; taken out (its value kept as {kept})" if kept else
                         f"{_WHY}; taken out (its value {value[:60]} names no object here: not kept)"))
    problem = drop_named(common, set(new) - left, "refs a session made there")  # one rewrite for all of them
    if problem:  # those still packed were not taken out: said as failed, not as done
        failed.append(problem)
        still = set(packed_names(common).values())
        done = [(name, said) for name, said in done if name not in still]
        unkept = [name for name in unkept if name not in still]
    if unkept:
        done.append(_unkept_said(unkept, now, keep))
    return done, failed


def to_keep(new: list[str], values: dict[str, str]) -> set[str]:
    """Which of ``new`` (sorted names of ``values``) have their values kept:
    each of them where there are at most ``MAX_KEPT``; past that, the first
    by name of each distinct value that can be kept (an id, or a symbolic
    ref), to ``MAX_KEPT`` of them: 100,000 refs at one commit keep one ref."""
    if len(new) <= MAX_KEPT:
        return set(new)
    first: dict[str, str] = {}
    for name in new:  # sorted: the first name of each value comes first
        if refvalues.writable(values[name]):
            first.setdefault(values[name], name)
    return set(list(first.values())[:MAX_KEPT])


def _take_out(common: str, name: str, value: str, stamp: str, store: objectstore.Store | None,
              known: dict[str, str] | None, keep: bool) -> tuple[str, str]:
    """``name``'s loose file removed (a packed record is left for the
    caller's one rewrite), its value kept first where ``keep``: the value
    and the name it is kept under ("": not kept)."""
    path = os.path.join(common, name)
    if os.path.lexists(path) and not os.path.isdir(path):
        # Under git's lock, as git deletes a ref: the value kept is
        # the one the file holds then (a fetch of the user's may have
        # written it since the read), and no git writes it meanwhile.
        with reflock.held(common, name, move_left=False) as lock:
            read = refvalues.read_text(path)
            value = read.strip() if read is not None else value
            kept = _keep(common, stamp, name, value, store, known) if keep else ""
            lock.remove()
        return value, kept
    # Packed only: taken out by the caller, its value kept first.
    return value, _keep(common, stamp, name, value, store, known) if keep else ""


def _keep(common: str, stamp: str, name: str, value: str, store: objectstore.Store | None,
          known: dict[str, str] | None) -> str:
    """``value`` kept as a displaced ref (``reftemp.keep_displaced``) where
    it can be (an id, or a symbolic ref, kept as it was); the name, or ""."""
    return reftemp.keep_displaced(common, stamp, name, value, store, known) if refvalues.writable(value) else ""


def _unkept_said(unkept: list[str], now: dict[str, str], keep: set[str]) -> tuple[str, str]:
    """The report's one line for the refs taken out past the bound."""
    held = {now[name] for name in keep}
    same = sum(1 for name in unkept if now[name] in held)
    names = ", ".join(unkept[:3]) + (", ..." if len(unkept) > 3 else "")
    return (unkept[0], f"{_WHY}; {len(unkept)} such refs taken out without their values kept ({names}): past the "
                       f"{MAX_KEPT} an end keeps, one a value; {same} of them held a value kept under another name")
