"""One writer per worktree: the daemon's table of write locks, and which
worktrees are known to hold no temporary file of a cut write.

Guarantees:
- at most one session holds the lock of a worktree, and a worktree inside
  (or around) another counts as the same one (``inside.overlap``); with
  ``shared`` (``writers.py``, the daemon's), across every daemon on the
  state directory too: another daemon's holder is refused as ours are, and a
  grant that cannot be recorded there raises ``OSError`` (refused: fail
  closed);
- a session that holds it keeps it until it gives it back (``give_back``)
  or ends (``release``), and granting it again to its holder is a no-op;
- ``grant`` says whether the worktree was swept clean (``mark_swept``) with
  nothing able to write it since: true only when, since the last sweep of
  that very path, no session was granted it or any worktree overlapping it,
  and no session that gave a lock of an overlapping worktree back while its
  processes lived on (``give_back``) still lives, in this daemon or another
  on the state directory (``writers.py``: whose log of grants a mark must
  still reach back to). The marks are the daemon's memory only: a daemon
  that starts knows no worktree swept;
- thread-safe: the manager's watchers grant, its requests release.

The lock is cooperative (the tool server asks before a mutating call); what
holds a worktree against another session's processes is that only the
holder's tool server is told it may write.

Why "swept" is enough to skip the tool server's sweep at its grant
(``tempfiles.py``): only tool servers (``tools/atomic.py``) and the daemon's
checkpoint restores (under the session's write lock) name files so, and a
tool server writes only once granted; the daemon marks a worktree swept once
its holder's processes are gone and its sweep left nothing it would remove,
while the holder still holds it (nobody else may be granted it meanwhile).
From then on, anything that could write a new one is granted first, which
unmarks it. A file of that name made outside dispatchd between two sessions
is left to the next sweep that runs (a grant that finds no mark).
"""

from __future__ import annotations

import logging
import threading

from dispatchd.daemon.writers import Foreign, Mark, Writers
from dispatchd.inside import overlap

__all__ = ["Foreign", "WriteLocks"]

log = logging.getLogger("dispatchd.sessions")
_ALONE: Mark = ("", 0)  # a mark without a shared table: this daemon's memory is the whole truth


class WriteLocks:
    def __init__(self, shared: Writers | None = None) -> None:
        self.shared = shared
        self._holders: dict[str, str] = {}  # worktree -> the session that may write it
        # Worktrees with no temporary file left, and none granted since: where the grants log stood then.
        self._swept: dict[str, Mark] = {}
        self._loose: dict[str, set[str]] = {}  # session -> worktrees it gave back, its processes alive
        self._lock = threading.Lock()

    def acquire(self, session_id: str, worktree: str) -> str | Foreign | None:
        """Take the lock of ``worktree`` for ``session_id``: None when granted,
        else the id of the session that holds it (or one that overlaps it),
        or another daemon's session that does."""
        return self.grant(session_id, worktree)[0]

    def grant(self, session_id: str, worktree: str) -> tuple[str | Foreign | None, bool]:
        """``acquire``, and (when granted) whether ``worktree`` was swept
        clean with nothing able to write it since (see the module)."""
        with self._lock:
            for held, holder in self._holders.items():
                if holder != session_id and overlap(held, worktree):
                    return holder, False
            mark = self._swept.get(worktree)
            if self._holders.get(worktree) == session_id:
                stands = mark is not None  # its own again: recorded already
            elif self.shared is not None:
                foreign, stands = self.shared.grant(session_id, worktree, mark)
                if foreign is not None:
                    return foreign, False
            else:
                stands = mark is not None
            self._holders[worktree] = session_id
            if self._swept:
                # The holder may write from now on: no sweep of it, or of a
                # worktree around or inside it, vouches for it any more.
                self._swept = {w: m for w, m in self._swept.items() if not overlap(w, worktree)}
            return None, stands

    def mark_swept(self, session_id: str, worktree: str) -> bool:
        """Note that ``worktree`` holds no temporary file left by a cut write:
        its holder ``session_id`` (still holding it) has no process left, and
        a sweep of it just removed every one it found. Not noted (False)
        when the session does not hold it, or when a session that gave back
        an overlapping worktree's lock may still be writing."""
        with self._lock:
            if self._holders.get(worktree) != session_id:
                return False
            if any(overlap(w, worktree) for ws in self._loose.values() for w in ws):
                return False
            mark: Mark | None = _ALONE
            if self.shared is not None:
                try:
                    mark = None if self.shared.foreign_loose(worktree) else self.shared.mark()
                except OSError:
                    mark = None
            if mark is None:
                return False
            self._swept[worktree] = mark
            return True

    def give_back(self, session_id: str) -> None:
        """Give back every lock ``session_id`` holds while its processes live
        on (a call already running, a background job may still write): no
        sweep vouches for those worktrees until the session has ended."""
        with self._lock:
            held = {wt for wt, sid in self._holders.items() if sid == session_id}
            if held:
                self._loose.setdefault(session_id, set()).update(held)
            self._holders = {wt: sid for wt, sid in self._holders.items() if sid != session_id}
            if held and self.shared is not None:
                try:
                    self.shared.give_back(session_id)
                except OSError as exc:  # still held for the other daemons: safe, said
                    log.warning("event=write_lock_give_back_unrecorded session=%s error=%s", session_id, exc)

    def release(self, session_id: str) -> None:
        """Give back every lock ``session_id`` holds, its processes gone (a
        no-op when it holds none)."""
        with self._lock:
            self._loose.pop(session_id, None)
            self._holders = {wt: sid for wt, sid in self._holders.items() if sid != session_id}
            if self.shared is not None:
                self.shared.release(session_id)

    def holds(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._holders.values()
