"""The tool server's control channel to the daemon, and the write lock asked on it.

Guarantees:
- ``Control.send`` sends whole frames from any thread;
- ``WriteLock`` asks the daemon once for this session's claim on writing its
  worktree, keeps it once granted, and asks again after a refusal.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from dispatchd import protocol

__all__ = ["Control", "WriteLock"]


class Control:
    """The control channel to the daemon, written from several threads."""

    def __init__(self, frames: protocol.FrameSocket) -> None:
        self.frames = frames
        self.send_lock = threading.Lock()

    def send(self, msg: protocol.AcquireWriteLock | protocol.ToolCallsDone | protocol.OkReply | protocol.MaySleep
             ) -> None:
        with self.send_lock:
            self.frames.send(msg)


class WriteLock:
    """This session's claim on writing its worktree, asked of the daemon once.

    Only the daemon sees every session, so it decides; the answer is kept
    once granted (it lasts as long as the session). A refusal is asked again
    next time: the holder may have closed since.
    """

    def __init__(self, control: Control) -> None:
        self.control = control
        self.held = False
        self.on_granted: Callable[[], None] | None = None  # called once, when first granted
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list[object]]] = {}
        self._lock = threading.Lock()

    def acquire(self) -> str | None:
        """None once held; otherwise why not."""
        if self.held:
            return None
        rid = next(self._ids)
        done: tuple[threading.Event, list[object]] = (threading.Event(), [])
        with self._lock:
            self._waiting[rid] = done
        try:
            self.control.send(protocol.AcquireWriteLock(id=rid))
        except OSError:
            return "the daemon is gone"
        if not done[0].wait(30):
            return "the daemon did not answer the write-lock request"
        reply = done[1][0]
        if isinstance(reply, protocol.OkReply):
            self.held = True
            if self.on_granted is not None:
                self.on_granted()
            return None
        return getattr(reply, "message", "refused")

    def answer(self, reply: protocol.OkReply | protocol.ErrorReply) -> None:
        with self._lock:
            done = self._waiting.pop(reply.id, None)
        if done is not None:
            done[1].append(reply)
            done[0].set()
