"""A session's worktree claimed from the user's other daemons, whatever their state directories.

Each daemon keeps its own trusted baseline of a worktree and its own keep of
the repository's objects (``gitguard/``): a second daemon's session on the
same worktree, one inside or around it, or another worktree of the same
repository would take a baseline of what the first one's sessions planted,
and its record of the repository's objects would remove from the keep what
they deleted, which the first daemon puts back at their end. So one daemon's
sessions at a time use a worktree and its repository:

Guarantees:
- ``claim`` records the session's worktree and repository (``inuse.py``: an
  entry flock'ed while the session lives, decided under the table's flock:
  two daemons' opens never both pass, on one state directory or two (the
  table is the user's: ``inusedir.py``); looked at on the open's path, made
  with the baseline's join, before it), or refuses the open with the other
  daemon's session named; ``release`` gives it back after the session's
  end, once its baseline's record is gone; a worktree whose check failed is
  claimed by itself (``unchecked-…``) for as long as this daemon refuses
  it: by every daemon, as by this one, until this one stops, or (a check
  beside live sessions of its domain that failed) until the domain's last
  end passes (``gitguard/taints.py``);
- when the entry of a dead daemon's session relates to this worktree, what
  that daemon left is finished before this session's baseline is taken, as a
  daemon's start does, in the state directory its entry names (a store of
  its own when that is not this daemon's): the restores it cut short (``finish_restores``), then
  the checks of its baselines' records that relate to this worktree
  (``Baselines.recover``: what its sessions planted is moved aside, the
  repository's history put back; every record when a dead entry cannot be
  read); one at a time in this daemon; the entry is forgotten only once they
  passed, and the open refused when they did not, or when another daemon is
  checking a related record still (its start, or its open);
  ``claim`` returns True then, and the caller inspects the worktree's git
  metadata again (the recovery may have moved some aside);
- what cannot be recorded refuses the open (fail closed).

Left: a session given back while processes of its may remain (its end could
not see them gone) is released as its write lock is.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

import msgspec

from dispatchd import flocks, statemodes
from dispatchd.daemon import checkpoints
from dispatchd.daemon import gitguard
from dispatchd.daemon.gitguard import Baselines, Protected, recordfiles
from dispatchd.daemon.gitguard.parts import common_of
from dispatchd.daemon.inuse import InUse, Use
from dispatchd.daemon.session import Session
from dispatchd.errors import WorktreeError
from dispatchd.fsnames import shown
from dispatchd.inside import overlap, worktrees_relate

log = logging.getLogger("dispatchd.sessions")
_RECOVERING = threading.Lock()  # a dead daemon's remains are finished by one open at a time


def claim(in_use: InUse | None, baselines: Baselines, session: Session, state_dir: str,
          said: list[Protected]) -> tuple[bool, Callable[[], None]]:
    """Before the session's baseline is taken (``Baselines.join``): whether a
    dead daemon's remains were finished here (inspect the git metadata again),
    and the claim's record, to run before the join. Its look is on the open's
    path; its record (a spare entry written, ``inuse.py``) beside the
    sandbox's start with the join, and it looks again: a claim made
    meanwhile by another daemon refuses the open then."""
    if in_use is None:
        return False, lambda: None
    root = session.worktree
    common = common_of(root, session.git)
    try:
        other, dead = in_use.look(root, common)
    except OSError as exc:
        raise _unrecorded(root, exc) from exc
    if other is not None:
        raise _refusal(root, other)
    if not dead:
        return False, functools.partial(_record, in_use, session.id, root, common)
    with _RECOVERING:
        _record(in_use, session.id, root, common, dead_ok=True)
        log.warning("event=dead_daemon_sessions_found session=%s entries=%s", session.id,
                    ",".join(name for name, _ in dead))
        def related(roots: list[str], commons: list[str]) -> bool:  # a record's parts: each root with each common
            return any(worktrees_relate(root, common, r, c) for r in roots for c in commons or [""])
        for state, names in _by_state(dead, state_dir).items():
            _finish(in_use, state, baselines, state == state_dir, related, names, root, said)
        in_use.forget_dead([name for name, _ in dead])
    return True, lambda: None


def _finish(in_use: InUse, state: str, baselines: Baselines, own: bool,
            related: Callable[[list[str], list[str]], bool], names: list[str], root: str,
            said: list[Protected]) -> None:
    """What the dead daemons on ``state`` left, finished as their start
    would: their restores cut short, then their baselines' records that
    relate (every record when one of their entries cannot be read: it may
    stand for any worktree); raises when the worktree is left refused.
    ``own``: ``state`` is this daemon's (``baselines``'); another's records
    are checked by a store of their own, what it did said with the restores."""
    if not own:
        _reach(state, root)
    said += [Protected(path=shown(path), why=shown(why), time=time.time())  # names as text (fsnames.py)
             for path, why in checkpoints.finish_restores(state, in_use, gitguard.unheld_roots(state))]
    store = baselines if own else Baselines(state, baselines.home)
    found = store.recover(related=None if in_use.unreadable & set(names) else related)
    if not own:
        said += found
    if _checked_elsewhere(store, related):
        raise WorktreeError(f"{root}: another dispatchd is checking what a dispatchd that died left here; "
                            "open it again in a moment; no session opened", root)
    why = tainted(store, root)
    if why:
        raise WorktreeError(f"{root}: a session of a dispatchd that died left files here that could not be moved "
                            f"aside ({why}); look at them (your own tools would run them), then "
                            f"{'restart dispatchd' if own else 'open it again (they are checked again)'}", root)


def _record(in_use: InUse, sid: str, root: str, common: str, dead_ok: bool = False) -> None:
    try:
        other, dead = in_use.claim(sid, root, common)
    except OSError as exc:
        raise _unrecorded(root, exc) from exc
    if other is not None:
        raise _refusal(root, other)
    if dead and not dead_ok:  # a related daemon died since the look: its remains are for the next open
        in_use.release(sid)
        raise WorktreeError(f"{root}: a dispatchd with a session here died as this one opened; open it again "
                            "(its remains are finished first); no session opened", root)


def _by_state(dead: list[tuple[str, Use]], state_dir: str) -> dict[str, list[str]]:
    """The names of the dead entries ``dead`` (as the look read them) by the
    state directory their daemon kept its baselines' records in: this
    daemon's own for one that names none (or cannot be read), and first."""
    found: dict[str, list[str]] = {state_dir: []}
    for name, use in dead:
        state = use.state or state_dir
        found.setdefault(state_dir if same_state(state, state_dir) else state, []).append(name)
    return {state: names for state, names in found.items() if names}


