"""shell_exec: run one bash command in the worktree, bounded in time and output.

Guarantees:
- The command runs as ``/bin/bash -c COMMAND`` in the worktree root (or in
  ``cwd``, which obeys the path rules), with stdin from /dev/null, the
  session's environment only (plus the call's ``env``, checked by
  ``dispatchd.envnames``), and no file descriptor of the worker's.
- It leads a process group and a session of its own (``start_new_session``;
  no ``preexec_fn``, which would cost about 3 ms a spawn by ruling out vfork).
- Each of stdout and stderr is kept up to ``output_cap_bytes``; beyond that
  the output is read and dropped, so the command never blocks on a full pipe.
- The call ends when bash has exited and both pipes are closed, or at the
  timeout. A process bash left that keeps the pipes open (``server &``) does
  not hold the call: 0.2 s after bash exits we stop waiting for it.
- When the call returns, every process the command started has ended,
  however it detached (``setsid``, ``nohup``, ``(cmd &)``, ``env -i``, a
  fork loop): at the timeout or a cancel, bash's tree is killed (bash is a
  child subreaper, see ``proctree``); when bash exited by itself, what it
  left running is killed (``orphans.end_leftovers``, in a tool server that
  adopts orphans), counted in ``metadata["ended_processes"]`` and named on
  the output's last line, which tells the model that ``background: true``
  (a job, ``jobs``) is the way to keep a process running. A cancel is a
  failure with ``metadata["cancelled"]``; one that comes after bash has
  exited finds the command completed, and it is reported as such.
- With a caller that streams (``ctx.call.emit``), output is passed on as it
  is read, stdout and stderr each in order, up to the same cap; the Result
  at the end is the same as without streaming.
- Commands run with RLIMIT_NPROC ``proctree.PROCESS_RESERVE`` (at most a
  quarter of it) below the tool server's, from birth, so a fork bomb leaves
  the server room to answer and kill.
- A command that exits 0 is a success; any other status, a signal or the
  timeout is a failure whose error text still carries the output.

A slow tool (``slow=True``) that watches its channel (``watches_channel``):
the tool server runs a call on the thread that reads the caller's channel
(a new thread per call cost about 0.1 ms of a ``true``), and the capture
watches that channel too; when anything arrives on it, the reading goes to
a thread of its own (``CallControl.release_channel``).
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from dispatchd import envnames
from dispatchd.policy import Limits
from dispatchd.tools import orphans, proctree
from dispatchd.tools.base import CallControl, Outcome, ToolContext, ToolFailure, not_started
from dispatchd.tools.worktree_paths import relative, resolve
from dispatchd.catalogue import ShellExecParams

__all__ = ["ended_note", "shell_exec"]

_BASH = "/bin/bash"
_READ_CHUNK = 65536
# After the kill, how long to wait for the last bytes in the pipes. Only a
# process that escaped the session can hold them open longer.
_DRAIN_AFTER_KILL_S = 0.5
# How long output is still read after bash exits while background jobs hold the pipes.
BACKGROUND_GRACE_S = 0.2


def _timeout(limits: Limits, requested: float | None) -> float:
    if requested is None:
        return limits.command_timeout_s
    if not requested > 0:  # also catches NaN
        raise ToolFailure(f"timeout must be a positive number of seconds, not {requested}")
    if requested > limits.max_command_timeout_s:
        raise ToolFailure(
            f"timeout {requested:g} s is over the maximum of {limits.max_command_timeout_s:g} s this policy allows"
        )
    return requested


def _workdir(ctx: ToolContext, cwd: str | None) -> str:
    if cwd is None:
        return ctx.root
    target = resolve(ctx.root, cwd)
    if not os.path.isdir(target):
        rel = relative(ctx.root, target)
        what = "is not a directory" if os.path.lexists(target) else "does not exist"
        raise ToolFailure(f"cwd {rel} {what}")
    return target


class _Capture:
    """Both pipes and the child's exit, watched with one ``poll``.

    ``poll`` rather than a ``selectors`` epoll: a wait is one system call,
    with nothing to create, register or close per call (the epoll cost an
    ``epoll_create1``, an ``epoll_ctl`` per descriptor and a ``close``)."""

    def __init__(self, proc: proctree.Started, out: int, err: int, cap: int,
                 control: CallControl | None = None) -> None:
        self.proc = proc
        self.cap = cap
        self.control = control
        self.cancelled = False
        self._emit: Callable[[str, str], None] | None = control.emit if control is not None else None
        self._names = {out: "stdout", err: "stderr"}
        # Chunks may end inside a UTF-8 character: a stream passed on as it
        # comes is decoded incrementally (the rest is decoded once, at the end).
        self._decoders = ({fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in self._names}
                          if self._emit is not None else {})
        self.truncated = False
        self.exited_at: float | None = None  # when bash exited (pidfd readable)
        self.detached = False  # background processes kept the pipes; we stopped reading
        self.out = bytearray()
        self.err = bytearray()
        self._buffers = {out: self.out, err: self.err}
        self._poll = select.poll()
        self._watched: set[int] = set()  # pipes still open, and the pidfd until bash exits
        for fd in self._buffers:
            self._watch(fd)
        # A pidfd tells us bash exited without polling and without reaping it;
        # where the kernel (or seccomp) refuses one, we fall back to polling.
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            pass
        else:
            self._watch(self._pidfd)
        # A cancel wakes the poll at once (CallControl.cancel writes to it).
        self._wake: int | None = None
        # The caller's channel, when this call runs on the thread that reads it.
        self._channel: int | None = None
        if control is not None:
            if control.channel_fd is None:
                self._watch_wake()
            else:
                # Only this thread reads the channel, so only it could
                # cancel: the wake descriptor waits for the handover.
                self._channel = control.channel_fd
                self._poll.register(self._channel, select.POLLIN)

    def _watch_wake(self) -> None:
        assert self.control is not None
        self._wake = self.control.wake_fd()
        self._poll.register(self._wake, select.POLLIN)

    def _watch(self, fd: int) -> None:
        self._poll.register(fd, select.POLLIN)
        self._watched.add(fd)

    def _unwatch(self, fd: int) -> None:
        self._poll.unregister(fd)
        self._watched.discard(fd)

    def _wait(self, seconds: float) -> None:
        """One ``poll``, at most ``seconds`` long, and what it found handled."""
        # Rounded up, as selectors does: a wait rounded down to 0 ms would spin.
        for fd, _ in self._poll.poll(math.ceil(max(0.0, seconds) * 1e3)):
            self._on_ready(fd)

    def bash_exited(self) -> bool:
        """Whether bash has exited, without reaping it (its pid stays ours)."""
        if self.proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def run_until(self, deadline: float) -> bool:
        """Read until the pipes close and bash exits; False at the deadline.

        Once bash has exited, background processes it left (a dev server, say)
        may hold the pipes open forever: after a short grace we stop waiting
        (``detached``), and the caller ends them (``orphans.end_leftovers``).
        """
        while self._watched:
            now = time.monotonic()
            if self.exited_at is not None and now >= self.exited_at + BACKGROUND_GRACE_S:
                self.detached = True
                return True
            limit = deadline if self.exited_at is None else min(deadline, self.exited_at + BACKGROUND_GRACE_S)
            remaining = limit - now
            if remaining <= 0 and limit == deadline:
                return False
            if self.control is not None and self.control.cancelled.is_set() and self.exited_at is None:
                # A cancel seen once bash has exited ends nothing: the command
                # completed, and is reported as it ended (its status, the rest
                # of its output; what it left still ends as after any call).
                if not self.bash_exited():
                    self.cancelled = True
                    return False
                self.exited_at = now  # no pidfd, or not yet seen: the grace counts from here
                continue
            self._wait(remaining)
        if self._pidfd is None:
            # Without a pidfd only the pipes were watched; bash may still run
            # (it can close them and go on). Popen.wait polls: the fallback.
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def _on_ready(self, fd: int) -> None:
        if fd == self._channel:
            # Something came on the channel whose reader runs this call (a
            # cancel, another call, its close): someone else reads it now.
            self._unwatch_channel()
            return
        if fd == self._wake:
            self._poll.unregister(fd)  # cancelled: run_until sees the event next
            self._wake = None
            return
        if fd == self._pidfd:
            self._unwatch(fd)
            self.exited_at = time.monotonic()
            return
        chunk = os.read(fd, _READ_CHUNK)
        if not chunk:
            self._unwatch(fd)
            return
        buf = self._buffers[fd]
        room = self.cap - len(buf)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            kept = chunk[:room]
            buf += kept
            if self._emit is not None:
                text = self._decoders[fd].decode(kept, final=len(buf) >= self.cap)
                if text:
                    try:
                        self._emit(self._names[fd], text)
                    except Exception:
                        self._emit = None  # the caller's channel is gone: keep capturing

    def _unwatch_channel(self) -> None:
        if self._channel is not None and self.control is not None:
            self._poll.unregister(self._channel)
            self._channel = None
            self.control.release_channel()
            # A cancel can come from the new reader now. One made before the
            # descriptor was is seen by run_until's check of ``cancelled``.
            self._watch_wake()

    def drain(self, seconds: float) -> None:
        """After the kill: collect what is left in the pipes, briefly."""
        if self._pidfd is not None and self._pidfd in self._watched:
            self._unwatch(self._pidfd)
        if self._wake is not None:
            self._poll.unregister(self._wake)
            self._wake = None
        deadline = time.monotonic() + seconds
        while self._watched:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wait(remaining)

    def close(self) -> None:
        if self._emit is not None:
            for fd, decoder in self._decoders.items():
                tail = decoder.decode(b"", final=True)  # a character cut at the very end
                if tail:
                    try:
                        self._emit(self._names[fd], tail)
                    except Exception:
                        break
        if self._pidfd is not None:
            os.close(self._pidfd)
        for fd in self._buffers:
            os.close(fd)


def _signal_name(number: int) -> str:
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:  # a real-time signal has no name
        return ""


def _render(out: str, err: str, notes: list[str]) -> str:
    parts = [out] if out else []
    if err:
        parts.append("[stderr]\n" + err)
    parts.extend(notes)
    # Each part starts on a line of its own, with no blank line between.
    return "\n".join(p.removesuffix("\n") if i < len(parts) - 1 else p for i, p in enumerate(parts))


# git's words when a write to the read-only .git/config fails (a rename onto
# the read-only mount: EBUSY), and what to tell the model instead.
_GIT_CONFIG_BUSY = b"could not write config file"
_GIT_CONFIG_NOTE = (
    "[the repository's .git/config is read-only in the sandbox (it names programs the user's own git "
    "runs outside). Use `git config --global ...` (this session's own config, in its $HOME), or "
    "`git -c name=value ...` for one command; commits already carry the user's name and email]"
)


_devnull: int | None = None
_devnull_lock = threading.Lock()


def _stdin() -> int:
    """/dev/null, opened once for every command (an open and a close a call
    less; close-on-exec, and each command gets it as its stdin only)."""
    global _devnull
    with _devnull_lock:
        if _devnull is None:
            _devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return _devnull


def _start(ctx: ToolContext, command: str, workdir: str, token: str) -> tuple[proctree.Started, int, int]:
    """bash started on ``command`` (a child subreaper: ``proctree.start_command``),
    and the read ends of its stdout and stderr.

    The pipes are ours, passed as descriptors: Popen would wrap its own in
    buffered file objects (an fstat, an ioctl and an lseek each, and their
    closing), and we only ever ``os.read`` them."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    try:
        proc = proctree.spawn(lambda limits: proctree.start_command(
            [_BASH, "-c", command], proctree.spawn_env(ctx.env, token), workdir, _stdin(), out_w, err_w, limits,
        ), ctx.limits.max_processes)
    except BaseException as exc:
        os.close(out_r)
        os.close(err_r)
        if not isinstance(exc, OSError):
            raise
        raise ToolFailure(not_started(_BASH, exc)) from exc
    finally:
        os.close(out_w)  # the child has its copies: EOF comes when it (and what it started) closes them
        os.close(err_w)
    return proc, out_r, err_r


