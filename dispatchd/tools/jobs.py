"""Background jobs: commands that outlive the call that started them, on purpose.

Guarantees:
- ``shell_exec`` with ``background: true`` starts ``bash -c COMMAND`` as a job
  and returns at once with its id (``job_1``, ``job_2``, ... in this session).
  A job is the one way to keep something running past its call: everything
  else a call started ends at its timeout or cancel (``proctree``).
- Its stdout and stderr go, in the order written, to one log file in the
  session's scratch directory (never to the daemon, never kept in memory),
  with the session's secrets redacted on the way (``jobwindow.RedactedLog``),
  written through a descriptor opened once with ``O_EXCL|O_NOFOLLOW`` and
  read back through the same one, so renaming or replacing the file by name
  changes nothing. At most ``output_cap_bytes`` are kept; later output is
  read and dropped, and ``job_output`` says so.
- ``job_output(job, offset, wait)`` returns the log from byte ``offset``
  (cut at a character boundary), waiting up to ``wait`` seconds when there is
  nothing new yet and the job still runs; ``next_offset`` is where to go on.
  With secrets, a tail that could begin one waits for the next poll
  (``jobwindow``): a value is never handed out in pieces.
- A job runs until its command has exited and nothing it started holds its
  output any more; ``exit_code`` is then the command's status, as bash
  gives it (128 + N for a command killed by signal N).
- Its command runs below a keeper (``_KEEPER``: a bash that is the job's
  leader, a child subreaper, and waits until no process below it is left):
  what the command leaves running stays in the keeper's tree after the
  command exited, however it detached (``setsid``, ``env -i``), so the
  sweep that ends what finished calls left (``orphans.end_leftovers``)
  never sees a job's processes, and ``job_stop`` ends all of them exactly,
  while the job runs and after it ended. A job with a ``timeout`` is
  stopped at it. Every job ends with its session (the session's pid
  namespace, or its kill): nothing outlives the session.
- At most ``MAX_RUNNING`` jobs run at once in a session, and at most
  ``MAX_KEPT`` are remembered (the oldest ended ones are forgotten first).
- Ended jobs outlive a sleep of the session (``kept``/``restore``: their
  state, and their logs by descriptor, held by the daemon meanwhile); a
  session with a job running does not sleep.
- This code runs in the confined tool server: nothing it does on a
  command's behalf goes beyond what the session may do itself.
"""

from __future__ import annotations

import math
import os
import re
import select
import selectors
import signal
import socket
import subprocess
import threading
import time
from typing import Any

from dispatchd.display import one_line
from dispatchd.protocol.internal import JobRecord
from dispatchd.tools import proctree
from dispatchd.tools.base import CallControl, Outcome, ToolContext, ToolFailure, not_started
from dispatchd.tools.jobwindow import RedactedLog, read_window
from dispatchd.catalogue import JobListParams, JobOutputParams, JobStopParams

__all__ = ["Jobs", "MAX_RUNNING", "job_list", "job_output", "job_stop"]

MAX_RUNNING = 16
# Ended jobs kept for job_output/job_list; beyond it the oldest ended one is
# forgotten (its log removed, its descriptor closed), so a session starting
# job after job holds neither descriptors nor scratch space without bound.
MAX_KEPT = 64
_READ_CHUNK = 65536
_POLL_S = 0.1  # how often a waiting job_output looks for a cancel
# The job's leader: bash started as a child subreaper (proctree.start_command) on this script,
# the job's command as "$1". The command runs in a bash of its own, with stdin from /dev/null;
# the keeper's stdin is a socket to the job's thread, which reads the command's status from it.
# Then, no longer holding the job's output, the keeper stays while it has a child (the orphans
# of the command's processes come to it, and its SIGCHLD handler reaps them), looking once a
# second: its read of the socket times out (the job's thread never writes; an end of file, the
# tool server gone, ends the loop). About 1.6 ms more a job (an exec of bash: docs/budgets.md)
# and one process. --norc: bash reads ~/.bashrc when its stdin is a socket (as under sshd).
_KEEPER = r"""/bin/bash -c "$1" </dev/null
echo "$?" >&0
exec >/dev/null 2>&1
while c=; read -r -d '' c </proc/$$/task/$$/children; [ -n "$c" ]; do read -r -t 1 _ <&0; (( $? > 128 )) || break; done"""


def _signal_text(code: int) -> str:
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


def _exit_code(status: bytes) -> int | None:
    """The command's status as the keeper wrote it, None when it wrote none."""
    try:
        return int(status.strip())
    except ValueError:
        return None


def _wait_readable(fd: int, seconds: float | None) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(None if seconds is None else math.ceil(seconds * 1e3))


