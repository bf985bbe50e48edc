"""What every worker-side tool is: its spec (``spec.py``) and the function that runs it.

Guarantees:
- ``run_tool`` never raises: bad parameters, a ``ToolFailure`` and any
  unexpected exception all come back as a failed ``Outcome`` whose ``error``
  says what went wrong (the tool name and, where there is one, the path).
- Parameters are decoded into the tool's frozen msgspec struct with unknown
  fields rejected, so ``{"pth": "x"}`` is an error, not a silent default.

These functions run only inside a confined worker; the daemon never calls them.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from dispatchd.inside import is_below
from dispatchd.policy import Limits
from dispatchd.redact import Redactor
from dispatchd.catalogue import ToolSpec


def _nothing() -> None:
    pass


class CallControl:
    """One call in flight, as a long-running tool sees it: whether the caller
    cancelled it, and where its output goes as it comes (``emit(stream,
    text)``, None when the caller did not ask for streaming).

    ``wake_fd()`` is a descriptor that becomes readable on ``cancel()``, for a
    tool waiting in ``select``; made on first use (most calls never ask).

    ``channel_fd``, when not None, is the caller's channel: the call runs on
    the thread that reads it (``Tool.watches_channel``), so the tool watches
    it too, and once it is readable (a cancel, another call, its close) calls
    ``release_channel()``, which gives the reading to a thread of its own,
    and stops watching it."""

    __slots__ = ("cancelled", "emit", "channel_fd", "release_channel", "_lock", "_pipe")

    def __init__(self, emit: Callable[[str, str], None] | None = None) -> None:
        self.cancelled = threading.Event()
        self.emit = emit
        self.channel_fd: int | None = None
        self.release_channel: Callable[[], None] = _nothing
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        with self._lock:  # never a write to a descriptor closed (and reused) meanwhile
            if self._pipe is not None:
                try:
                    os.write(self._pipe[1], b"x")
                except OSError:
                    pass

    def wake_fd(self) -> int:
        with self._lock:
            if self._pipe is None:
                self._pipe = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            return self._pipe[0]

    def close(self) -> None:
        with self._lock:
            if self._pipe is not None:
                for fd in self._pipe:
                    os.close(fd)
                self._pipe = None


@dataclasses.dataclass(frozen=True)
class ToolContext:
    """What a tool may know: the worktree and the policy's limits."""

    root: str  # the worktree, absolute and resolved (no symlinks)
    limits: Limits
    env: Mapping[str, str]  # the environment commands run with
    writable: bool = True  # False under a read-only policy
    scratch: str = ""  # the session's private directory (jobs keep their logs there)
    call: CallControl | None = None  # set per call for slow tools (cancel, streaming)
    jobs: Any = None  # the session's background jobs (dispatchd.tools.jobs.Jobs)
    # ``root`` opened (O_PATH) by the tool server: read_file's usual open is
    # made below it by descriptor (openat2, RESOLVE_BENEATH); -1: by path only.
    root_fd: int = -1
    # The session's secrets (SetCommandEnv), for a tool that replies in
    # parts across calls (job_output holds back a value's possible start).
    redactor: Redactor | None = None


class Outcome(msgspec.Struct, frozen=True):
    """What a tool's call came to. A frozen msgspec struct, not a frozen
    dataclass: one is made on every call, and a frozen dataclass sets each
    field through ``object.__setattr__`` (about 7,000 instructions against
    1,000)."""

    success: bool
    output: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = {}  # msgspec gives each instance an empty dict of its own

    @classmethod
    def ok(cls, output: str, metadata: dict[str, Any] | None = None) -> Outcome:
        return cls(True, output, None, metadata or {})

    @classmethod
    def fail(cls, error: str, metadata: dict[str, Any] | None = None) -> Outcome:
        return cls(False, None, error, metadata or {})


class ToolFailure(Exception):
    """Raised by a tool for an expected failure; becomes ``Outcome.fail``."""

    def __init__(self, message: str, metadata: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = metadata or {}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool as the worker runs it: its spec and the function, which takes
    the context and the spec's decoded parameter struct."""

    spec: ToolSpec
    func: Callable[[ToolContext, Any], Outcome]
    # A slow tool that waits in poll and watches CallControl.channel_fd: the
    # tool server runs its calls on the channel's own thread, not a new one.
    watches_channel: bool = False


def run_tool(tool: Tool, ctx: ToolContext, params: Any) -> Outcome:
    try:
        typed = msgspec.convert(params, tool.spec.params_type)
    except msgspec.ValidationError as exc:
        return invalid(tool, exc)
    try:
        return tool.func(ctx, typed)
    except Exception as exc:  # noqa: BLE001 (failed words each kind)
        return failed(tool, ctx, exc)


def no_thread(name: str, exc: BaseException) -> str:
    """The words for a thread the tool server could not start (``RuntimeError:
    can't start new thread``): the session's commands hold every process its
    limit allows but the server's reserve (``proctree``), or all sessions
    together hold every process they may run (``confine/sharedprocs.py``),
    where no reserve of one session's helps."""
    return (f"{name}: the tool server cannot start a thread ({exc}): the session is at its process "
            "limit (its commands hold every process it may have), or all sessions together are at theirs "
            "(dispatch status: kernel budgets); stop some (job_stop) and retry")


def not_started(program: str, exc: BaseException) -> str:
    """The words for a command whose process could not start; for EAGAIN
    (the session's process limit, or all sessions' together: a fork refused
    either way) what to do about it."""
    words = f"could not start {program}: {getattr(exc, 'strerror', None) or exc}"
    if getattr(exc, "errno", None) == errno.EAGAIN:
        words += (": the session's processes, or all sessions' together, are at their limit (dispatch status: "
                  "kernel budgets); stop a job (job_stop) or wait for commands to end, and retry")
    return words


def invalid(tool: Tool, exc: msgspec.ValidationError) -> Outcome:
    """The Outcome of arguments that do not fit the tool's parameters."""
    return Outcome.fail(f"{tool.spec.name}: invalid arguments: {exc}")


def failed(tool: Tool, ctx: ToolContext, exc: Exception) -> Outcome:
    """The Outcome of a tool function that raised ``exc``: its ToolFailure's
    words, an OSError without the host's path, or a bug named as one."""
    name = tool.spec.name
    if isinstance(exc, ToolFailure):
        return Outcome.fail(exc.message, exc.metadata)
    if isinstance(exc, OSError):  # one we did not foresee (e.g. a path swapped mid-call)
        # Python puts the absolute host path in str(exc); the model gets the
        # worktree-relative one, or none.
        where = ""
        if isinstance(exc.filename, str) and is_below(exc.filename, ctx.root):
            where = f": {exc.filename[len(ctx.root.rstrip('/')) + 1:]}"
        return Outcome.fail(f"{name}: {exc.strerror or type(exc).__name__}{where}")
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return Outcome.fail(no_thread(name, exc))  # the session at its process limit, not a bug
    return Outcome.fail(f"{name}: {type(exc).__name__}: {exc}")  # a bug