def _end_call(proc: proctree.Started, token: str) -> None:
    """Every process of the call, ended: bash's tree exactly (bash is a
    subreaper), then what the marker and the process group still find (what
    left a bash that had exited already). Before bash is reaped."""
    proctree.kill_subtree(proc.pid)
    proctree.kill_tree(proc.pid, token)
    orphans.end_leftovers(token)  # what a bash that had exited left (ours, when we adopt orphans)


def _reap(proc: proctree.Started) -> dict[str, float | None]:
    """Wait for bash (as ``proc.wait()``) and say what it used: ``wait4`` gives
    the CPU time of bash and of every process it waited for (its commands,
    their children waited for in turn), and the peak resident size of the
    largest of them. Processes it left behind (``cmd &``, then killed) are
    not counted: their parent was no longer bash when they ended."""
    if proc.returncode is None:
        try:
            _pid, status, ru = os.wait4(proc.pid, 0)
        except ChildProcessError:  # reaped already (cannot be: proctree keeps it ours); as Popen does
            proc.wait()
        else:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return {"cpu_s": round(ru.ru_utime + ru.ru_stime, 4), "peak_mib": round(ru.ru_maxrss / 1024, 2)}
    proc.wait()
    # Reaped before (Popen.wait's fallback, with no pidfd): not known.
    return {"cpu_s": None, "peak_mib": None}