class Job:
    def __init__(self, jid: str, command: str, proc: proctree.Started | None, token: str, log_fd: int,
                 cap: int, timeout: float | None, out_fd: int = -1, status_fd: int = -1,
                 redacting: RedactedLog | None = None) -> None:
        self.id = jid
        self.command = command
        self.proc = proc  # the keeper
        self.out_fd = out_fd  # the read end of its stdout and stderr
        self.status_fd = status_fd  # our end of the keeper's stdin: the command's status comes on it
        self.token = token
        self.log_fd = log_fd
        self.redacting = redacting
        self.cap = cap
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.written = 0
        self.truncated = False
        self.exit_code: int | None = None
        self.ended_by = ""  # "stopped" or "timed out" when we ended it
        self.cond = threading.Condition()
        self.reaped = False

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def state(self) -> str:
        if self.exit_code is None:
            return "running"
        if self.ended_by:
            return self.ended_by
        return f"exited {self.exit_code}" if self.exit_code >= 0 else _signal_text(self.exit_code)

    def pump(self) -> None:
        """The job's thread: copy its output to the log and read its
        command's status until both are done (the job then ends), then wait
        for the keeper, which stays while processes the command left run,
        and reap it."""
        assert self.proc is not None and self.out_fd >= 0 and self.status_fd >= 0
        sel = selectors.DefaultSelector()
        sel.register(self.out_fd, selectors.EVENT_READ)
        sel.register(self.status_fd, selectors.EVENT_READ)
        status = b""
        try:
            while sel.get_map():
                events = sel.select(self._left())
                self._at_deadline()
                for key, _ in events:
                    chunk = os.read(key.fd, _READ_CHUNK)
                    if key.fd == self.status_fd:
                        status += chunk
                        if not chunk or b"\n" in status:
                            sel.unregister(key.fd)
                    else:
                        self._keep(chunk)  # b"": the end of the output
                        if not chunk:
                            sel.unregister(key.fd)
            code = _exit_code(status)  # None: the keeper was killed before the command ended
            if code is not None:
                with self.cond:
                    self.exit_code = code
                    self.cond.notify_all()
            self._wait_keeper()
        finally:
            sel.close()
            os.close(self.out_fd)
            self._reap(block=True)
            os.close(self.status_fd)
            with self.cond:
                if self.exit_code is None:
                    self.exit_code = self.proc.returncode
                self.cond.notify_all()

    def _left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _at_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.kill("timed out")
            self.deadline = None

    def _wait_keeper(self) -> None:
        """Until the keeper has exited (the job's timeout still applies)."""
        assert self.proc is not None
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            pidfd = None
        try:
            while not self._exited():
                if pidfd is not None:
                    _wait_readable(pidfd, self._left())
                else:
                    time.sleep(0.2 if self.deadline is None else min(0.2, self._left() or 0.0))
                self._at_deadline()
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _reap(self, block: bool = False) -> None:
        assert self.proc is not None
        with self.cond:
            if not self.reaped and (block or self._exited()):
                # Our own wait, under the lock, so that kill() never kills by a
                # pid that was reaped (and could be another process's by now).
                self.proc.wait()
                self.reaped = True

    def _exited(self) -> bool:
        """Whether the leader exited, without reaping it (its pid stays ours)."""
        assert self.proc is not None
        try:
            return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def _keep(self, chunk: bytes) -> None:
        room = self.cap - self.written
        if self.redacting is not None and (room > 0 or not chunk):  # at the end, a held tail is a cut
            chunk = self.redacting.feed(chunk) if chunk else self.redacting.end()
        if len(chunk) > room:
            self.truncated = True
        if room > 0 and chunk:
            part = chunk[:room]
            try:
                os.pwrite(self.log_fd, part, self.written)
            except OSError:
                self.truncated = True  # the scratch disk is full: say so, keep draining
                return
            with self.cond:
                self.written += len(part)
                self.cond.notify_all()

    def kill(self, why: str) -> None:
        with self.cond:
            leader = None if self.reaped or self.proc is None else self.proc.pid
            if self.exit_code is None:
                self.ended_by = why
            if leader is not None:
                proctree.kill_subtree(leader)  # its tree, exactly (the keeper is a child subreaper)
            proctree.kill_tree(leader, self.token)

    def stop(self, why: str = "stopped") -> None:
        """Kill the job and everything it started; wait (briefly) for the pump to see its end."""
        self.kill(why)
        deadline = time.monotonic() + 2
        with self.cond:
            while self.exit_code is None and time.monotonic() < deadline:
                self.cond.wait(0.05)

    def read(self, offset: int, limit: int) -> bytes:
        with self.cond:
            end = self.written
        if offset >= end:
            return b""
        return os.pread(self.log_fd, min(limit, end - offset), offset)


_LOG_NAME = re.compile(r"job_([0-9]{1,9})\.log")  # a planted job_999999999.log costs the numbers above it alone


