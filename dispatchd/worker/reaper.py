"""The orphan reaper of a session whose tool server is its pid 1.

In full mode the tool server is pid 1 of the session's pid namespace: every
process whose parent exits (``cmd &`` in a finished call, a double fork) is
re-parented to it, and its exit leaves a zombie that holds a pid of the
session's budget until pid 1 waits for it. ``reap_orphans`` runs on a thread
of its own and waits for them.

Guarantees:
- an orphan's zombie is reaped as soon as it appears, or, while a command's
  own zombie is waiting for its ``Popen`` (see below), within a second;
- the exit status of a command the tool server started (``proctree.spawn``)
  is never taken: ``owns(pid)`` says so, and ``Popen.wait`` gets it (a stolen
  status would read as ``ECHILD``, which ``subprocess`` reports as exit 0);
- with no child at all it sleeps until the next spawn: no process can appear
  in the namespace otherwise (pid 1 is the ancestor of every other). For the
  same reason its thread is started at the session's first spawn
  (``start_at_first_spawn``), not before: an idle session has one thread less.

``waitid(P_ALL, WNOWAIT)`` reports the oldest zombie first. When that one is
a command's own (its Popen reaps it in a moment, or, for a background job
whose output is still held open, later), the others are found in the
session's own ``/proc`` (zombies whose parent is pid 1) and reaped by pid,
with a growing pause in between instead of a spin.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from dispatchd import procfs, threads

_MAX_PAUSE_S = 1.0


def start_at_first_spawn(owns: Callable[[int], bool], born: threading.Event,
                         after_first_spawn: Callable[[Callable[[], bool]], None]) -> None:
    """Have ``reap_orphans`` started on a thread of its own right after the
    first command is spawned (``proctree.after_first_spawn``). Until then no
    child exists, so there is nothing to reap. Should the thread fail to start
    (the session at its process limit: the server's reserve used up), the
    next spawn tries again. Its start does not wait for it to run
    (``threads.Thread``): it is started on the first command's path, where
    that wait, the scheduler's, was 0.6-1.0 ms of the call (a new thread
    queued behind the command's own start); nobody joins it."""

    def start() -> bool:
        try:
            threads.Thread(target=reap_orphans, args=(owns, born), daemon=True, name="reaper").start()
        except RuntimeError:  # can't start new thread
            return False
        return True

    after_first_spawn(start)


def reap_orphans(owns: Callable[[int], bool], born: threading.Event) -> NoReturn:
    pause = 0.0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # no child at all
            born.wait()
            born.clear()
            continue
        except InterruptedError:
            continue
        if info is None:
            continue
        if not owns(info.si_pid):
            _reap(info.si_pid)
            pause = 0.0
            continue
        pause = 0.0 if _reap_hidden(owns) else min(max(pause * 2, 0.001), _MAX_PAUSE_S)
        time.sleep(pause)


def _reap(pid: int) -> bool:
    """Whether a zombie was reaped: a thread-group leader that exited while
    its other threads run shows as Z in /proc but cannot be waited for yet
    (counting it as reaped would make the pause 0: a spin)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return False


def _reap_hidden(owns: Callable[[int], bool]) -> int:
    """Reap the orphans' zombies a command's own zombie hides from ``waitid``."""
    me = os.getpid()
    reaped = 0
    for pid in _zombie_children(me):
        if not owns(pid) and _reap(pid):
            reaped += 1
    return reaped


def _zombie_children(parent: int) -> list[int]:
    return [pid for pid, state in procfs.children_by_stat(parent) if state == b"Z"]
