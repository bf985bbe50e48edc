"""The tool server's control channel to the daemon, and the write lock asked on it.

Guarantees:
- ``Control.send`` sends whole frames from any thread;
- ``WriteLock`` asks the daemon once for this session's claim on writing its
  worktree, keeps it once granted, and asks again after a refusal; its
  ``on_granted`` runs at the first grant, unless the daemon's grant says the
  worktree is known swept of temporary files (``WriteLockGranted.swept``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from dispatchd import protocol

__all__ = ["Control", "WriteLock"]

_Asked = tuple[threading.Event, list[object]]  # a request sent: its answer's event, and the answer


class Control:
    """The control channel to the daemon, written from several threads."""

    def __init__(self, frames: protocol.FrameSocket) -> None:
        self.frames = frames
        self.send_lock = threading.Lock()

    def send(self, msg: protocol.AcquireWriteLock | protocol.ToolCallsDone | protocol.OkReply | protocol.MaySleep
             | protocol.Paused) -> None:
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
        self.checkpoint_each = False  # policy [checkpoints] before_writes: asked (and checkpointed) every time
        self.on_granted: Callable[[], None] | None = None  # called once, when first granted
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Asked] = {}
        self._lock = threading.Lock()

    def acquire(self, tool: str = "") -> str | None:
        """None once held; otherwise why not."""
        return self.wait(self.ask(tool))

    def ask(self, tool: str = "") -> _Asked | str | None:
        """Send the request, when one is needed, without waiting for its
        answer (the caller may do its own work meanwhile): give what this
        returns to ``wait``."""
        if self.held and not self.checkpoint_each:
            return None
        rid = next(self._ids)
        done: _Asked = (threading.Event(), [])
        with self._lock:
            self._waiting[rid] = done
        try:
            self.control.send(protocol.AcquireWriteLock(id=rid, checkpoint=self.checkpoint_each, tool=tool))
        except OSError:
            with self._lock:
                self._waiting.pop(rid, None)
            return "the daemon is gone"
        return done

    def wait(self, asked: _Asked | str | None) -> str | None:
        """The answer to ``ask``: None once held; otherwise why not."""
        if not isinstance(asked, tuple):
            return asked
        if not asked[0].wait(600 if self.checkpoint_each else 30):  # a first checkpoint may copy a big tree
            return "the daemon did not answer the write-lock request"
        reply = asked[1][0]
        if isinstance(reply, protocol.OkReply):
            first, self.held = not self.held, True
            # Swept: the daemon knows no temporary file is left (daemon/writelock.py).
            if first and self.on_granted is not None and not (
                    isinstance(reply, protocol.WriteLockGranted) and reply.swept):
                self.on_granted()
            return None
        return getattr(reply, "message", "refused")

    def answer(self, reply: protocol.OkReply | protocol.ErrorReply) -> None:
        with self._lock:
            done = self._waiting.pop(reply.id, None)
        if done is not None:
            done[1].append(reply)
            done[0].set()
