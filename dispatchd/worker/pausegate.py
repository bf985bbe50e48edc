"""The tool server's gate for checkpoints and restores (worker side).

The daemon copies or rewrites the worktree only while no tool call runs
(daemon/checkpoints/). It sends ``Pause``; the control loop answers:
- writing calls that come from then on wait at the gate (none is refused)
  until ``Resume``; reads are not held (a read during a restore may see a
  file before or after it), so they pay nothing for the gate;
- if a call is in flight (one being dispatched, or one running on a thread
  of its own) and does not end within ``GRACE_S``, the gate opens again
  and the answer says what runs.

A writing call passes the gate in ``dispatch`` and counts until ``dispatch``
returns (its wait for the write lock included); a call that goes on on a thread of its own is counted by the
server's activity (``busy``) before ``dispatch`` returns, so nothing slips
between the two counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType


GRACE_S = 0.25  # how long a pause waits for calls that are finishing


class Gate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused = False
        self._passing = 0  # calls between ``__enter__`` and ``__exit__``

    def __enter__(self) -> None:
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._passing += 1

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        with self._cond:
            self._passing -= 1
            self._cond.notify_all()

    def pause(self, running: Callable[[], int], grace_s: float = GRACE_S) -> str:
        """Close the gate; "" when closed with nothing in flight, else what
        is in flight (and the gate opens again). ``running()``: calls
        running past the gate. Calls finishing within ``grace_s`` are
        waited for: a caller that has its reply may ask at once, while the
        call that answered it is still being counted out."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            self._paused = True
            while True:
                n = max(self._passing, running())
                left = deadline - time.monotonic()
                if not n or left <= 0:
                    break
                self._cond.wait(min(left, 0.005))  # the activity's count has no signal: looked at again
            if n:
                self._paused = False
                self._cond.notify_all()
                return f"{n} tool call{'s' if n > 1 else ''} in flight"
            return ""

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
