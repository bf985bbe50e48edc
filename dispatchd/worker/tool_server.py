"""The tool server (W2): runs a session's tool calls, already confined.

Guarantees:
- only the policy's tools exist; any other name is a failed ``ToolReply``;
- each client channel is served by its own thread, and slow tools (commands,
  searches) get a thread per call, so several calls can be in flight on one
  channel; a command (``Tool.watches_channel``) runs on the channel's thread
  instead, which it watches, and the reading moves to a new thread as soon as
  the channel has more to read; replies go out whole, one at a time, matched
  by request id;
- a malformed request gets an ``ErrorReply``; broken framing closes that one
  channel; the server and its other channels carry on;
- at most ``max_channels`` client channels at once (each is a thread, and
  threads count against the session's process limit): one more is answered
  with an ``ErrorReply`` (id 0, code ``too_many_channels``) and closed, and the
  server carries on, as it does when a thread cannot be started;
- when the daemon stops, calls still running at its deadline are answered
  (a failure saying the daemon's stop cut them) before the session ends;
- the session ends itself after the policy's idle timeout with no call in
  flight, and as soon as the daemon's control channel closes;
- a mutating tool (write_file, edit_file, create_file, shell_exec) runs only
  once the daemon has granted this session its worktree's write lock;
- a slow call can be cancelled (``CancelCall``, or its channel closing: a
  call whose caller is gone is ended, not left running) and, when asked
  (``CallTool.stream``), streams its output as ``ToolOutput`` frames before
  its reply; the session's background jobs live here (``tools/jobs.py``).
- ``SetCommandEnv`` from the daemon changes the environment of commands
  started after it (the proxy variables of network "domains", the caller's
  ``env`` and ``secrets``), not of those running; once a secret is given,
  every reply and streamed output has its value replaced by ``[secret NAME]``
  (``redact.py``; read_file's C lane is turned off, as it replies on its own).

Threads are safe here: Landlock and seccomp were applied before this process
was forked, and every thread inherits them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import queue
import resource
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from dispatchd import protocol, threads
from dispatchd.confine.plan import SessionPlan, can_sleep
from dispatchd.policy import MAX_CHANNELS, MUTATING_TOOLS, max_channels, too_many_channels

__all__ = ["MAX_CHANNELS", "max_channels", "serve", "warm_up"]
from dispatchd.protocol.internal import EXIT_ASLEEP, EXIT_IDLE
from dispatchd.tempfiles import sweep_temp_files
from dispatchd.tools import atomic, changes, files, native
from dispatchd.tools.base import CallControl, Outcome, Tool, ToolContext, failed, invalid, run_tool
from dispatchd.tools.jobs import Jobs
from dispatchd.tools.table import TOOLS
from dispatchd.tools.textfile import SNIFF_BYTES
from dispatchd.worker import pausegate, redact

RECORD_INTERVAL_S = 0.5  # how often finished calls are reported to the daemon's log
_convert = msgspec.convert
_monotonic = time.monotonic  # one global lookup where every call reads the clock twice

_thread_time = time.thread_time
# A finished call, for the daemon (its log line and the session's usage):
# tool, seconds, success, and metadata["usage"] (None: not measured).
_Record = tuple[str, float, bool, dict[str, Any] | None]


def _usage_numbers(usage: dict[str, Any] | None) -> tuple[float, float]:
    if not usage:
        return 0.0, 0.0
    cpu, peak = usage.get("cpu_s"), usage.get("peak_mib")
    return (float(cpu) if isinstance(cpu, (int, float)) else 0.0,
            float(peak) if isinstance(peak, (int, float)) else 0.0)


MAX_WATCHED_DIRS = 20_000  # a worktree with more directories is not watched (tools/changes.py)


def _with_changes(out: Outcome, watcher: changes.Watcher, mark: float) -> Outcome:
    """``out`` with ``metadata["changed"]``: the worktree paths changed since ``mark``."""
    paths, truncated, unknown = watcher.since(mark)
    out.metadata["changed"] = paths
    if truncated:
        out.metadata["changed_truncated"] = True
    if unknown:
        out.metadata["changed_unknown"] = True
    return out


_peak: list[float] = [0.0, -1.0]  # the tool server's peak (MiB), and when it was read
_PEAK_EVERY_S = 0.1  # read at most this often: a getrusage is ~1 µs of a fast call's ~20


def _usage(cpu_before: float) -> dict[str, float]:
    """A call's ``metadata["usage"]`` when the tool runs in the tool server
    (every tool but shell_exec's commands): the CPU time of the thread that
    ran it, and the tool server's peak resident size so far (a process has
    one peak, not one per call; read at most every ``_PEAK_EVERY_S``)."""
    cpu = round(_thread_time() - cpu_before, 6)
    now = _monotonic()
    if now - _peak[1] >= _PEAK_EVERY_S:
        _peak[0], _peak[1] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 2), now
    return {"cpu_s": cpu, "peak_mib": _peak[0]}


FIRST_CHANNEL_WAIT_S = 5.0  # how long the first channel's thread, started ahead, waits for it
MIN_SLEEP_AFTER_S = 0.05  # the least idle time after which a session sleeps (limits.sleep_after_s)


class _Activity:
    """What the tool server is doing, under one lock: the calls in flight (a
    count, and the calls a stop would cut, by channel and request id), when
    the last one ended, and the finished calls not yet reported to the
    daemon. A call takes the lock twice (``begin``, ``end``); it took it
    five times."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.last = time.monotonic()
        # The calls in flight, what a stop cuts: by id() of the request (alive
        # as long as its call: an int key, hashed for nothing, where a
        # (channel, request id) tuple cost about 500 instructions a call).
        self.calls: dict[int, tuple[_Channel, protocol.CallTool]] = {}
        # (tool, seconds, success, usage) of each finished call: made CallRecords when
        # sent (flush_records), off the calls' path.
        self.records: list[_Record] = []
        # A session that may sleep: the channel readers that found nothing to
        # read for ``sleep_after_s`` and now wait without reading (they hold
        # no byte of a request), and whether the server asked the daemon to
        # sleep (from then on no reader reads until it stays awake).
        self.quiet = 0
        self.sleeping = False
        self.awake = threading.Condition(self.lock)

    def begin(self, key: int, what: tuple[_Channel, protocol.CallTool]) -> None:
        # ``last`` is not read while a call is in flight (``idle_for``): the
        # call's end sets it. acquire/release, not ``with``: a lock's
        # __enter__ and __exit__ cost about 800 instructions more, and every
        # call passes here, in end, and in _Channel.reply.
        lock = self.lock
        lock.acquire()
        try:
            self.in_flight += 1
            self.calls[key] = what
        finally:
            lock.release()

    def end(self, key: int | None = None, record: _Record | None = None,
            now: float | None = None) -> bool:
        """The call is over (at ``now``, when the caller read the clock
        already); True when ``record`` is the first of a batch."""
        if now is None:
            now = time.monotonic()
        lock = self.lock
        lock.acquire()  # not ``with``: see begin
        try:
            self.in_flight -= 1
            self.last = now
            if key is not None:
                self.calls.pop(key, None)
            if record is None:
                return False
            self.records.append(record)
            return len(self.records) == 1
        finally:
            lock.release()

    def busy(self) -> bool:
        with self.lock:
            return self.in_flight > 0

    def idle_for(self) -> float:
        with self.lock:
            return 0.0 if self.in_flight else time.monotonic() - self.last


