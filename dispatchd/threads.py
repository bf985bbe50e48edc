"""A thread whose start does not wait for it to run; a component's one
long-lived thread, started at its first need.

``threading.Thread.start`` returns only once the new thread has run its
first line. On a busy machine that wait is the scheduler's, not ours: a new
thread queues behind whatever runs on the CPUs, and on this two-CPU machine
the open's watcher thread took 0.2-2.4 ms to start (median of 30 opens,
``bench/openprofile.py``), all of it on the open's path.

``Thread`` here is a ``threading.Thread`` (names, ``threading.excepthook``,
``threading.enumerate`` as usual) whose ``start`` returns as soon as the
kernel has made the thread. Guarantees: the target runs once, on its own
thread; a thread that cannot be made raises ``RuntimeError`` from ``start``,
as ``threading.Thread.start`` does; until it runs, ``is_alive()`` is False
and ``join`` refuses, so it is for threads nobody joins or asks about soon
after (a session's watcher, a channel's reader). Where this interpreter's
``threading`` lacks what it relies on, ``start`` is the ordinary one.

``Once`` is a component's one long-lived thread (the sleepers' watch, the
memory watchdog): ``start`` makes it at the first call and is a no-op after;
a start the kernel refuses (the daemon at the user's process limit) raises
and is tried again by the next call, never recorded as started.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

# threading's own start, less its wait: CPython 3.11 and 3.12's Thread.start
# (3.13 starts threads with a join handle of their own).
_OURS = sys.implementation.name == "cpython" and sys.version_info < (3, 13)
_LIMBO: dict[Any, Any] | None = getattr(threading, "_limbo", None) if _OURS else None
_START_NEW: Any = getattr(threading, "_start_new_thread", None)


class Thread(threading.Thread):
    def start(self) -> None:
        # Looked up at each start: a fork's child gets a new one (threading._after_fork).
        limbo_lock: Any = getattr(threading, "_active_limbo_lock", None)
        if _LIMBO is None or limbo_lock is None or _START_NEW is None or not hasattr(self, "_bootstrap"):
            super().start()
            return
        if self._started.is_set():  # type: ignore[attr-defined]
            raise RuntimeError("threads can only be started once")
        with limbo_lock:
            _LIMBO[self] = self
        try:
            _START_NEW(self._bootstrap, ())
        except Exception:
            with limbo_lock:
                del _LIMBO[self]
            raise


class Once:
    """See the module: ``thread`` is None until a start succeeded."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self._target, self._name = target, name
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """The thread running, started here if need be; ``RuntimeError``
        where the kernel refuses a new thread."""
        with self._lock:
            if self.thread is None:
                thread = threading.Thread(target=self._target, daemon=True, name=self._name)
                thread.start()
                self.thread = thread  # only once started: a failed start is tried again