def ended_note(count: int) -> str:
    """The output's last line when a call's command left processes running."""
    what = "1 process" if count == 1 else f"{count} processes"
    return (f"[dispatchd: ended {what} the command left running (a call's processes end with it); "
            "to keep one running, start it with background: true]")


def shell_exec(ctx: ToolContext, params: ShellExecParams) -> Outcome:
    """Run ``command`` with bash; see the module docstring for the guarantees."""
    command, timeout = params.command, params.timeout
    if not command.strip():
        raise ToolFailure("command is empty")
    if "\0" in command:  # the kernel takes an argument up to its first NUL: bash would run another command
        raise ToolFailure("command holds a NUL byte (\\0), which no command line can carry; nothing was run")
    if params.env:
        try:
            ctx = dataclasses.replace(ctx, env={**ctx.env, **envnames.check_env(params.env)})
        except envnames.EnvError as exc:
            raise ToolFailure(str(exc)) from None
    workdir = _workdir(ctx, params.cwd)
    if params.background:
        if ctx.jobs is None:
            raise ToolFailure("this session cannot run background jobs")
        if timeout is not None:
            _timeout(ctx.limits, timeout)
        return ctx.jobs.start(ctx, command, workdir, timeout)  # type: ignore[no-any-return]
    limit = _timeout(ctx.limits, timeout)
    token = proctree.new_token()
    started = time.monotonic()
    proc, out_fd, err_fd = _start(ctx, command, workdir, token)
    capture = _Capture(proc, out_fd, err_fd, ctx.limits.output_cap_bytes, ctx.call)
    timed_out = False
    exited_before_timeout = False
    ended = 0
    try:
        if not capture.run_until(started + limit):
            timed_out = not capture.cancelled
            exited_before_timeout = capture.bash_exited()
            _end_call(proc, token)
            capture.drain(_DRAIN_AFTER_KILL_S)
        else:
            ended = orphans.end_leftovers(token)
            if capture.detached and orphans.adopting():
                capture.drain(_DRAIN_AFTER_KILL_S)  # what they wrote until the kill
    except BaseException:
        if proc.returncode is None:  # not reaped, so the pid is still ours
            _end_call(proc, token)
        raise
    finally:
        usage = _reap(proc)
        capture.close()
    duration = time.monotonic() - started

    code = proc.wait()  # reaped already (finally above): its status
    out = capture.out.decode("utf-8", "replace")
    err = capture.err.decode("utf-8", "replace")
    notes = []
    if capture.truncated:
        notes.append(f"[output truncated at {ctx.limits.output_cap_bytes} bytes per stream]")
    if capture.detached and not orphans.adopting():
        notes.append("[bash exited; background processes it started still run, their output is not captured]")
    if timed_out:
        why = " (bash had exited; processes it started kept the output open)" if exited_before_timeout else ""
        notes.append(f"[timed out after {limit:g} s{why}]")
    if capture.cancelled:
        notes.append(f"[cancelled after {duration:.1f} s; the command and every process it started were ended]")
    if code != 0 and _GIT_CONFIG_BUSY in capture.err and b".git/config" in capture.err:
        notes.append(_GIT_CONFIG_NOTE)
    if ended:
        notes.append(ended_note(ended))
    text = _render(out, err, notes)
    meta = {
        "exit_code": code,
        "timed_out": timed_out,
        "truncated": capture.truncated,
        "duration_s": round(duration, 4),
        "stdout": out,
        "stderr": err,
        "usage": usage,
        "ended_processes": ended,
    }
    if capture.cancelled:
        meta["cancelled"] = True
    if code == 0 and not timed_out and not capture.cancelled:
        return Outcome.ok(text, meta)
    if capture.cancelled:
        headline = "command was cancelled"
    elif timed_out:
        headline = f"command timed out after {limit:g} s"
    elif code < 0:
        headline = f"command was killed by signal {-code}{_signal_name(-code)}"
    else:
        headline = f"command exited with status {code}"
    return Outcome.fail(f"{headline}\n{text}" if text else headline, meta)