class _Channel:
    def __init__(self, sock: socket.socket, server: _Server) -> None:
        self.frames = protocol.FrameSocket(sock)
        self.send_lock = threading.Lock()
        self.server = server
        self.calls: dict[int, CallControl] = {}  # slow calls in flight, by request id
        self.calls_lock = threading.Lock()
        # The thread that reads this channel: the first to run it, until a
        # call run on it hands the reading over (Server._call_here).
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
        lock.acquire()  # not ``with``: see _Activity.begin
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
                            # record, as _call_fast's.
                            calls: Sequence[float]
                            calls, rest = ((took,), b"") if isinstance(took, float) else took
                            now = _monotonic()
                            lock.acquire()  # not ``with``: see _Activity.begin
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
                if type(req) is protocol.CancelCall:  # msgspec decodes to the exact type
                    self.cancel(req.id)
                    continue
                dispatch(self, req)
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


class _Control:
    """The control channel to the daemon, written from several threads."""

    def __init__(self, frames: protocol.FrameSocket) -> None:
        self.frames = frames
        self.send_lock = threading.Lock()

    def send(self, msg: protocol.AcquireWriteLock | protocol.ToolCallsDone | protocol.OkReply | protocol.MaySleep
             | protocol.Paused) -> None:
        with self.send_lock:
            self.frames.send(msg)