def same_state(state: str, mine: str) -> bool:
    """Whether an entry's state directory is ``mine`` (by real path: either may be spelled another way)."""
    return os.path.realpath(state) == os.path.realpath(mine)


def _unrecorded(root: str, exc: OSError) -> WorktreeError:
    return WorktreeError(f"{root}: its use could not be recorded for your other dispatchd daemons "
                         f"({exc.strerror or exc}); no session opened", root)


def _refusal(root: str, other: Use) -> WorktreeError:
    who = f"session {other.session} of another dispatchd (pid {other.pid})" if other.pid else \
        "a session of another dispatchd"
    return WorktreeError(f"{root}: {who} uses {other.worktree}, which overlaps it, "
                         "shares its repository or holds it; each dispatchd keeps its own baseline of a worktree, "
                         "so the sessions of one at a time use it: close that session, or open this one through "
                         "that dispatchd; no session opened", root)


def _checked_elsewhere(baselines: Baselines, related: Callable[[list[str], list[str]], bool]) -> bool:
    """Whether a related record is still there, its lock held by another
    daemon: one whose start (or open) is checking it now, which ``recover``
    left to it. This daemon's own domains' records are not that."""
    ours = set(baselines._domains)
    try:
        names = os.listdir(baselines.dir)
    except FileNotFoundError:
        return False
    for name in names:
        did = name[:-5]
        if not name.endswith(".json") or did in ours or not flocks.held(os.path.join(baselines.dir, f"{did}.lock")):
            continue
        try:
            record = recordfiles.read(os.path.join(baselines.dir, name))  # its mode set back, if changed
        except (OSError, msgspec.DecodeError):
            return True  # cannot tell: as if related
        if related([p.root for p in record.parts], [p.related_common for p in record.parts if p.common]):
            return True
    return False


