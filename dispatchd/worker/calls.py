"""How a request becomes a reply in the tool server: one path for every call.

Guarantees:
- only the policy's tools exist; any other name is a failed ``ToolReply``,
  as is any call while the server drains, and a mutating call (write_file,
  edit_file, create_file, shell_exec) until the daemon has granted this
  session its worktree's write lock;
- every call is counted in flight (``Activity``) from ``dispatch`` until its
  reply is sent, then recorded for the daemon's log;
- a fast tool runs on the channel's reader; a slow one (``spec.slow``) on a
  thread of its own, or, a command that watches its channel
  (``Tool.watches_channel``), on the reader, which it hands over as soon as
  the channel has more to read; a thread that cannot be started (the
  session at its process limit) is a failed reply saying so;
- a slow call can be cancelled and streams its output when asked; a
  command's Result carries the worktree paths it changed
  (``metadata["changed"]``) and the hosts the network rules refused during
  it (``metadata["network_denied"]``): every refusal made while it ran,
  however late the control loop gets to run (``_with_denials``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from dispatchd import protocol
from dispatchd.confine.plan import SessionPlan
from dispatchd.policy import MUTATING_TOOLS
from dispatchd.tools import changes
from dispatchd.tools.base import CallControl, Outcome, Tool, ToolContext, failed, invalid, no_thread
from dispatchd import redact
from dispatchd.worker import pausegate
from dispatchd.worker.activity import Activity, call_usage
from dispatchd.worker.control import Control, WriteLock

if TYPE_CHECKING:
    from dispatchd.worker.channel import Channel

__all__ = ["MAX_WATCHED_DIRS", "Calls"]

_convert = msgspec.convert
_monotonic = time.monotonic  # one global lookup where every call reads the clock twice
_thread_time = time.thread_time

MAX_WATCHED_DIRS = 20_000  # a worktree with more directories is not watched (tools/changes.py)

# Slow calls served on the channel's reader when no thread can start: what
# ends processes and what lists them (each bounded: a stop's rounds end
# within seconds), the only way out for a session whose processes are all taken.
SERVED_WITHOUT_A_THREAD = frozenset({"job_stop", "job_list"})


def _with_changes(out: Outcome, watcher: changes.Watcher, mark: float) -> Outcome:
    """``out`` with ``metadata["changed"]``: the worktree paths changed since ``mark``."""
    paths, truncated, unknown = watcher.since(mark)
    out.metadata["changed"] = paths
    if truncated:
        out.metadata["changed_truncated"] = True
    if unknown:
        out.metadata["changed_unknown"] = True
    return out


class Calls:
    """The calls of the tool server: a base of ``tool_server._Server``, which
    holds what is declared here."""

    plan: SessionPlan
    ctx: ToolContext
    tools: dict[str, Tool]
    activity: Activity
    control: Control
    write_lock: WriteLock
    gate: pausegate.Gate
    redactor: redact.Redactor | None
    denials: collections.deque[tuple[float, str, str]]
    watcher: changes.Watcher | None | bool
    watcher_lock: threading.Lock
    draining: bool
    _records_due: Callable[[], None]

    def dispatch(self, channel: Channel, req: protocol.CallTool) -> None:
        if req.tool in MUTATING_TOOLS:  # a checkpoint or restore holds writing calls here (worker/pausegate.py)
            with self.gate:
                self._dispatch(channel, req)
            return
        self._dispatch(channel, req)

    def _dispatch(self, channel: Channel, req: protocol.CallTool) -> None:
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
            asked = self.write_lock.ask(req.tool)
            if self.watcher is None and req.tool == "shell_exec" and self.ctx.writable:
                # The first command's watch (tools/changes.py, about 2 ms on
                # 2,000 files) is built while the daemon answers, not after.
                self._watcher()
            refused = self.write_lock.wait(asked)
            if refused is not None:
                channel.reply(protocol.ToolReply(id=req.id, success=False, error=f"{req.tool}: {refused}",
                                                 metadata={"write_locked": True}))
                return
        key = id(req)
        # In flight from here (Activity.begin written out, as _call writes
        # out its end: their calls cost about 2,000 + 900 instructions of
        # the 64,000 a read_file takes in the tool server).
        activity = self.activity
        lock = activity.lock
        lock.acquire()  # not ``with``: see Activity.begin
        try:
            activity.in_flight += 1
            activity.calls[key] = (channel, req)
        finally:
            lock.release()
        if not tool.spec.slow:
            self._call(channel, req, tool, key, None)  # on the channel's reader
            return
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
            # process the limit allows but the server's reserve (proctree),
            # or all sessions together theirs, where no reserve of ours
            # helps. The way out, stopping a job, and the look at what runs
            # are served here on the reader, as a fast call is.
            if req.tool in SERVED_WITHOUT_A_THREAD:
                self._call(channel, req, tool, key, control)
                return
            with channel.calls_lock:
                channel.calls.pop(rid, None)
            activity.end(key)
            channel.reply(protocol.ToolReply(id=rid, success=False, error=no_thread(req.tool, exc)))

    def _call_here(self, channel: Channel, req: protocol.CallTool, tool: Tool, key: int,
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

    def _call(self, channel: Channel, req: protocol.CallTool, tool: Tool, key: int,
              control: CallControl | None) -> None:
        """Run the call ``dispatch`` began (``key`` in ``activity``), reply, end
        it: the one path of every call. ``control`` is a slow call's (None: a
        fast one, which has none of its extras: its own context, the changes
        it made, the network's refusals, a stream to flush). ``run_tool`` and
        ``Activity.end`` are written out (see ``dispatch``)."""
        started = _monotonic()
        cpu = _thread_time()
        success = False
        usage = None
        if control is None:
            ctx = self.ctx
        else:
            ctx = dataclasses.replace(self.ctx, call=control)
            watcher = self._watcher() if req.tool == "shell_exec" and ctx.writable else None
            if watcher is not None:
                watcher.drain()  # what came before this call is not its own
                mark = _monotonic()
        try:
            try:
                typed = _convert(req.params, tool.spec.params_type)
            except msgspec.ValidationError as exc:
                out = invalid(tool, exc)
            else:
                try:
                    out = tool.func(ctx, typed)
                except Exception as exc:  # noqa: BLE001 (failed words each kind)
                    out = failed(tool, ctx, exc)
            if control is not None:
                if watcher is not None:
                    out = _with_changes(out, watcher, mark)
                if "HTTP_PROXY" in ctx.env or self.denials:  # network "domains" now, or before a switch
                    out = self._with_denials(out, started)
                if isinstance(control.emit, redact.Stream):
                    try:
                        control.emit.flush()  # what waited to be told from a secret's start
                    except OSError:
                        pass  # the caller is gone
            success = out.success
            metadata = out.metadata
            if control is None or "usage" not in metadata:  # shell_exec's is its command's own
                metadata["usage"] = usage = call_usage(cpu)
            else:
                usage = metadata["usage"]
            channel.reply(protocol.ToolReply(req.id, success, out.output, out.error, metadata))
        finally:
            if control is not None:
                with channel.calls_lock:
                    channel.calls.pop(req.id, None)
                control.close()
            now = _monotonic()
            activity = self.activity
            lock = activity.lock
            lock.acquire()  # not ``with``: see Activity.begin
            try:
                activity.in_flight -= 1
                activity.last = now
                del activity.calls[key]  # there since dispatch
                records = activity.records
                records.append((req.tool, now - started, success, usage))
                first = len(records) == 1
            finally:
                lock.release()
            if first:
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
                    else:
                        self._hand_over(self.watcher)
                watcher = self.watcher
        return watcher if isinstance(watcher, changes.Watcher) else None

    def _hand_over(self, watcher: changes.Watcher) -> None:
        """The daemon holds the watch too (``WatchHeld``): this sandbox's
        exit then never waits for its teardown; the daemon's close of it,
        after its reply, does."""
        try:
            self.control.send(protocol.WatchHeld(), fds=[watcher.fd])
        except OSError:
            pass  # the daemon is gone: the session ends with it

    def note_denied(self, msg: protocol.NetworkDenied) -> None:
        self.denials.append((time.monotonic(), f"{msg.host}:{msg.port}", msg.allow))

    def _with_denials(self, out: Outcome, started: float) -> Outcome:
        """``out`` with the proxy's refusals since ``started``: their list in
        ``metadata["network_denied"]``, and one line at the end of the text
        naming them and the command that allows them. By time window: a
        refusal during two calls of the session at once goes to both.

        None is lost to a control loop slow to run: a refusal is sent on the
        control channel before the refused process hears of it, so it is on
        the channel before the call can end, and ``Control.settle`` waits
        until the loop has recorded every frame there (unless the loop is
        stuck for ``SETTLE_MOST_S``). A refusal is timed when the loop
        records it: one made just before the call began and recorded after
        is counted too; one made during it, always."""
        self.control.settle()
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