class _WriteLock:
    """This session's claim on writing its worktree, asked of the daemon once.

    Only the daemon sees every session, so it decides; the answer is kept
    once granted (it lasts as long as the session). A refusal is asked again
    next time: the holder may have closed since.
    """

    def __init__(self, control: _Control) -> None:
        self.control = control
        self.held = False
        self.checkpoint_each = False  # policy [checkpoints] before_writes: asked (and checkpointed) every time
        self.on_granted: Callable[[], None] | None = None  # called once, when first granted
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list[object]]] = {}
        self._lock = threading.Lock()

    def acquire(self, tool: str = "") -> str | None:
        """None once held; otherwise why not."""
        if self.held and not self.checkpoint_each:
            return None
        rid = next(self._ids)
        done: tuple[threading.Event, list[object]] = (threading.Event(), [])
        with self._lock:
            self._waiting[rid] = done
        try:
            self.control.send(protocol.AcquireWriteLock(id=rid, checkpoint=self.checkpoint_each, tool=tool))
        except OSError:
            return "the daemon is gone"
        if not done[0].wait(600 if self.checkpoint_each else 30):  # a first checkpoint may copy a big tree
            return "the daemon did not answer the write-lock request"
        reply = done[1][0]
        if isinstance(reply, protocol.OkReply):
            first, self.held = not self.held, True
            if first and self.on_granted is not None:
                self.on_granted()
            return None
        return getattr(reply, "message", "refused")

    def answer(self, reply: protocol.OkReply | protocol.ErrorReply) -> None:
        with self._lock:
            done = self._waiting.pop(reply.id, None)
        if done is not None:
            done[1].append(reply)
            done[0].set()


