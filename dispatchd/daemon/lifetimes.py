"""Who holds a session, and ending the sessions nobody holds any more.

A session belongs to the daemon connections that opened it or attached to it.
Guarantees:
- when the last of them has gone (the client closed it, exited or was killed:
  the kernel closes its socket either way), a session that was not opened
  ``detached`` ends once its orphan grace has passed with no connection
  attaching again; the grace is the policy's ``limits.orphan_grace_s``, or
  less when the opener asked for less (one-off sessions of the CLI ask for 0);
- a ``detached`` session (``dispatch session open``) lives until it is
  closed, ends idle, or the daemon stops: nobody has to hold it;
- one thread does the waiting for every session; its work is a dictionary
  look-up per connection that goes and a wake-up per deadline.

``plan_orphan_deadline`` is pure; ``Holders`` keeps the table.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("dispatchd.lifetimes")


def plan_orphan_deadline(now: float, *, detached: bool, holders: int, grace_s: float) -> float | None:
    """When an unheld session ends (monotonic time), or None while it must live on."""
    if detached or holders > 0:
        return None
    return now + grace_s


def effective_grace(policy_grace_s: float, asked_s: float | None) -> float:
    """The opener may shorten the policy's grace, never lengthen it."""
    if asked_s is None:
        return policy_grace_s
    return max(0.0, min(policy_grace_s, asked_s))


class Holders:
    """Connections holding each session, and the deadlines of unheld ones.

    ``end(sid)`` is called (from this module's thread) for a session whose
    deadline passed; it must be safe to call for a session already gone.
    """

    def __init__(self, end: Callable[[str], None]) -> None:
        self._end = end
        self._lock = threading.Condition()
        self._holders: dict[str, set[int]] = {}  # session -> connection ids
        self._rules: dict[str, tuple[bool, float]] = {}  # session -> (detached, grace_s)
        self._deadlines: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    def track(self, sid: str, *, detached: bool, grace_s: float, holder: int | None) -> None:
        """A session just opened, held by ``holder`` (its opener's connection)."""
        with self._lock:
            self._rules[sid] = (detached, grace_s)
            self._holders[sid] = set() if holder is None else {holder}
            self._reschedule(sid)

    def hold(self, sid: str, holder: int) -> None:
        """A connection attached to the session: it lives while that one does."""
        with self._lock:
            if sid in self._rules:
                self._holders[sid].add(holder)
                self._reschedule(sid)

    def release(self, holder: int) -> None:
        """A connection has gone: every session it held may now be unheld."""
        with self._lock:
            for sid, holders in self._holders.items():
                if holder in holders:
                    holders.discard(holder)
                    self._reschedule(sid)

    def forget(self, sid: str) -> None:
        """The session ended (for whatever reason)."""
        with self._lock:
            self._holders.pop(sid, None)
            self._rules.pop(sid, None)
            self._deadlines.pop(sid, None)

    def describe(self, sid: str) -> dict[str, object]:
        with self._lock:
            detached, grace = self._rules.get(sid, (False, 0.0))
            holders = len(self._holders.get(sid, ()))
            deadline = self._deadlines.get(sid)
        return {"detached": detached, "orphan_grace_s": grace, "connections": holders,
                "ends_in_s": None if deadline is None else round(max(0.0, deadline - time.monotonic()), 1)}

    def _reschedule(self, sid: str) -> None:
        detached, grace = self._rules[sid]
        deadline = plan_orphan_deadline(time.monotonic(), detached=detached, holders=len(self._holders[sid]),
                                        grace_s=grace)
        if deadline is None:
            self._deadlines.pop(sid, None)
            return
        self._deadlines.setdefault(sid, deadline)  # a second release does not push it back
        if self._thread is None:
            thread = threading.Thread(target=self._run, daemon=True, name="orphans")
            try:
                thread.start()
                self._thread = thread  # only once started: a failed start is tried at the next change
            except RuntimeError as exc:  # can't start new thread: the deadline is kept, and met late
                log.warning("event=orphans_not_started error=%s", exc)
        self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [sid for sid, at in self._deadlines.items() if at <= now]
                for sid in due:
                    self._deadlines.pop(sid, None)
                if not due:
                    nxt = min(self._deadlines.values(), default=None)
                    self._lock.wait(None if nxt is None else max(0.0, nxt - now))
                    continue
            for sid in due:
                # The one thread of every deadline: an end that fails (a bug,
                # no thread to be had) is logged and tried again in a second,
                # never the end of this thread for every session.
                try:
                    self._end(sid)
                except Exception:  # noqa: BLE001
                    log.exception("event=orphan_end_failed session=%s", sid)
                    with self._lock:
                        if sid in self._rules:
                            self._deadlines.setdefault(sid, time.monotonic() + 1.0)
