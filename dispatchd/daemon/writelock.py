"""One writer per worktree: the daemon's table of write locks.

Guarantees:
- at most one session holds the lock of a worktree, and a worktree inside
  (or around) another counts as the same one (``inside.overlap``);
- a session that holds it keeps it until it gives it back or ends
  (``release``), and granting it again to its holder is a no-op;
- thread-safe: the manager's watchers grant, its requests release.

The lock is cooperative (the tool server asks before a mutating call); what
holds a worktree against another session's processes is that only the
holder's tool server is told it may write.
"""

from __future__ import annotations

import threading

from dispatchd.inside import overlap


class WriteLocks:
    def __init__(self) -> None:
        self._holders: dict[str, str] = {}  # worktree -> the session that may write it
        self._lock = threading.Lock()

    def acquire(self, session_id: str, worktree: str) -> str | None:
        """Take the lock of ``worktree`` for ``session_id``: None when granted,
        else the id of the session that holds it (or one that overlaps it)."""
        with self._lock:
            for held, holder in self._holders.items():
                if holder != session_id and overlap(held, worktree):
                    return holder
            self._holders[worktree] = session_id
            return None

    def release(self, session_id: str) -> None:
        """Give back every lock ``session_id`` holds (a no-op when none)."""
        with self._lock:
            self._holders = {wt: sid for wt, sid in self._holders.items() if sid != session_id}

    def holds(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._holders.values()
