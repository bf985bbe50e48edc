"""The tool server's control channel to the daemon, and the write lock asked on it.

Guarantees:
- ``Control.send`` sends whole frames from any thread;
- ``Control.settle`` returns once every frame that was on the control channel
  when it was called (in the socket, in the frame buffer, half read, or read
  and not yet recorded) has been read by the control loop and, if it was a
  refusal (``NetworkDenied``), recorded: it returns at the first moment it
  finds the socket empty, nothing buffered and the loop not inside a frame
  (the loop marks itself inside from before it reads a frame until it has
  recorded it, so the three looked at in that order cannot all miss a frame
  on its way). With the channel idle that is one ``poll`` with no wait; it
  gives up after ``most_s`` (``SETTLE_MOST_S``) only if the loop is stuck,
  and at once once the loop has ended;
- ``WriteLock`` asks the daemon once for this session's claim on writing its
  worktree, keeps it once granted, and asks again after a refusal; its
  ``on_granted`` runs at the first grant, unless the daemon's grant says the
  worktree is known swept of temporary files (``WriteLockGranted.swept``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from dispatchd import protocol
from dispatchd.fdwait import readable

__all__ = ["SETTLE_MOST_S", "Control", "WriteLock"]

# How long ``Control.settle`` waits for the control loop at most: reached
# only when the loop is stuck (a loop that runs records a frame in
# microseconds; on a loaded machine its thread may wait tens of milliseconds to run).
SETTLE_MOST_S = 5.0

_Asked = tuple[threading.Event, list[object]]  # a request sent: its answer's event, and the answer


class Control:
    """The control channel to the daemon, written from several threads."""

    def __init__(self, frames: protocol.FrameSocket) -> None:
        self.frames = frames
        self.send_lock = threading.Lock()
        # The control loop's progress, for ``settle``: inside a frame (from
        # before its read to its record), and ended (it reads no more).
        self._progress = threading.Condition(threading.Lock())
        self._inside = False
        self._ended = False

    def reading(self) -> None:
        """The control loop is about to read a frame (from the buffer or the socket)."""
        with self._progress:
            self._inside = True

    def recorded(self) -> None:
        """The frame read since ``reading`` is recorded (or was none)."""
        with self._progress:
            self._inside = False
            self._progress.notify_all()

    def ended(self) -> None:
        """The control loop reads no more."""
        with self._progress:
            self._inside, self._ended = False, True
            self._progress.notify_all()

    def settle(self, most_s: float = SETTLE_MOST_S) -> bool:
        """Wait until the control loop has read and recorded every frame on
        the channel now (the module's guarantee); False if ``most_s`` passed first."""
        if self._drained():  # the usual case: an idle channel, no lock taken
            return True
        deadline = time.monotonic() + most_s
        with self._progress:
            # ``recorded`` notifies under this lock: no record slips between a look and the wait.
            while not self._drained():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(left)
        return True

    def _drained(self) -> bool:
        """The loop ended, or nothing unread in the socket, nothing buffered,
        the loop not inside a frame. In this order: a frame leaves the socket
        only while the loop is inside one, and leaves the buffer only the same
        way, so a frame on its way from one to the next is seen where it
        goes. A poll of its own each time: two calls may settle at once, and
        a poll object refuses a second thread."""
        if self._ended:
            return True
        try:
            unread = readable(self.frames.fileno(), 0)
        except ValueError:  # closed (descriptor -1): after the loop ended
            return True
        return not unread and not self.frames.buffered() and not self._inside

    def send(self, msg: protocol.AcquireWriteLock | protocol.ToolCallsDone | protocol.OkReply | protocol.MaySleep
             | protocol.Paused | protocol.WatchHeld | protocol.IpcHeld, fds: list[int] | None = None) -> None:
        with self.send_lock:
            self.frames.send(msg, fds=fds)


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
