"""One client channel of the tool server: its reader, its replies, its calls.

Guarantees:
- each channel is read by one thread at a time (``reader``); a call run on
  that thread (``Calls._call_here``) hands the reading over to a new one as
  soon as the channel has more to read;
- replies and streamed output go out whole, one at a time (``send_lock``),
  a secret's value replaced (``redact``); a reply too large for a frame is a
  failure saying so; broken framing ends this channel only; a call that
  fails outside its tool is answered with why, and the channel read on;
- the fast lane (``tools/_fastread.c``) answers the usual ``read_file`` in C;
  anything else it hands back is read here as if ``recv`` had read it;
- when the channel closes, the calls in flight on it are cancelled.
"""

from __future__ import annotations

import select
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol

from dispatchd import protocol
from dispatchd.tools.base import CallControl, ToolContext
from dispatchd.tools.textfile import SNIFF_BYTES
from dispatchd import redact
from dispatchd.worker.activity import Activity

__all__ = ["Channel"]

_monotonic = time.monotonic


class Server(Protocol):
    """What a channel uses of its tool server (``tool_server._Server``)."""

    @property
    def ctx(self) -> ToolContext: ...
    @property
    def activity(self) -> Activity: ...
    @property
    def redactor(self) -> redact.Redactor | None: ...
    @property
    def fast_read(self) -> Callable[..., float | bytes | tuple[list[float], bytes]] | None: ...
    @property
    def _records_due(self) -> Callable[[], None]: ...
    def dispatch(self, channel: Channel, req: protocol.CallTool) -> None: ...
    def channel_closed(self, channel: Channel) -> None: ...


class Channel:
    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.frames = protocol.FrameSocket(sock)
        self.send_lock = threading.Lock()
        self.server = server
        self.calls: dict[int, CallControl] = {}  # slow calls in flight, by request id
        self.calls_lock = threading.Lock()
        # The thread that reads this channel: the first to run it, until a
        # call run on it hands the reading over (Calls._call_here).
        self.reader: threading.Thread | None = None

    def output(self, rid: int, stream: str, text: str) -> None:
        """One ToolOutput frame; raises OSError when the client is gone."""
        with self.send_lock:
            self.frames.send(protocol.ToolOutput(id=rid, stream=stream, text=text))

    def cancel(self, rid: int) -> None:
        with self.calls_lock:
            control = self.calls.get(rid)
        if control is not None:
            control.cancel()

    def reply(self, msg: protocol.ToolReply | protocol.ErrorReply) -> None:
        redactor = self.server.redactor
        if redactor is not None and type(msg) is protocol.ToolReply:
            msg = protocol.ToolReply(id=msg.id, success=msg.success, output=redactor.value(msg.output),
                                     error=redactor.value(msg.error), metadata=redactor.value(msg.metadata))
        lock = self.send_lock
        lock.acquire()  # not ``with``: see Activity.begin
        try:
            self.frames.send(msg)
        except protocol.FrameTooLarge:
            self.frames.send(protocol.ToolReply(id=msg.id, success=False,
                                                error="the result is larger than the protocol's frame limit"))
        except OSError:
            pass  # the client went away; nothing to tell
        finally:
            lock.release()

    def refuse(self, code: str, message: str) -> None:
        """Answer a channel we will not serve, and close it."""
        self.reply(protocol.ErrorReply(id=0, code=code, message=message))
        self.frames.close()

    def run(self) -> None:
        me = threading.current_thread()
        if self.reader is None:
            self.reader = me
        recv, refuse = self.frames.recv_request, self.reply  # looked up once, not on every request
        decoder, dispatch = protocol.channel_request_decoder, self.server.dispatch
        activity = self.server.activity
        fast = self.server.fast_read
        if fast is not None:
            # The fast lane (tools/_fastread.c): each request read there, and
            # the usual read_file call answered there, whole; anything else is
            # handed back, the bytes that came, and read below as if recv had read them.
            server, frames, lock = self.server, self.frames, activity.lock
            lane = (self.frames.fileno(), server.ctx.root_fd, server.ctx.limits.file_size_cap_bytes, SNIFF_BYTES,
                    protocol.MAX_FRAME, self.send_lock.acquire, self.send_lock.release, server)
        with activity.lock:
            # A channel added while the server waits to sleep reads nothing
            # until it stays awake: handed over whole if it sleeps.
            quiet = activity.sleeping
            activity.quiet += quiet
        try:
            while self.reader is me:
                if quiet:
                    self._wait_to_read()
                    quiet = False
                try:
                    if fast is not None and not frames.buffered():
                        took = fast(*lane)
                        if isinstance(took, bytes):  # none answered: what came
                            if not took:
                                return  # the client closed the channel (between frames)
                            frames.feed(took)
                        else:
                            # Answered: one call (a float), or several sent at
                            # once and what came after them. Each call's
                            # record, as Calls._call makes it.
                            calls: Sequence[float]
                            calls, rest = ((took,), b"") if isinstance(took, float) else took
                            now = _monotonic()
                            lock.acquire()  # not ``with``: see Activity.begin
                            try:
                                activity.last = now
                                records = activity.records
                                first = not records
                                records.extend(("read_file", seconds, True, None) for seconds in calls)
                            finally:
                                lock.release()
                            if first:
                                server._records_due()
                            if not rest:
                                continue
                            frames.feed(rest)
                    # Anything but call_tool and cancel_call is refused there, a bad_request.
                    req = recv(decoder, refuse)
                except BlockingIOError:
                    # Nothing came for sleep_after_s (SO_RCVTIMEO, set when the
                    # session may sleep; a read inside a frame loses nothing
                    # and goes on). Between frames, wait without reading, so
                    # that the server may hand this channel over untouched.
                    if not self.frames.buffered():
                        with activity.lock:
                            activity.quiet += 1
                        quiet = True
                    continue
                except (protocol.ProtocolError, OSError):
                    return  # broken framing: drop this channel only
                if req is None:
                    return
                if isinstance(req, protocol.CancelCall):
                    self.cancel(req.id)
                    continue
                try:
                    dispatch(self, req)
                except Exception as exc:  # noqa: BLE001 (whatever it is, the call is answered)
                    # Failed outside its tool (a thread that could not start,
                    # a fault of ours): answered, and the channel read on.
                    # Uncaught, it ended this reader with the request taken
                    # and no reply: the client saw its channel closed, cause
                    # unknown, and nobody read its next calls.
                    traceback.print_exc()  # the daemon's log (the tool server's stderr)
                    refuse(protocol.ToolReply(id=req.id, success=False, error=(
                        f"{req.tool}: dispatchd could not serve this call: {type(exc).__name__}: {exc}")))
        finally:
            if quiet:  # only when _wait_to_read raised
                with activity.lock:
                    activity.quiet -= 1
            if self.reader is me:  # not handed over: the channel ends with this thread
                # Nobody is left to read what calls in flight would answer: end them.
                with self.calls_lock:
                    for control in self.calls.values():
                        control.cancel()
                self.server.channel_closed(self)
                self.frames.close()

    def _wait_to_read(self) -> None:
        """Until this channel has something to read and the server is not
        waiting to sleep; then this reader counts as reading again. Nothing
        is read here: a server that sleeps meanwhile hands over the channel
        with every byte still in it."""
        poller = select.poll()
        poller.register(self.frames.fileno(), select.POLLIN)
        poller.poll()  # readable, or hung up (the read then says which)
        activity = self.server.activity
        with activity.lock:
            while activity.sleeping:
                activity.awake.wait()
            activity.quiet -= 1
