"""What the tool server is doing: the calls in flight and the finished ones.

Guarantees:
- ``Activity`` counts the calls in flight and keeps those a stop would cut
  (by channel and request id), when the last one ended, and the finished
  calls not yet reported to the daemon, under one lock;
- ``call_usage`` is a call's ``metadata["usage"]`` when its tool runs in the
  tool server: the thread's CPU time and the server's peak resident size.
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any, Protocol

from dispatchd import protocol

__all__ = ["Activity", "Record", "call_usage", "usage_numbers"]

_monotonic = time.monotonic
_thread_time = time.thread_time
# A finished call, for the daemon (its log line and the session's usage):
# tool, seconds, success, and metadata["usage"] (None: not measured).
Record = tuple[str, float, bool, dict[str, Any] | None]


class Replier(Protocol):
    """Where a call in flight is answered (``channel.Channel``): a stop
    that cuts it replies there."""

    def reply(self, msg: protocol.ToolReply | protocol.ErrorReply) -> None: ...


def usage_numbers(usage: dict[str, Any] | None) -> tuple[float, float]:
    if not usage:
        return 0.0, 0.0
    cpu, peak = usage.get("cpu_s"), usage.get("peak_mib")
    return (float(cpu) if isinstance(cpu, (int, float)) else 0.0,
            float(peak) if isinstance(peak, (int, float)) else 0.0)


_peak: list[float] = [0.0, -1.0]  # the tool server's peak (MiB), and when it was read
_PEAK_EVERY_S = 0.1  # read at most this often: a getrusage is ~1 µs of a fast call's ~20


def call_usage(cpu_before: float) -> dict[str, float]:
    """A call's ``metadata["usage"]`` when the tool runs in the tool server
    (every tool but shell_exec's commands): the CPU time of the thread that
    ran it, and the tool server's peak resident size so far (a process has
    one peak, not one per call; read at most every ``_PEAK_EVERY_S``)."""
    cpu = round(_thread_time() - cpu_before, 6)
    now = _monotonic()
    if now - _peak[1] >= _PEAK_EVERY_S:
        _peak[0], _peak[1] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 2), now
    return {"cpu_s": cpu, "peak_mib": _peak[0]}


class Activity:
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
        self.calls: dict[int, tuple[Replier, protocol.CallTool]] = {}
        # (tool, seconds, success, usage) of each finished call: made CallRecords when
        # sent (flush_records), off the calls' path.
        self.records: list[Record] = []
        # A session that may sleep: the channel readers that found nothing to
        # read for ``sleep_after_s`` and now wait without reading (they hold
        # no byte of a request), and whether the server asked the daemon to
        # sleep (from then on no reader reads until it stays awake).
        self.quiet = 0
        self.sleeping = False
        self.awake = threading.Condition(self.lock)

    def begin(self, key: int, what: tuple[Replier, protocol.CallTool]) -> None:
        # ``last`` is not read while a call is in flight (``idle_for``): the
        # call's end sets it. acquire/release, not ``with``: a lock's
        # __enter__ and __exit__ cost about 800 instructions more, and every
        # call passes here, in end, and in Channel.reply.
        lock = self.lock
        lock.acquire()
        try:
            self.in_flight += 1
            self.calls[key] = what
        finally:
            lock.release()

    def end(self, key: int | None = None, record: Record | None = None,
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
