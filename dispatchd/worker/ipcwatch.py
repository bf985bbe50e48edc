"""System V memory a session holds in its IPC namespace, told to the daemon.

A System V shared memory segment outlives every process that mapped it, and
a message queue holds what was sent to it: memory no process's PSS shows, so
the daemon's memory watchdog (``daemon/watchdog.py``) did not see it, and a
session of 64 MiB held 1 GiB in segments it had written and detached. Only a
process in the session's IPC namespace can read what the namespace holds
(``/proc/sysvipc`` shows the reader's), and no one but the kernel's root of
the namespace may set ``kernel.shm_rmid_forced`` there; the tool server, pid
1 of the session, reads it and tells the daemon (``IpcHeld``), which adds it
to the session's sum.

Guarantees, in full mode (the session's own IPC namespace; without one
seccomp refuses System V IPC):
- the figure is every segment's resident and swapped bytes and every queue's
  bytes, attached or not (``held_bytes``); the watchdog subtracts the PSS of
  the segments the session's processes map, so nothing counts twice;
- while any process of the session runs (only a process can make or fill a
  segment) it is read every ``INTERVAL_S``, the watchdog's own interval, and
  sent when it changed; once none runs, read and sent once more, then the
  thread sleeps until the next command starts: an idle session pays nothing;
- read once when a woken session's tool server starts (its namespace may
  hold segments from before its sleep), on the starting thread; a new
  session's namespace holds nothing: no look, and no thread of its own
  until the first command.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from dispatchd import threads

INTERVAL_S = 0.2  # the memory watchdog's (daemon/watchdog.py)


def held_bytes(proc: str = "/proc") -> int:
    """The bytes the IPC namespace of this process holds in System V shared
    memory (resident and swapped) and message queues."""
    return (_column_sum(f"{proc}/sysvipc/shm", ("rss", "swap"))
            + _column_sum(f"{proc}/sysvipc/msg", ("cbytes",)))


def _column_sum(path: str, names: tuple[str, ...]) -> int:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:  # a kernel without System V IPC: nothing held
        return 0
    if not lines:
        return 0
    header = lines[0].split()
    columns = [header.index(n.encode()) for n in names if n.encode() in header]
    total = 0
    for line in lines[1:]:
        fields = line.split()
        for c in columns:
            try:
                total += int(fields[c])
            except (IndexError, ValueError):
                continue
    return total


def others_running() -> bool:
    """Whether a process other than this one runs in the session's pid
    namespace (its own /proc: the tool server is its pid 1)."""
    me = str(os.getpid())
    return any(e.isdigit() and e != me for e in os.listdir("/proc"))


def watch(send: Callable[[int], None], spawned: threading.Event, last: int = 0,
          running: Callable[[], bool] = others_running, held: Callable[[], int] = held_bytes) -> NoReturn:
    """Send ``held()`` whenever it changed from ``last``, looking every
    ``INTERVAL_S`` while ``running()``, then once more, then waiting for
    ``spawned`` (set at every command's start)."""
    while True:
        spawned.wait()
        spawned.clear()  # before the looks: a start after this one sets it again
        while True:
            busy = running()
            now = held()
            if now != last:
                send(now)
                last = now
            if not busy:
                break
            time.sleep(INTERVAL_S)


def start(send: Callable[[int], None], spawned: threading.Event,
          after_first_spawn: Callable[[Callable[[], bool]], None], look_now: bool = False) -> None:
    """Have ``watch`` started on a thread of its own at the first command's
    start; ``look_now`` (a woken session, whose namespace may hold what was
    made before its sleep): look once first, and send it if anything is
    held. A new session's namespace holds nothing yet."""
    first = held_bytes() if look_now else 0
    if first:
        send(first)

    def begin() -> bool:
        try:
            threads.Thread(target=watch, args=(send, spawned, first), daemon=True, name="ipc-watch").start()
        except RuntimeError:  # can't start new thread: the next spawn tries again
            return False
        return True

    after_first_spawn(begin)
