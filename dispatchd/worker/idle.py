"""The tool server between calls: records, the idle timeout, sleep, and a stop.

Guarantees:
- finished calls reach the daemon's log in batches, at most
  ``RECORD_INTERVAL_S`` after the first of a batch ended;
- the session ends itself after the policy's idle timeout with no call in
  flight (the fast lane's included);
- it asks to sleep only when nothing would be lost: no call in flight, no
  job running, no process but the tool server in the session, and every
  channel's reader waiting between frames; asleep, it hands the ended jobs
  and every channel to the daemon, untouched, then exits;
- when the daemon stops, new calls are refused and those still running at
  its deadline are answered (a failure saying the stop cut them).
"""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dispatchd import protocol
from dispatchd.confine.plan import SessionPlan
from dispatchd.protocol.internal import EXIT_ASLEEP, EXIT_IDLE
from dispatchd.tools import native
from dispatchd.tools.base import ToolContext
from dispatchd.worker.activity import Activity, usage_numbers
from dispatchd.worker.control import Control

if TYPE_CHECKING:
    from dispatchd.worker.channel import Channel

__all__ = ["MIN_SLEEP_AFTER_S", "RECORD_INTERVAL_S", "Idle"]

RECORD_INTERVAL_S = 0.5  # how often finished calls are reported to the daemon's log
MIN_SLEEP_AFTER_S = 0.05  # the least idle time after which a session sleeps (limits.sleep_after_s)


class Idle:
    """The server's life between calls: a base of ``tool_server._Server``,
    which holds what is declared here."""

    plan: SessionPlan
    ctx: ToolContext
    activity: Activity
    control: Control
    draining: bool
    records_wake: int
    flush_at: float | None
    sleep_after: float
    every: float
    next_check: float
    channels: int
    added: int
    live: set[Channel]
    fast_read: Callable[..., float | bytes | tuple[list[float], bytes]] | None

    def _records_due(self) -> None:
        """The first record of a batch: wake the control loop, which sends
        the batch RECORD_INTERVAL_S later (housekeeping)."""
        try:
            os.eventfd_write(self.records_wake, 1)
        except BlockingIOError:
            pass  # the counter is full: the loop is woken already

    def flush_records(self) -> None:
        """Send the daemon what finished since the last time (for its log)."""
        activity = self.activity
        with activity.lock:
            records, activity.records = activity.records, []
        if not records:
            return
        try:
            self.control.send(protocol.ToolCallsDone(
                calls=[protocol.CallRecord(tool, round(seconds * 1e3, 3), ok, *usage_numbers(usage))
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
                    self.control.send(protocol.MaySleep(added=self.added))
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
