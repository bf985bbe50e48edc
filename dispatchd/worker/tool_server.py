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
- it is a child subreaper (``orphans.adopt_orphans``): what a call's bash
  leaves running comes to it when bash exits, and is ended before the call
  returns (``orphans.end_leftovers``); jobs' processes stay below their keeper.
- ``SetCommandEnv`` from the daemon changes the environment of commands
  started after it (the proxy variables of network "domains", the caller's
  ``env`` and ``secrets``), not of those running; once a secret is given,
  every reply and streamed output has its value replaced by ``[secret NAME]``
  (``redact.py``; read_file's C lane is turned off, as it replies on its own).

Threads are safe here: Landlock and seccomp were applied before this process
was forked, and every thread inherits them.

The parts, one module each: a client channel (``channel.py``), how a request
becomes a reply, one path for every call (``calls.py``), the server between
calls: records, idle timeout, sleep, stop (``idle.py``), the calls in flight
(``activity.py``), the control channel and the write lock (``control.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import select
import socket
import struct
import threading
import time

from dispatchd import protocol, threads
from dispatchd.confine.plan import SessionPlan, can_sleep
from dispatchd.policy import MAX_CHANNELS, max_channels, too_many_channels
from dispatchd.tempfiles import sweep_temp_files
from dispatchd.tools import atomic, changes, files, native, orphans, proctree
from dispatchd.tools.base import ToolContext
from dispatchd.tools.jobs import Jobs
from dispatchd.tools.table import TOOLS
from dispatchd import redact
from dispatchd.worker import ipcwatch, pausegate
from dispatchd.worker.activity import Activity
from dispatchd.worker.calls import Calls
from dispatchd.worker.channel import Channel
from dispatchd.worker.control import Control, WriteLock
from dispatchd.worker.idle import MIN_SLEEP_AFTER_S, Idle

__all__ = ["MAX_CHANNELS", "max_channels", "serve", "warm_up"]

FIRST_CHANNEL_WAIT_S = 5.0  # how long the first channel's thread, started ahead, waits for it


# A channel no thread can be started for waits this long, tried again this
# often: a third of the client's default timeout (30 s), so that the client
# reads the refusal's words rather than its own timeout.
STARVED_WAIT_S = 10.0
STARVED_RETRY_S = 0.1


class _Server(Calls, Idle):
    """A session's tool server: its context and tools, its channels, and
    (from its bases) its calls and its life between them."""

    def __init__(self, plan: SessionPlan, control: Control) -> None:
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
        self.activity = Activity()
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
        self.write_lock = WriteLock(control)
        self.write_lock.checkpoint_each = plan.checkpoint_writes  # daemon/checkpoints/
        self.gate = pausegate.Gate()
        # The worktree is ours to write now: remove what killed writes left
        # (tempfiles.py), but not the files of our own writes already started.
        # Not called when the grant says the daemon swept it since anyone
        # could write it (daemon/writelock.py).
        self.write_lock.on_granted = lambda: _sweep_beside(plan.paths.worktree)
        self.draining = False
        # The first record of a batch wakes the control loop, which sends the
        # batch RECORD_INTERVAL_S later (housekeeping).
        self.records_wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.flush_at: float | None = None
        # Sleeping (worker/wake.py): after this long with no call, nor job,
        # nor process, nor reader holding a byte; 0: never.
        # At least MIN_SLEEP_AFTER_S: a smaller one (the policy takes any)
        # spun this loop (an idle check each sleep_after / 2; a socket
        # timeout of less than a microsecond would even be none). A woken
        # server that asks to sleep before the daemon has handed it back the
        # channels that woke it is told to stay awake (MaySleep.added): no
        # idle time is long enough for that on a loaded machine.
        self.sleep_after = max(plan.limits.sleep_after_s, MIN_SLEEP_AFTER_S) if can_sleep(plan) else 0.0
        self.live: set[Channel] = set()  # the channels a sleep hands over
        # Channels no thread could be started for (the process limit): each
        # with when it is refused; tried again at each housekeeping until then.
        self.starved: list[tuple[Channel, float]] = []
        self.every = min(5.0, plan.limits.idle_timeout_s / 4, *((self.sleep_after / 2,) if self.sleep_after else ()))
        self.next_check = time.monotonic() + self.every
        self.channels = 0
        self.added = 0  # AddChannel messages taken from the daemon (MaySleep.added)
        self.max_channels = max_channels(plan.limits.max_processes, plan.limits.max_open_files)
        # The thread that will read the first client channel, started before
        # it comes (expect_first_channel); None once given one or gone.
        self._first: queue.SimpleQueue[Channel] | None = None
        self._first_lock = threading.Lock()

    def expect_first_channel(self) -> None:
        """Start the first channel's thread now, before the channel comes: the
        daemon attaches the opener right after the session is ready, and a
        thread started then took 0.5-2.5 ms to run (the scheduler's queue on
        a busy machine), all of it before the session's first call was read.
        It waits ``FIRST_CHANNEL_WAIT_S`` at most (a session opened without
        an attach has no spare thread after that)."""
        waiting: queue.SimpleQueue[Channel] = queue.SimpleQueue()
        self._first = waiting
        try:
            threads.Thread(target=self._first_channel, args=(waiting,), daemon=True).start()
        except RuntimeError:  # can't start new thread: the channel gets its own when it comes
            self._first = None

    def _first_channel(self, waiting: queue.SimpleQueue[Channel]) -> None:
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
        channel = Channel(sock, self)
        if self.sleep_after:
            # A read with nothing to read gives up after sleep_after_s: its
            # reader then waits without reading (Channel._wait_to_read).
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
        if not self._start_reader(channel):
            # The session's process limit, or all sessions': its request (a
            # woken session's first came with it) waits for a thread a while.
            self.starved.append((channel, time.monotonic() + STARVED_WAIT_S))

    def _start_reader(self, channel: Channel) -> bool:
        try:
            # Not waited for (threads.py): the control loop goes on meanwhile.
            threads.Thread(target=channel.run, daemon=True).start()
        except RuntimeError:  # can't start new thread
            return False
        return True

    def feed_starved(self) -> None:
        """From the control loop: a thread for each channel waiting for one,
        or, past its wait, the channel refused with what to do."""
        waiting, self.starved = self.starved, []
        now = time.monotonic()
        for channel, until in waiting:
            if self._start_reader(channel):
                continue
            if now < until:
                self.starved.append((channel, until))
                continue
            self.channel_closed(channel)
            channel.refuse("busy", "the session's tool server cannot start a thread for this channel (can't start "
                                   "new thread): the session's processes, or all sessions' together, are at their "
                                   "limit (dispatch status: kernel budgets); stop some (job_stop) and retry")

    def channel_closed(self, channel: Channel) -> None:
        with self.activity.lock:
            self.channels -= 1
            self.live.discard(channel)

    def set_command_env(self, msg: protocol.SetCommandEnv) -> None:
        env = {k: v for k, v in self.ctx.env.items() if k not in msg.unset}
        env.update(msg.set)
        fresh = {name: msg.set[name] for name in msg.secrets if name in msg.set}
        if fresh:
            # Before the commands can see them: no reply carries one unredacted.
            # Kept once given, even when unset (a file may still hold one).
            self.secrets.update(fresh)
            self.redactor = redact.Redactor(self.secrets)
            self.fast_read = None  # read_file's C lane replies without Channel.reply: off
        # One assignment: a call starting now sees the old context or the new, whole.
        self.ctx = dataclasses.replace(self.ctx, env=env, redactor=self.redactor)


def _sweep_beside(worktree: str) -> None:
    """Sweep the temporary files killed writes left, on a thread of its own;
    in the caller's when no thread is to be had (the session's processes at
    their bound): the sweep is bounded, and a write must not fail for it."""
    try:
        threading.Thread(target=sweep_temp_files, args=(worktree, atomic.in_flight), daemon=True, name="sweep").start()
    except RuntimeError:  # "can't start new thread"
        sweep_temp_files(worktree, atomic.in_flight)


def _open_root(worktree: str) -> int:
    """The worktree's root as an O_PATH descriptor, held for the session's
    life (close-on-exec: no command inherits it): read_file opens below it
    (ToolContext.root_fd). -1 when it cannot be opened: every call then takes
    the path rules' walk, which says what is wrong."""
    try:
        return os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


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
        server = _Server(plan, Control(protocol.FrameSocket(theirs)))
        if server.ctx.root_fd >= 0:  # the session's root, opened by the server: not this warm-up's
            os.close(server.ctx.root_fd)
        # /etc by descriptor, as a session's root: the call takes the fast
        # lane where the C helper is built, as the session's first will.
        etc = _open_root("/etc")
        server.ctx = ToolContext(root="/etc", limits=plan.limits, env={}, writable=False, root_fd=etc)
        server.tools = {"read_file": TOOLS["read_file"]}
        server.fast_read = native.lines.serve_read if native.lines is not None and etc >= 0 else None
        channel = Channel(theirs, server)
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


def serve(control: protocol.FrameSocket, plan: SessionPlan, adopt_orphans: bool = True,
          first_channel: int = -1, woken: bool = False) -> None:
    """Serve until the daemon closes the control channel. ``adopt_orphans``
    False only where the server runs inside another program (a test), whose
    own children must not be taken for what a call left. ``first_channel``:
    the opener's channel, when it came with the session (AdoptSession),
    served from here as an ``AddChannel``'s. ``woken``: a sleeping session's
    new tool server, in the namespaces of the one before."""
    if adopt_orphans:
        # What a call's bash leaves running comes to us when it exits, to be
        # ended before the call returns (orphans.end_leftovers).
        orphans.adopt_orphans()
    server = _Server(plan, Control(control))
    if adopt_orphans and plan.namespaces.pid:
        # The session's own IPC namespace: what it holds in System V memory
        # is the daemon's memory watchdog's to count too (worker/ipcwatch.py).
        link = server.control
        ipcwatch.start(lambda held: link.send(protocol.IpcHeld(bytes=held)), proctree.SPAWNED,
                       proctree.before_spawn, look_now=woken)
    if first_channel >= 0:
        server.added += 1  # counted as the daemon counts it (MaySleep.added)
        server.add_channel(socket.socket(fileno=first_channel))
    else:
        server.expect_first_channel()
    _control_loop(server)


def _control_loop(server: _Server) -> None:
    """Read the daemon's messages until it closes the control channel. A
    frame is read and, if a refusal, recorded between ``Control.reading``
    and ``Control.recorded`` (what ``Control.settle`` waits for); the other
    messages are handled after: a call that settles never waits for one
    (a ``Pause`` waits for the calls in flight)."""
    try:
        _read_control(server)
    finally:
        server.control.ended()  # a call settling (Control.settle) waits no more


def _read_control(server: _Server) -> None:
    link = server.control
    control = link.frames
    poller = select.poll()
    poller.register(control.fileno(), select.POLLIN)
    poller.register(server.records_wake, select.POLLIN)
    while True:
        # A frame already buffered is read at once; otherwise wait for the
        # daemon, a batch of call records, or the next idle check.
        buffered = control.buffered()
        wait = 0.0 if buffered else server.housekeeping_wait()
        if server.starved:
            wait = min(wait, STARVED_RETRY_S)
        ready = {fd for fd, _ in poller.poll(wait * 1000)}
        server.housekeeping(server.records_wake in ready)
        if server.starved:
            server.feed_starved()
        if not buffered and control.fileno() not in ready:
            continue
        link.reading()
        try:
            msg = control.recv(protocol.to_worker_decoder)
            if isinstance(msg, protocol.NetworkDenied):
                server.note_denied(msg)
                continue
        except protocol.DescriptorsLost:
            continue  # a channel cut on its way (out of descriptors): its client sees it closed
        except (protocol.ProtocolError, OSError):
            return
        finally:
            link.recorded()
        if msg is None:
            return  # the daemon closed the session or went away
        if isinstance(msg, protocol.AddChannel):
            server.added += 1  # counted as the daemon counts it: sent, whether or not its descriptor came
            try:
                fd = control.take_fd()
            except protocol.ProtocolError:
                continue
            server.add_channel(socket.socket(fileno=fd))
        elif isinstance(msg, (protocol.OkReply, protocol.ErrorReply)):
            server.write_lock.answer(msg)
        elif isinstance(msg, protocol.ForgetWriteLock):
            server.write_lock.held = False  # the next mutating call asks the daemon again
            if msg.id:
                try:
                    server.control.send(protocol.OkReply(id=msg.id))
                except OSError:
                    return
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