class _Server:
    def __init__(self, plan: SessionPlan, control: _Control) -> None:
        self.plan = plan
        self.ctx = ToolContext(root=plan.paths.worktree, limits=plan.limits, env=plan.env, writable=plan.writable,
                               scratch=plan.paths.scratch, jobs=Jobs(plan.paths.scratch),
                               root_fd=_open_root(plan.paths.worktree))
        self.tools = {name: TOOLS[name] for name in plan.tools}
        # read_file's usual call answered in C, from the request's bytes to
        # the reply's (tools/_fastread.c; docs/architecture.md): where the
        # C helper is built, read_file is this session's, and the worktree's
        # root is held by descriptor. None: every call takes dispatch.
        read = self.tools.get("read_file")
        self.fast_read = native.lines.serve_read if (
            native.lines is not None and read is not None and read.func is files.read_file
            and self.ctx.root_fd >= 0) else None
        self.activity = _Activity()
        self.control = control
        # The session's secrets (SetCommandEnv), redacted from every reply.
        self.secrets: dict[str, str] = {}
        self.redactor: redact.Redactor | None = None
        # The proxy's refusals (network "domains"), newest last: (when, "host:port", the command
        # that allows it). A slow call carries those of its own time window.
        self.denials: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=256)
        # What commands change in the worktree (tools/changes.py): made at the
        # first shell_exec (None: not yet; False: not watched, too large or refused).
        self.watcher: changes.Watcher | None | bool = None
        self.watcher_lock = threading.Lock()
        self.write_lock = _WriteLock(control)
        self.write_lock.checkpoint_each = plan.checkpoint_writes  # daemon/checkpoints.py
        self.gate = pausegate.Gate()
        # The worktree is ours to write now: remove what killed writes left
        # (tempfiles.py), but not the files of our own writes already started.
        self.write_lock.on_granted = lambda: threading.Thread(
            target=sweep_temp_files, args=(plan.paths.worktree, atomic.in_flight), daemon=True, name="sweep").start()
        self.draining = False
        # The first record of a batch wakes the control loop, which sends the
        # batch RECORD_INTERVAL_S later (housekeeping).
        self.records_wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.flush_at: float | None = None
        # Sleeping (worker/wake.py): after this long with no call, nor job,
        # nor process, nor reader holding a byte; 0: never.
        # At least MIN_SLEEP_AFTER_S: a smaller one (the policy takes any)
        # spun this loop (an idle check each sleep_after / 2), and a woken
        # server asked to sleep again before the daemon had handed it back
        # the channels that woke it, over and over (a socket timeout of less
        # than a microsecond would even be none).
        self.sleep_after = max(plan.limits.sleep_after_s, MIN_SLEEP_AFTER_S) if can_sleep(plan) else 0.0
        self.live: set[_Channel] = set()  # the channels a sleep hands over
        self.every = min(5.0, plan.limits.idle_timeout_s / 4, *((self.sleep_after / 2,) if self.sleep_after else ()))
        self.next_check = time.monotonic() + self.every
        self.channels = 0
        self.max_channels = max_channels(plan.limits.max_processes, plan.limits.max_open_files)
        # The thread that will read the first client channel, started before
        # it comes (expect_first_channel); None once given one or gone.
        self._first: queue.SimpleQueue[_Channel] | None = None
        self._first_lock = threading.Lock()

    def expect_first_channel(self) -> None:
        """Start the first channel's thread now, before the channel comes: the
        daemon attaches the opener right after the session is ready, and a
        thread started then took 0.5-2.5 ms to run (the scheduler's queue on
        a busy machine), all of it before the session's first call was read.
        It waits ``FIRST_CHANNEL_WAIT_S`` at most (a session opened without
        an attach has no spare thread after that)."""
        waiting: queue.SimpleQueue[_Channel] = queue.SimpleQueue()
        self._first = waiting
        try:
            threads.Thread(target=self._first_channel, args=(waiting,), daemon=True).start()
        except RuntimeError:  # can't start new thread: the channel gets its own when it comes
            self._first = None

    def _first_channel(self, waiting: queue.SimpleQueue[_Channel]) -> None:
        try:
            channel = waiting.get(timeout=FIRST_CHANNEL_WAIT_S)
        except queue.Empty:
            with self._first_lock:
                if self._first is waiting:
                    self._first = None
                    return
            channel = waiting.get()  # handed over as the wait ended
        channel.run()

    def add_channel(self, sock: socket.socket) -> None:
        channel = _Channel(sock, self)
        if self.sleep_after:
            # A read with nothing to read gives up after sleep_after_s: its
            # reader then waits without reading (_Channel._wait_to_read).
            # In the kernel, so a busy channel pays no extra system call.
            # At most 2**31 s (68 years: never, in practice), what a timeval
            # holds: a larger sleep_after_s passes the policy's check.
            whole, frac = divmod(min(self.sleep_after, 2.0**31), 1.0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(whole), int(frac * 1e6)))
        with self.activity.lock:
            full = self.channels >= self.max_channels
            if not full:
                self.channels += 1
                self.live.add(channel)
        if full:
            channel.refuse("too_many_channels", too_many_channels(self.max_channels))
            return
        with self._first_lock:
            waiting, self._first = self._first, None
        if waiting is not None:
            waiting.put(channel)  # its thread runs already
            return
        try:
            # Not waited for (threads.py): the control loop goes on meanwhile.
            threads.Thread(target=channel.run, daemon=True).start()
        except RuntimeError as exc:  # can't start new thread: the session's process limit
            self.channel_closed(channel)
            channel.refuse("busy", f"the session's tool server cannot start a thread for this channel ({exc})")

    def channel_closed(self, channel: _Channel) -> None:
        with self.activity.lock:
            self.channels -= 1
            self.live.discard(channel)

    def dispatch(self, channel: _Channel, req: protocol.CallTool) -> None:
        if req.tool in MUTATING_TOOLS:  # a checkpoint or restore holds writing calls here (worker/pausegate.py)
            with self.gate:
                self._dispatch(channel, req)
            return
        self._dispatch(channel, req)

    def _dispatch(self, channel: _Channel, req: protocol.CallTool) -> None:
        tool = self.tools.get(req.tool)
        if tool is None:
            known = ", ".join(self.tools)
            channel.reply(protocol.ToolReply(id=req.id, success=False,
                                             error=f"unknown tool: {req.tool!r} (this session has: {known})"))
            return
        if self.draining:
            channel.reply(protocol.ToolReply(id=req.id, success=False,
                                             error=f"{req.tool}: dispatchd is stopping and takes no new calls"))
            return
        if req.tool in MUTATING_TOOLS:
            refused = self.write_lock.acquire(req.tool)
            if refused is not None:
                channel.reply(protocol.ToolReply(id=req.id, success=False, error=f"{req.tool}: {refused}",
                                                 metadata={"write_locked": True}))
                return
        key = id(req)
        if not tool.spec.slow:
            self._call_fast(channel, req, tool, key)
            return
        self.activity.begin(key, (channel, req))
        rid = req.id
        emit: Callable[[str, str], None] | None = (
            (lambda stream, text: channel.output(rid, stream, text)) if req.stream else None)
        if emit is not None and self.redactor is not None:
            emit = redact.Stream(self.redactor, emit)
        control = CallControl(emit)
        with channel.calls_lock:
            channel.calls[rid] = control
        if tool.watches_channel and not channel.frames.buffered():
            self._call_here(channel, req, tool, key, control)
            return
        try:
            threading.Thread(target=self._call, args=(channel, req, tool, key, control), daemon=True).start()
        except RuntimeError as exc:
            # can't start new thread: the session's commands took every
            # process the limit allows but the server's reserve (proctree).
            with channel.calls_lock:
                channel.calls.pop(rid, None)
            self.activity.end(key)
            channel.reply(protocol.ToolReply(id=rid, success=False, error=(
                f"{req.tool}: the tool server cannot start a thread ({exc}): the session is at its process "
                "limit (its commands hold every process it may have); stop some and retry")))

    def _call_fast(self, channel: _Channel, req: protocol.CallTool, tool: Tool, key: int) -> None:
        """A fast call (not ``slow``), on the channel's reader: ``_call`` with
        ``activity.begin`` and ``end`` and ``run_tool`` written out (their
        calls cost about 2,000 + 900 instructions of the 64,000 a read_file
        takes in the tool server). Keep it in step with those."""
        activity = self.activity
        lock = activity.lock
        lock.acquire()
        try:
            activity.in_flight += 1
            activity.calls[key] = (channel, req)
        finally:
            lock.release()
        started = _monotonic()
        cpu = _thread_time()
        success = False
        usage = None
        try:
            # run_tool written out too (a call fewer, about 900 instructions).
            try:
                typed = _convert(req.params, tool.spec.params_type)
            except msgspec.ValidationError as exc:
                out = invalid(tool, exc)
            else:
                try:
                    out = tool.func(self.ctx, typed)
                except Exception as exc:  # noqa: BLE001 (failed words each kind)
                    out = failed(tool, self.ctx, exc)
            success = out.success
            usage = out.metadata["usage"] = _usage(cpu)
            channel.reply(protocol.ToolReply(req.id, success, out.output, out.error, out.metadata))
        finally:
            now = _monotonic()
            lock.acquire()
            try:
                activity.in_flight -= 1
                activity.last = now
                del activity.calls[key]
                records = activity.records
                records.append((req.tool, now - started, success, usage))
                first = len(records) == 1
            finally:
                lock.release()
            if first:
                self._records_due()

    def _call_here(self, channel: _Channel, req: protocol.CallTool, tool: Tool, key: int,
                   control: CallControl) -> None:
        """A slow call on the thread that reads its channel, which it watches
        (``Tool.watches_channel``): a thread per call cost about 0.1 ms of a
        ``shell_exec true``, and most calls end before their channel has
        anything more to read. When it has (a cancel of this call, the next
        call, its close), the tool calls ``release_channel`` and a new thread
        reads on; this one ends with the call. A thread that cannot be started
        (the session at its process limit) leaves the channel to be read
        after this call, as a fast call would."""

        def release() -> None:
            me = threading.current_thread()
            if channel.reader is not me:
                return
            thread = threading.Thread(target=channel.run, daemon=True)
            channel.reader = thread  # before it runs: it must find itself the reader
            try:
                thread.start()
            except RuntimeError:  # can't start new thread
                channel.reader = me

        control.channel_fd = channel.frames.fileno()
        control.release_channel = release
        self._call(channel, req, tool, key, control)

    def _call(self, channel: _Channel, req: protocol.CallTool, tool: object, key: int,
              control: CallControl | None = None) -> None:
        """Run the call ``dispatch`` began (``key`` in ``activity``), reply, end it."""
        started = time.monotonic()
        cpu = _thread_time()
        success = False
        usage = None
        ctx = self.ctx if control is None else dataclasses.replace(self.ctx, call=control)
        watcher = self._watcher() if req.tool == "shell_exec" and ctx.writable else None
        if watcher is not None:
            watcher.drain()  # what came before this call is not its own
            mark = time.monotonic()
        try:
            out: Outcome = run_tool(tool, ctx, req.params)  # type: ignore[arg-type]
            if watcher is not None:
                out = _with_changes(out, watcher, mark)
            if "HTTP_PROXY" in ctx.env or self.denials:  # network "domains" now, or before a switch
                out = self._with_denials(out, started)
            success = out.success
            if "usage" not in out.metadata:  # shell_exec's is its command's own
                out.metadata["usage"] = _usage(cpu)
            usage = out.metadata["usage"]
            if control is not None and isinstance(control.emit, redact.Stream):
                try:
                    control.emit.flush()  # what waited to be told from a secret's start
                except OSError:
                    pass  # the caller is gone
            channel.reply(protocol.ToolReply(id=req.id, success=out.success, output=out.output,
                                             error=out.error, metadata=out.metadata))
        finally:
            if control is not None:
                with channel.calls_lock:
                    channel.calls.pop(req.id, None)
                control.close()
            now = time.monotonic()
            if self.activity.end(key, (req.tool, now - started, success, usage), now):
                self._records_due()

    def _watcher(self) -> changes.Watcher | None:
        """The worktree's watcher, made at the first call that needs it."""
        watcher = self.watcher
        if watcher is None:
            with self.watcher_lock:
                if self.watcher is None:
                    # Half the session's inotify watches at most: its commands' own watchers need some.
                    most = max(1, min(MAX_WATCHED_DIRS, self.plan.limits.max_inotify_watches // 2))
                    try:
                        self.watcher = changes.Watcher(self.ctx.root, most)
                    except (OSError, changes.TooLarge):
                        self.watcher = False
                watcher = self.watcher
        return watcher if isinstance(watcher, changes.Watcher) else None

    def note_denied(self, msg: protocol.NetworkDenied) -> None:
        self.denials.append((time.monotonic(), f"{msg.host}:{msg.port}", msg.allow))

    def _with_denials(self, out: Outcome, started: float) -> Outcome:
        """``out`` with the proxy's refusals since ``started``: their list in
        ``metadata["network_denied"]``, and one line at the end of the text
        naming them and the command that allows them. By time window: a
        refusal during two calls of the session at once goes to both."""
        self._settle_control()
        seen: dict[str, str] = {}
        for when, where, allow in list(self.denials):
            if when >= started:
                seen.pop(where, None)
                seen[where] = allow  # the last command named allows every host refused before it
        if not seen:
            return out
        hosts = list(seen)
        allow = next(reversed(seen.values()))
        line = (f"[network: dispatchd refused {', '.join(hosts)} (not in this session's domains); "
                f"to allow: {allow}]")
        meta = {**out.metadata, "network_denied": hosts}
        if out.success:
            text = out.output or ""
            return Outcome(True, f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{line}", None, meta)
        text = out.error or ""
        return Outcome(False, None, f"{text}{'' if not text or text.endswith(chr(10)) else chr(10)}{line}", meta)

    def _settle_control(self, most_s: float = 0.1) -> None:
        """Let the control loop read what the daemon sent already: a refusal
        is sent before the refused process hears of it, so before its call
        can end, but the loop may not have read it yet."""
        frames = self.control.frames
        poller = select.poll()
        poller.register(frames.fileno(), select.POLLIN)
        deadline = time.monotonic() + most_s
        while (frames.buffered() or poller.poll(0)) and time.monotonic() < deadline:
            time.sleep(0.002)

    def _records_due(self) -> None:
        """The first record of a batch: wake the control loop, which sends
        the batch RECORD_INTERVAL_S later (housekeeping)."""
        try:
            os.eventfd_write(self.records_wake, 1)
        except BlockingIOError:
            pass  # the counter is full: the loop is woken already

    def set_command_env(self, msg: protocol.SetCommandEnv) -> None:
        env = {k: v for k, v in self.ctx.env.items() if k not in msg.unset}
        env.update(msg.set)
        fresh = {name: msg.set[name] for name in msg.secrets if name in msg.set}
        if fresh:
            # Before the commands can see them: no reply carries one unredacted.
            # Kept once given, even when unset (a file may still hold one).
            self.secrets.update(fresh)
            self.redactor = redact.Redactor(self.secrets)
            self.fast_read = None  # read_file's C lane replies without _Channel.reply: off
        # One assignment: a call starting now sees the old context or the new, whole.
        self.ctx = dataclasses.replace(self.ctx, env=env)

    def flush_records(self) -> None:
        """Send the daemon what finished since the last time (for its log)."""
        activity = self.activity
        with activity.lock:
            records, activity.records = activity.records, []
        if not records:
            return
        try:
            self.control.send(protocol.ToolCallsDone(
                calls=[protocol.CallRecord(tool, round(seconds * 1e3, 3), ok, *_usage_numbers(usage))
                       for tool, seconds, ok, usage in records]))
        except OSError:
            pass  # the daemon is gone; the session is ending anyway

    def housekeeping_wait(self) -> float:
        """Seconds until ``housekeeping`` has something to do."""
        due = self.next_check if self.flush_at is None else min(self.next_check, self.flush_at)
        return max(0.0, due - time.monotonic())

    def housekeeping(self, woken: bool) -> None:
        """Run by the control loop between messages (a thread of its own
        would cost every idle session a task and its stacks). Finished calls
        reach the daemon's log in batches, at most ``RECORD_INTERVAL_S``
        after the first of a batch ended (a message per call would wake the
        daemon between a reply and the next request); the idle timeout ends
        the session. An idle session sleeps from one idle check to the next
        (a quarter of the timeout, at most 5 s): a thousand idle sessions
        cost the host no wake-ups in between."""
        if woken:
            try:
                os.eventfd_read(self.records_wake)
            except BlockingIOError:
                pass
            if self.flush_at is None:
                self.flush_at = time.monotonic() + RECORD_INTERVAL_S  # let the batch grow
        now = time.monotonic()
        if self.flush_at is not None and now >= self.flush_at:
            self.flush_at = None
            self.flush_records()
        if now >= self.next_check:
            if self.activity.idle_for() >= self.plan.limits.idle_timeout_s and not self._lane_busy():
                self.flush_records()
                os._exit(EXIT_IDLE)  # the session ends with us (its pid 1, or its init sees us go)
            if self.sleep_after and self._may_sleep():
                try:
                    self.control.send(protocol.MaySleep())
                except OSError:
                    pass  # the daemon is gone: the control loop ends
            self.next_check = now + self.every

    def _lane_busy(self) -> bool:
        """Whether the fast lane is answering a call now (its calls are not
        in ``activity``: they never pass through Python until recorded)."""
        return self.fast_read is not None and native.lines is not None and native.lines.lane_calls() > 0

    def _may_sleep(self) -> bool:
        """Whether the session may sleep now; if so, no reader reads from
        here on (``sleeping``) until the daemon answers. Only when nothing
        would be lost: no call in flight, no job running (ended ones are
        handed over with the channels), no process but this one in the
        session, and every channel's reader waiting between frames."""
        if self.draining or self.activity.sleeping or self.activity.idle_for() < self.sleep_after:
            return False  # the cheap checks first: a busy session pays no more
        if (self.ctx.jobs is not None and self.ctx.jobs.running()) or _others_alive():
            return False
        activity = self.activity
        with activity.lock:
            live = [channel.frames.fileno() for channel in self.live]
        # Not while the daemon has sent something unread (a channel attached),
        # nor while a channel has a request its quiet reader has yet to wake
        # for: handed over, it would only wake the session again at once.
        if self.control.frames.buffered() or _readable([self.control.frames.fileno(), *live]):
            return False
        with activity.lock:
            if activity.in_flight or activity.quiet != self.channels or \
                    time.monotonic() - activity.last < self.sleep_after:
                return False
            activity.sleeping = True
        return True

    def stay_awake(self, for_good: bool = False) -> None:
        if for_good:
            self.sleep_after = 0.0  # on this control thread, which alone reads it
        with self.activity.lock:
            self.activity.sleeping = False
            self.activity.awake.notify_all()

    def hand_over(self) -> None:
        """``Sleep``: the ended jobs (``KeptJobs``, their logs by descriptor),
        then every channel to the daemon, untouched (no reader holds a byte
        of one), at most 253 descriptors a message; then exit."""
        self.flush_records()
        with self.activity.lock:
            fds = [channel.frames.fileno() for channel in self.live]
        chunks = [fds[i:i + 253] for i in range(0, len(fds), 253)] or [[]]
        try:
            if self.ctx.jobs is not None:
                records, logs, next_number = self.ctx.jobs.kept()
                if records:  # at most jobs.MAX_KEPT: one message
                    with self.control.send_lock:
                        self.control.frames.send(protocol.KeptJobs(jobs=records, next=next_number), fds=logs)
            for i, chunk in enumerate(chunks):
                with self.control.send_lock:
                    self.control.frames.send(protocol.Asleep(count=len(chunk), last=i == len(chunks) - 1), fds=chunk)
        except OSError:
            pass  # the daemon is gone: so is the session
        os._exit(EXIT_ASLEEP)

    def drain(self, deadline_s: float) -> None:
        """Refuse new calls, wait for those in flight (up to the deadline), end."""
        self.draining = True
        deadline = time.monotonic() + deadline_s
        # The fast lane's calls too: each looked at ``draining`` after it
        # counted itself (tools/_fastread.c), so none begun is missed here.
        while (self.activity.busy() or self._lane_busy()) and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.activity.lock:
            cut = list(self.activity.calls.items())
        for _, (channel, req) in cut:
            channel.reply(protocol.ToolReply(id=req.id, success=False, metadata={"cut_by_stop": True}, error=(
                f"{req.tool}: cut: dispatchd was stopped and its stop deadline ({deadline_s:g} s) passed "
                "with this call still running; its processes are ended")))
        self.flush_records()
        os._exit(0)


def _open_root(worktree: str) -> int:
    """The worktree's root as an O_PATH descriptor, held for the session's
    life (close-on-exec: no command inherits it): read_file opens below it
    (ToolContext.root_fd). -1 when it cannot be opened: every call then takes
    the path rules' walk, which says what is wrong."""
    try:
        return os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


def _readable(fds: list[int]) -> bool:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _others_alive() -> bool:
    """Whether any process but this one lives in the session's pid namespace
    (its /proc): an orphan a command left running keeps the session awake."""
    me = str(os.getpid())
    try:
        return any(name.isdigit() and name != me for name in os.listdir("/proc"))
    except OSError:
        return True  # cannot tell: stay awake


def warm_up(plan: SessionPlan) -> None:
    """Run a session's usual first call once, on the sandbox's own files
    (``read_file`` of the root's ``/etc/hostname``), the whole way a channel
    serves it: a request framed on a socket pair, read by a channel, run by a
    server of its own, the reply framed back and read. A sandbox made ahead
    does it while it waits, so that the pages and caches its session's first
    call touches are ready (copied from the fork server, Python's code warmed
    up: the session's first call took about twice its second, 0.5 against
    0.25 ms). On this thread, with nothing of it kept: the server, its
    channel, the pair, the server's eventfd and the root descriptors (the
    session's its ``_Server`` opened, and /etc's) are closed before it returns.
    Reads one small system file; any failure is ignored."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client = protocol.FrameSocket(ours)
    server: _Server | None = None
    etc = -1
    try:
        server = _Server(plan, _Control(protocol.FrameSocket(theirs)))
        if server.ctx.root_fd >= 0:  # the session's root, opened by the server: not this warm-up's
            os.close(server.ctx.root_fd)
        # /etc by descriptor, as a session's root: the call takes the fast
        # lane where the C helper is built, as the session's first will.
        etc = _open_root("/etc")
        server.ctx = ToolContext(root="/etc", limits=plan.limits, env={}, writable=False, root_fd=etc)
        server.tools = {"read_file": TOOLS["read_file"]}
        server.fast_read = native.lines.serve_read if native.lines is not None and etc >= 0 else None
        channel = _Channel(theirs, server)
        client.send(protocol.CallTool(id=1, tool="read_file", params={"path": "hostname"}))
        ours.shutdown(socket.SHUT_WR)  # one request: the channel ends after it
        channel.run()
        client.recv(protocol.channel_reply_decoder)
    except Exception:  # noqa: BLE001 (a warm-up: nothing depends on it)
        pass
    finally:
        client.close()
        theirs.close()
        if server is not None:
            os.close(server.records_wake)
        if etc >= 0:
            os.close(etc)


def serve(control: protocol.FrameSocket, plan: SessionPlan) -> None:
    """Serve until the daemon closes the control channel."""
    server = _Server(plan, _Control(control))
    server.expect_first_channel()
    poller = select.poll()
    poller.register(control.fileno(), select.POLLIN)
    poller.register(server.records_wake, select.POLLIN)
    while True:
        # A frame already buffered is read at once; otherwise wait for the
        # daemon, a batch of call records, or the next idle check.
        buffered = control.buffered()
        ready = {fd for fd, _ in poller.poll(0 if buffered else server.housekeeping_wait() * 1000)}
        server.housekeeping(server.records_wake in ready)
        if not buffered and control.fileno() not in ready:
            continue
        try:
            msg = control.recv(protocol.to_worker_decoder)
        except (protocol.ProtocolError, OSError):
            return
        if msg is None:
            return  # the daemon closed the session or went away
        if isinstance(msg, protocol.AddChannel):
            try:
                fd = control.take_fd()
            except protocol.ProtocolError:
                continue
            server.add_channel(socket.socket(fileno=fd))
        elif isinstance(msg, (protocol.OkReply, protocol.ErrorReply)):
            server.write_lock.answer(msg)
        elif isinstance(msg, protocol.NetworkDenied):
            server.note_denied(msg)
        elif isinstance(msg, protocol.ForgetWriteLock):
            server.write_lock.held = False  # the next mutating call asks the daemon again
        elif isinstance(msg, protocol.SetCommandEnv):
            server.set_command_env(msg)
            if msg.id:
                try:
                    server.control.send(protocol.OkReply(id=msg.id))
                except OSError:
                    return
        elif isinstance(msg, protocol.Sleep):
            server.hand_over()
        elif isinstance(msg, protocol.KeptJobs):  # a woken session's, before its channels
            logs = [control.take_fd() for _ in msg.jobs]
            if server.ctx.jobs is not None:
                server.ctx.jobs.restore(msg.jobs, logs, msg.next)
        elif isinstance(msg, protocol.StayAwake):
            server.stay_awake(msg.for_good)
        elif isinstance(msg, protocol.Drain):
            threading.Thread(target=server.drain, args=(msg.deadline_s,), daemon=True).start()
        elif isinstance(msg, protocol.Pause):  # a checkpoint or restore (worker/pausegate.py)
            busy = server.gate.pause(lambda: server.activity.in_flight + (1 if server._lane_busy() else 0))
            try:
                server.control.send(protocol.Paused(id=msg.id, busy=busy))
            except OSError:
                return
        elif isinstance(msg, protocol.Resume):
            server.gate.resume()