def tainted(baselines: Baselines, root: str) -> str:
    """Why a check that failed left a worktree overlapping ``root`` refused ("" if none did)."""
    return next((why for r, why in list(baselines.tainted.items()) if overlap(r, root)), "")


def finished(dead: list[tuple[str, Use]], baselines: Baselines, state_dir: str) -> list[str]:
    """Of a start's dead entries, those whose remains its start finished:
    those of daemons on its state directory (``state_dir``; an entry that
    names none was made there) but those a failed check left refused, and
    those whose state directory is gone (nothing of theirs is left to check).
    Another state directory's are left to a related open, or to a start there."""
    return [name for name, use in dead
            if (not use.state or same_state(use.state, state_dir)) and not tainted(baselines, use.worktree)
            or use.state and _gone(use.state)]


def _gone(state: str) -> bool:
    """Whether a state directory is gone for good: not there, or no
    directory. One a session made unreadable (a chmod, in degraded mode) is
    not: its records are still to be checked."""
    try:
        return not stat.S_ISDIR(os.stat(state).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False


def _reach(state: str, root: str) -> None:
    """Another daemon's state directory made readable again if a session
    changed its mode (it is the user's, as this daemon's is: statemodes.py),
    or the open refused, saying which directory and why: its records must be
    checked before this worktree's baseline is taken."""
    try:
        # Itself and what its records need; the keep's directories heal as they are walked (keepdirs.py).
        statemodes.heal_tree(state, tuple(e for e in statemodes.STATE_LAYOUT if not e[0].startswith("keep")))
        os.listdir(state)
    except OSError as exc:
        raise WorktreeError(f"{root}: a dispatchd that died had sessions related to this worktree, and its state "
                            f"directory {state} cannot be read ({exc.strerror or exc}), so what they left cannot be "
                            f"checked; make it readable (chmod 700 {state}) and open again; no session opened",
                            root) from exc


def release(in_use: InUse | None, baselines: Baselines, session: Session,
            later: Callable[[Callable[[], None]], None]) -> None:
    """At the session's end, its processes gone: given back after its
    baseline's record is dropped (``later``, the same queue). A worktree a
    failed check left refused (here, overlapping the session's) is claimed
    once, by itself, for as long as it stays refused: one entry however many
    sessions end near it; given back (after the record's drop too) once a
    domain's last end lifted the refusal (``taints.py``)."""
    lifted = baselines.taints.take_lifted()  # taken even with no table: the list stays short
    if in_use is None:
        return
    for root in [r for r in list(baselines.tainted) if overlap(r, session.worktree)]:
        try:
            in_use.claim(_unchecked(root), root, "")  # once: a name it holds already is kept as it is
        except OSError as exc:
            log.warning("event=tainted_unrecorded worktree=%s error=%s", root, exc)
        log.warning("event=worktree_kept_in_use worktree=%s session=%s", root, session.id)
    for root in lifted:
        log.info("event=worktree_refusal_lifted worktree=%s session=%s", root, session.id)
        later(functools.partial(in_use.release, _unchecked(root)))
    later(lambda: in_use.release(session.id))


def _unchecked(root: str) -> str:
    """The table's name of the entry that keeps the refused worktree ``root`` from the other daemons."""
    return "unchecked-" + hashlib.sha256(os.fsencode(root)).hexdigest()[:12]


def then(record: Callable[[], None], join: Callable[[], None]) -> Callable[[], None]:
    """``record``, then ``join``: the open's baseline taken once its claim is recorded."""
    def both() -> None:
        record()
        join()
    return both
