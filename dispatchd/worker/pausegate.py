"""The tool server's gate for checkpoints and restores (worker side).

The daemon copies or rewrites the worktree only while no tool call runs
(daemon/checkpoints.py). It sends ``Pause``; the control loop answers at
once, without waiting for anything:
- calls that come from then on wait at the gate (none is refused) until
  ``Resume``;
- if a call is in flight (one being dispatched, or one running on a thread
  of its own), the gate does not close and the answer says what runs.

A call passes the gate in ``dispatch`` and counts until ``dispatch``
returns; a call that goes on on a thread of its own is counted by the
server's activity (``busy``) before ``dispatch`` returns, so nothing slips
between the two counts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType


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

    def pause(self, running: Callable[[], int]) -> str:
        """Close the gate; "" when closed, else what is in flight (the gate
        stays open). ``running()``: calls running past the gate."""
        with self._cond:
            n = max(self._passing, running())
            if n:
                return f"{n} tool call{'s' if n > 1 else ''} in flight"
            self._paused = True
            return ""

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
