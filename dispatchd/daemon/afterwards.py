"""What a session's end leaves to finish after its reply: one thread.

A close answers once the session's processes are gone and its worktree
checked (sessions.py). What is left then changes nothing anyone can see or
rely on, and the kernel makes it slow:

- a network stack (pasta) already sent SIGKILL: its exit (the tap device's
  removal waits for RCU grace periods: 20-40 ms here) is waited for here,
  and its pidfd closed. The way out is shut when SIGKILL is sent: a killed
  process runs none of its own code again, so pasta copies no byte after it;
- the fsync that makes a trusted baseline's record's removal durable
  (baselines.py): a daemon that dies meanwhile leaves the removal done
  (the page cache is the kernel's); only a machine's crash can undo it,
  and then the next start checks the worktree against that record, which
  moves aside, and never deletes, what changed since;
- the worktree watch its tool server made and handed over (``WatchHeld``):
  the last close of an inotify instance waits for the kernel to tear its
  marks down (grace periods, 2-20 ms measured), nothing anyone waits for;
- the session's scratch directory (its ``/tmp`` and home): its processes are
  gone, and its removal waits in the kernel for their mount namespace's
  teardown. Its lock goes once it is gone: a daemon that dies meanwhile
  leaves both, and the next start removes it.

Not here: the namespaces' own teardown (a mount namespace's unmounts). Moved
after the reply, it ran into the next open and slowed it by about what the
close gained; it stays on the close's path.

Guarantees: each job runs once, in the order given, on the one thread
(started at the first job); a job that raises is logged and the next runs;
``drain`` returns once every job given before it has run (the daemon's stop
calls it, so nothing given here outlives the daemon's sessions).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

from dispatchd import fdwait
from dispatchd.durable import fsync_directory

log = logging.getLogger("dispatchd.afterwards")

_jobs: queue.SimpleQueue[Callable[[], None] | threading.Event] = queue.SimpleQueue()
_started = False
_start_lock = threading.Lock()


def _run() -> None:
    while True:
        job = _jobs.get()
        if isinstance(job, threading.Event):
            job.set()
            continue
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - one job's failure is logged, the next ones still run
            log.error("event=afterwards_failed error=%r", exc)


def later(job: Callable[[], None]) -> None:
    """Run ``job`` on the thread, after those given before it; where the
    thread cannot be started (the user's process limit reached: "can't
    start new thread"), at once, here: a clean-up skipped for it left an
    open's claim on a worktree, its scratch and its record behind until a
    restart."""
    global _started
    inline = ""
    if not _started:
        with _start_lock:
            if not _started:
                try:
                    threading.Thread(target=_run, daemon=True, name="afterwards").start()
                    _started = True
                except RuntimeError as exc:
                    inline = str(exc)
    if inline:  # the lock let go first: the job may give one of its own (run inline too)
        log.warning("event=afterwards_inline why=%r", inline)
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - logged as on the thread; the caller's clean-up goes on
            log.error("event=afterwards_failed error=%r", exc)
        return
    _jobs.put(job)


def reap(pidfd: int, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for the process of ``pidfd``, already sent
    SIGKILL, to have exited, then close ``pidfd``; its parent reaps it."""
    def job() -> None:
        try:
            if not fdwait.readable(pidfd, timeout_s):
                log.warning("event=exit_not_seen pidfd_wait_s=%g", timeout_s)
        finally:
            os.close(pidfd)
    later(job)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` on the thread: a record's removal made
    durable (baselines.py). Until it is, a machine that crashes brings the
    record back, and the next start checks against it (moving aside, never
    deleting, what changed since)."""
    later(lambda: fsync_directory(path))


def drain(timeout_s: float = 10.0) -> bool:
    """Wait until every job given so far has run; False on timeout."""
    if not _started:
        return True
    done = threading.Event()
    _jobs.put(done)
    return done.wait(timeout_s)
