"""One call run on a thread of its own while the caller does another thing.

An open takes the worktree's trusted baseline (baselines.py: walks, the
record written and fsynced) and gives a sandbox its session (the worker's
own steps, in another process). Neither needs the other: the baseline is
of the user's files, which no process of the session can have touched
before the open's reply (the sandbox's tool server runs calls only, and the
first call comes over the channel that reply carries). So they run at
once, and the open waits for both before it answers.

Guarantees: ``Beside(fn)`` runs ``fn`` once on its own thread; ``wait``
returns once it has returned or raised, and ``result`` then re-raises what
it raised (``BaseException`` included) in the caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dispatchd import threads


class Beside:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.ms = 0.0  # how long ``fn`` took
        try:
            threads.Thread(target=self._run, daemon=True, name="beside").start()
        except RuntimeError:  # no thread to be had (the daemon at its process limit): here, then
            self._run()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self._error = exc
        finally:
            self.ms = (time.perf_counter() - started) * 1e3
            self._done.set()

    def wait(self) -> None:
        self._done.wait()

    def result(self) -> None:
        """Wait, then raise what ``fn`` raised, if anything."""
        self._done.wait()
        if self._error is not None:
            raise self._error
