"""A session's worktree claimed from the other daemons on the state directory.

Each daemon keeps its own trusted baseline of a worktree and its own keep of
the repository's objects (``gitguard/``): a second daemon's session on the
same worktree, one inside or around it, or another worktree of the same
repository would take a baseline of what the first one's sessions planted,
and its record of the repository's objects would remove from the keep what
they deleted, which the first daemon puts back at their end. So one daemon's
sessions at a time use a worktree and its repository:

Guarantees:
- ``claim`` records the session's worktree and repository (``inuse.py``: an
  entry flock'ed while the session lives, released at its end with its
  write lock), or refuses the open with the other daemon's session named;
  decided under the table's flock: two daemons' opens never both pass;
- when the entry of a dead daemon's session relates to this worktree, what
  that daemon left is finished before this session's baseline is taken, as a
  daemon's start does: the restores it cut short (``finish_restores``), then
  its baselines' checks (``Baselines.recover``: what its sessions planted is
  moved aside, the repository's history put back); only then is the entry
  forgotten, and ``said`` gets what became of the restores (for ``status``);
- what cannot be recorded refuses the open (fail closed).
"""

from __future__ import annotations

import logging
import time

from dispatchd.daemon import checkpoints
from dispatchd.daemon.gitguard import Baselines, Protected
from dispatchd.daemon.gitguard.parts import common_of
from dispatchd.daemon.session import Session
from dispatchd.daemon.inuse import InUse
from dispatchd.errors import WorktreeError

log = logging.getLogger("dispatchd.sessions")


def claim(in_use: InUse | None, baselines: Baselines, session: Session, state_dir: str,
          said: list[Protected]) -> None:
    """Before the session's baseline is taken (``Baselines.join``)."""
    if in_use is None:
        return
    root = session.worktree
    try:
        other, dead = in_use.claim(session.id, root, common_of(root, session.git))
    except OSError as exc:
        raise WorktreeError(f"{root}: its use could not be recorded for the other daemons on this state directory "
                            f"({exc.strerror or exc}); no session opened", root) from exc
    if other is not None:
        who = f"session {other.session} of another dispatchd (pid {other.pid})" if other.pid else \
            "a session of another dispatchd"
        raise WorktreeError(f"{root}: {who} on this state directory uses {other.worktree}, which overlaps it or "
                            "shares its repository; each dispatchd keeps its own baseline of a worktree, so the "
                            "sessions of one at a time use it: close that session, or open this one through that "
                            "dispatchd; no session opened", root)
    if dead:
        log.warning("event=dead_daemon_sessions_found session=%s entries=%s", session.id, ",".join(dead))
        said += [Protected(path=path, why=why, time=time.time())
                 for path, why in checkpoints.finish_restores(state_dir, in_use)]
        baselines.recover()  # what they planted moved aside, before this session's baseline is taken
        in_use.forget_dead(dead)
