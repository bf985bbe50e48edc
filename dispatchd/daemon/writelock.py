"""One writer per worktree: the daemon's table of write locks, and which
worktrees are known to hold no temporary file of a cut write.

Guarantees:
- at most one session holds the lock of a worktree, and a worktree inside
  (or around) another counts as the same one (``inside.overlap``);
- a session that holds it keeps it until it gives it back (``give_back``)
  or ends (``release``), and granting it again to its holder is a no-op;
- ``grant`` says whether the worktree was swept clean (``mark_swept``) with
  nothing able to write it since: true only when, since the last sweep of
  that very path, no session was granted it or any worktree overlapping it,
  and no session that gave a lock of an overlapping worktree back while its
  processes lived on (``give_back``) still lives. The table is the daemon's
  memory only: a daemon that starts knows no worktree swept;
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

import threading

from dispatchd.inside import overlap

__all__ = ["WriteLocks"]


class WriteLocks:
    def __init__(self) -> None:
        self._holders: dict[str, str] = {}  # worktree -> the session that may write it
        self._swept: set[str] = set()  # worktrees with no temporary file left, and none granted since
        self._loose: dict[str, set[str]] = {}  # session -> worktrees it gave back, its processes alive
        self._lock = threading.Lock()

    def acquire(self, session_id: str, worktree: str) -> str | None:
        """Take the lock of ``worktree`` for ``session_id``: None when granted,
        else the id of the session that holds it (or one that overlaps it)."""
        return self.grant(session_id, worktree)[0]

    def grant(self, session_id: str, worktree: str) -> tuple[str | None, bool]:
        """``acquire``, and (when granted) whether ``worktree`` was swept
        clean with nothing able to write it since (see the module)."""
        with self._lock:
            for held, holder in self._holders.items():
                if holder != session_id and overlap(held, worktree):
                    return holder, False
            self._holders[worktree] = session_id
            swept = worktree in self._swept
            if self._swept:
                # The holder may write from now on: no sweep of it, or of a
                # worktree around or inside it, vouches for it any more.
                self._swept = {w for w in self._swept if not overlap(w, worktree)}
            return None, swept

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
            self._swept.add(worktree)
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

    def release(self, session_id: str) -> None:
        """Give back every lock ``session_id`` holds, its processes gone (a
        no-op when it holds none)."""
        with self._lock:
            self._loose.pop(session_id, None)
            self._holders = {wt: sid for wt, sid in self._holders.items() if sid != session_id}

    def holds(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._holders.values()