class Jobs:
    """A session's jobs, kept by its tool server."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._next = 1
        self._dir_fd: int | None = None

    def _log_dir(self) -> int:
        if self._dir_fd is None:
            if not self.scratch:
                raise ToolFailure("background jobs need the session's scratch directory, which this session has not")
            base = os.open(self.scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                try:
                    os.mkdir("jobs", 0o700, dir_fd=base)
                except FileExistsError:
                    pass
                self._dir_fd = os.open("jobs", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       dir_fd=base)
            finally:
                os.close(base)
            # The session's earlier sandboxes' jobs (one a network switch
            # replaced) left their logs: their ids are not given again, so
            # a job_stop meant for one of those never stops a new job.
            for name in os.listdir(self._dir_fd):
                taken = _LOG_NAME.fullmatch(name)
                if taken:
                    self._next = max(self._next, int(taken.group(1)) + 1)
        return self._dir_fd

    def start(self, ctx: ToolContext, command: str, workdir: str, timeout: float | None) -> Outcome:
        with self._lock:
            running = sum(1 for j in self._jobs.values() if j.running)
            if running >= MAX_RUNNING:
                raise ToolFailure(f"{running} background jobs already run in this session (the most there can be); "
                                  "stop one with job_stop first")
            self._forget_ended(dir_fd=self._log_dir())
            jid = f"job_{self._next}"
            self._next += 1
            dir_fd = self._log_dir()
            try:
                os.unlink(f"{jid}.log", dir_fd=dir_fd)  # a leftover planted by a command
            except FileNotFoundError:
                pass
            log_fd = os.open(f"{jid}.log", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o600, dir_fd=dir_fd)
            token = proctree.new_token()
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec
            try:
                env = proctree.spawn_env(ctx.env, token)
                proc = proctree.spawn(lambda limits: proctree.start_command(
                    ["/bin/bash", "--norc", "-c", _KEEPER, "dispatchd-job", command], env, workdir, theirs.fileno(), out_w,
                    out_w, limits,
                ), ctx.limits.max_processes)
            except (OSError, subprocess.SubprocessError) as exc:  # the latter: a preexec_fn that failed
                os.close(log_fd)
                os.close(out_r)
                ours.close()
                raise ToolFailure(not_started("/bin/bash", exc)) from exc
            finally:
                os.close(out_w)  # the job has its copies
                theirs.close()
            job = Job(jid, command, proc, token, log_fd, ctx.limits.output_cap_bytes, timeout, out_fd=out_r,
                      status_fd=ours.detach(), redacting=None if ctx.redactor is None else RedactedLog(ctx.redactor))
            self._jobs[jid] = job
            try:
                threading.Thread(target=job.pump, name=f"job {jid}", daemon=True).start()
            except RuntimeError:
                # can't start new thread (the session at its process limit):
                # no job runs that nothing reads; the call fails saying why.
                self._unstart(job, dir_fd)
                raise
        return Outcome.ok(
            f"started background job {jid}: read its output with job_output (job \"{jid}\"), "
            "end it with job_stop",
            {"job": jid, "running": True, "log": f"{self.scratch}/jobs/{jid}.log"},
        )

    def _unstart(self, job: Job, dir_fd: int) -> None:
        """With ``_lock`` held: end a job whose thread could not start, and
        forget it (its processes, descriptors and log)."""
        job.kill("not started")
        job._reap(block=True)
        for fd in (job.out_fd, job.status_fd, job.log_fd):
            os.close(fd)
        del self._jobs[job.id]
        try:
            os.unlink(f"{job.id}.log", dir_fd=dir_fd)
        except OSError:
            pass

    def _forget_ended(self, dir_fd: int) -> None:
        """With ``_lock`` held: make room under ``MAX_KEPT``, oldest ended jobs first."""
        ended = [j for j in self._jobs.values() if not j.running]
        while len(self._jobs) >= MAX_KEPT and ended:
            job = ended.pop(0)
            del self._jobs[job.id]
            try:
                os.unlink(f"{job.id}.log", dir_fd=dir_fd)
            except OSError:
                pass
            os.close(job.log_fd)

    def get(self, jid: str) -> Job:
        with self._lock:
            job = self._jobs.get(jid)
            known = ", ".join(self._jobs) or "none"
        if job is None:
            raise ToolFailure(f"no background job {jid!r} in this session (jobs: {known})")
        return job

    def all(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def running(self) -> bool:
        with self._lock:
            return any(j.running for j in self._jobs.values())

    def kept(self) -> tuple[list[JobRecord], list[int], int]:
        """For a sleep (none running): the ended jobs, their logs'
        descriptors (still ours: the caller sends copies), the next number."""
        with self._lock:
            jobs = list(self._jobs.values())
            records = [JobRecord(id=j.id, command=j.command, token=j.token, cap=j.cap, written=j.written,
                                 truncated=j.truncated, exit_code=j.exit_code if j.exit_code is not None else -9,
                                 ended_by=j.ended_by) for j in jobs]
            return records, [j.log_fd for j in jobs], self._next

    def restore(self, records: list[JobRecord], fds: list[int], next_number: int) -> None:
        """After a wake: the ended jobs ``kept`` before the sleep, logs by
        descriptor (``fds``, ours from here), as they were."""
        with self._lock:
            for rec, fd in zip(records, fds):
                job = Job(rec.id, rec.command, None, rec.token, fd, rec.cap, None)
                job.written, job.truncated, job.exit_code, job.ended_by = rec.written, rec.truncated, \
                    rec.exit_code, rec.ended_by
                job.reaped = True
                self._jobs[rec.id] = job
            self._next = max(self._next, next_number)

    def close(self) -> None:
        """Stop every job and close every descriptor (the tool server never
        needs it: the session's end does both; tests and embedders do)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            dir_fd, self._dir_fd = self._dir_fd, None
        for job in jobs:
            if job.running or not job.reaped:  # an ended job's keeper: what the command left
                job.stop()
            os.close(job.log_fd)
        if dir_fd is not None:
            os.close(dir_fd)


def _jobs(ctx: ToolContext) -> Jobs:
    if ctx.jobs is None:
        raise ToolFailure("this session runs no background jobs")
    return ctx.jobs  # type: ignore[no-any-return]


def job_output(ctx: ToolContext, params: JobOutputParams) -> Outcome:
    j = _jobs(ctx).get(params.job)
    offset, wait = params.offset, params.wait
    if offset < 0:
        raise ToolFailure(f"offset must be 0 or more, not {offset}")
    if not wait >= 0:
        raise ToolFailure(f"wait must be 0 or more seconds, not {wait}")
    wait = min(wait, ctx.limits.max_command_timeout_s)
    control: CallControl | None = ctx.call
    deadline = time.monotonic() + wait
    seen = offset  # past it: what a poll has not yet looked at
    while True:
        with j.cond:
            while j.written <= seen and j.running:
                left = deadline - time.monotonic()
                if left <= 0 or (control is not None and control.cancelled.is_set()):
                    break
                j.cond.wait(min(left, _POLL_S))
            # The state before the data: "ended" then means every byte is in the log.
            running, exit_code, state, seen = j.running, j.exit_code, j.state(), j.written
        # A tail that could begin a secret waits for the next poll (jobwindow.py).
        text, used = read_window(j.read, offset, ctx.limits.output_cap_bytes, ctx.redactor, more=running)
        if used or not running or time.monotonic() >= deadline or (control is not None and control.cancelled.is_set()):
            break  # else all there is waits, held back: wait for what comes after it
    meta: dict[str, Any] = {
        "job": j.id,
        "next_offset": offset + used,
        "running": running,
        "exit_code": exit_code,
        "state": state,
        "truncated": j.truncated,
    }
    if control is not None and control.cancelled.is_set():
        meta["cancelled"] = True
    notes = []
    if j.truncated and offset + used >= j.written:
        notes.append(f"[job output truncated at {j.cap} bytes; later output was dropped]")
    # Metadata never reaches a model: the footer tells it where it stands.
    notes.append(f"[job {j.id} {state}; next_offset {offset + used}]")
    body = text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(notes)
    return Outcome.ok(body, meta)


def job_stop(ctx: ToolContext, params: JobStopParams) -> Outcome:
    j = _jobs(ctx).get(params.job)
    was_running = j.running
    # Even after the job ended, what it left behind (setsid cmd > log &) goes.
    j.stop()
    state = j.state()
    text = f"job {j.id} {state}" if was_running else f"job {j.id} had already ended ({state})"
    return Outcome.ok(text, {"job": j.id, "running": j.running, "exit_code": j.exit_code, "state": state})


def job_list(ctx: ToolContext, params: JobListParams) -> Outcome:
    jobs = _jobs(ctx).all()
    if not jobs:
        return Outcome.ok("no background jobs", {"jobs": []})
    lines = []
    listed = []
    for j in jobs:
        command = " ".join(j.command.split())
        if len(command) > 200:
            command = command[:199] + "…"
        # One job a line, and nothing a terminal acts on (ESC, a bidi override):
        # ``dispatch jobs`` prints this to the user as dispatchd's own words.
        lines.append(f"{j.id}\t{j.state()}\t{one_line(command)}")
        listed.append({"job": j.id, "state": j.state(), "running": j.running, "exit_code": j.exit_code,
                       "command": j.command})
    return Outcome.ok("\n".join(lines), {"jobs": listed})
