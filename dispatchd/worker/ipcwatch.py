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
- the figure is every segment's resident and swapped bytes, every queue's
  bytes and its messages' headers, every semaphore set's semaphores, and each
  object's own header, attached or not, and for every set the undo record
  each running task may hold for it (``held_bytes``); the watchdog
  subtracts the PSS of the segments the session's processes map, so nothing
  counts twice;
- while any process of the session runs (only a process can make or fill a
  segment) it is read every ``INTERVAL_S``, the watchdog's own interval, the
  first time one interval after the command's start, and sent when it
  changed; once none runs, read and sent once more, then the thread sleeps
  until the next command starts: an idle session pays nothing;
- no command runs unwatched: the thread is started before the first command
  (``proctree.before_spawn``), and a command is refused while it cannot be;
- read once when a woken session's tool server starts (its namespace may
  hold segments from before its sleep), on the starting thread; a new
  session's namespace holds nothing: no look, and no thread of its own
  until the first command.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from dispatchd import threads

INTERVAL_S = 0.2  # the memory watchdog's (daemon/watchdog.py)
# However long a look takes, the next is at most this far: memory grown
# since is seen within it (a look of 32,000 queues, 86 ms, is then under a
# tenth of a core).
MAX_INTERVAL_S = 1.0


# What the kernel takes for each object beyond its bytes (Linux 6.x): a
# message is a ``msg_msg`` in kmalloc-64 even when empty (a queue holds up to
# msgmnb of them: 1 MiB of headers, its payload 0), a semaphore a
# cache-line-aligned ``struct sem``, and each queue, set or segment a header.
MESSAGE_COST = 64
SEMAPHORE_COST = 64
OBJECT_COST = 256
# A task that changes a set with SEM_UNDO gets the kernel's ``sem_undo`` for
# it: this header and two bytes per semaphore of the set, in one kmalloc
# rounded up to a power of two, kept until the task exits or the set goes. No
# file shows who holds one, so every task of the session but this one counts
# as holding one for every set: 400 processes each holding one for 20 sets of
# 32,000 held 570 MiB, uncounted, in a session of 64 MiB.
UNDO_HEADER = 64


def held_bytes(proc: str = "/proc") -> int:
    """The bytes the IPC namespace of this process holds in System V IPC:
    shared memory (resident and swapped), message queues (their bytes and
    each message's header) and semaphore sets, each object's header too, and
    for each set the undo record every other task of the session may hold."""
    total = 0
    for fields in _rows(f"{proc}/sysvipc/shm", ("rss", "swap")):
        total += fields[0] + fields[1] + OBJECT_COST
    for fields in _rows(f"{proc}/sysvipc/msg", ("cbytes", "qnum")):
        total += fields[0] + fields[1] * MESSAGE_COST + OBJECT_COST
    sets = _rows(f"{proc}/sysvipc/sem", ("nsems",))
    holders = _tasks(proc) if sets else 0  # read only when a set exists: most sessions have none
    for fields in sets:
        total += fields[0] * SEMAPHORE_COST + OBJECT_COST + holders * _undo_cost(fields[0])
    return total


def _undo_cost(nsems: int) -> int:
    """What one task's undo record for a set of ``nsems`` takes."""
    return 1 << (UNDO_HEADER + 2 * nsems - 1).bit_length()


def _tasks(proc: str) -> int:
    """The tasks of the session but this process's: threads count one by
    one, since a thread cloned without CLONE_SYSVSEM has undo records of its
    own."""
    me = str(os.getpid())
    count = 0
    for entry in os.listdir(proc):
        if entry.isdigit() and entry != me:
            try:
                count += len(os.listdir(f"{proc}/{entry}/task"))
            except OSError:  # ended meanwhile
                pass
    return count


def _rows(path: str, names: tuple[str, ...]) -> list[list[int]]:
    """The columns ``names`` of each row of a /proc/sysvipc file (a column
    this kernel lacks reads as 0)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:  # a kernel without System V IPC: nothing held
        return []
    if not lines:
        return []
    header = lines[0].split()
    columns = [header.index(n.encode()) if n.encode() in header else -1 for n in names]
    rows = []
    for line in lines[1:]:
        fields = line.split()
        row = []
        for c in columns:
            try:
                row.append(int(fields[c]) if c >= 0 else 0)
            except (IndexError, ValueError):
                row.append(0)
        rows.append(row)
    return rows


def others_running() -> bool:
    """Whether a process other than this one runs in the session's pid
    namespace (its own /proc: the tool server is its pid 1)."""
    me = str(os.getpid())
    return any(e.isdigit() and e != me for e in os.listdir("/proc"))


def watch(send: Callable[[int], None], spawned: threading.Event, last: int = 0,
          running: Callable[[], bool] = others_running, held: Callable[[], int] = held_bytes) -> NoReturn:
    """Send ``held()`` whenever it changed from ``last``, looking every
    ``INTERVAL_S`` while ``running()``, then once more, then waiting for
    ``spawned`` (set at every command's start). A look that takes long (tens
    of thousands of objects: 86 ms for 32,000 queues) spaces the next ones,
    so that looking stays under a twentieth of a core, but never past
    ``MAX_INTERVAL_S``."""
    pause = INTERVAL_S
    while True:
        spawned.wait()
        spawned.clear()  # before the looks: a start after this one sets it again
        while True:
            # The first look an interval after the command's start, as every
            # next one: a command that ends sooner is looked at once, after
            # it, and nothing is read beside its start (a look there took
            # CPU from the command's first moments).
            time.sleep(pause)
            busy = running()
            began = time.thread_time()  # the look's own CPU: a busy machine's waits do not space it
            now = held()
            took = time.thread_time() - began
            if now != last:
                send(now)
                last = now
            pause = min(max(INTERVAL_S, 20 * took), MAX_INTERVAL_S)
            if not busy:
                break


class Watch:
    """The watch of one tool server: its thread started before the first
    command (``ensure``, which ``proctree.spawn`` calls first), so that no
    command runs unwatched."""

    def __init__(self, send: Callable[[int], None], spawned: threading.Event, last: int) -> None:
        self._send, self._spawned, self._last = send, spawned, last
        self._lock = threading.Lock()
        self.started = False

    def ensure(self) -> None:
        """Started, or ``OSError(EAGAIN)``: the command is refused, as one
        refused for want of a process (its words say so)."""
        if self.started:
            return
        with self._lock:
            if self.started:
                return
            try:
                threads.Thread(target=watch, args=(self._send, self._spawned, self._last), daemon=True,
                               name="ipc-watch").start()
            except RuntimeError as exc:  # can't start new thread
                raise OSError(errno.EAGAIN, f"{os.strerror(errno.EAGAIN)} (the session's System V watch "
                                            f"cannot start a thread: {exc})") from exc
            self.started = True


def start(send: Callable[[int], None], spawned: threading.Event,
          before_spawn: Callable[[Callable[[], None]], None], look_now: bool = False) -> Watch:
    """A ``Watch`` whose thread ``before_spawn`` starts at the first
    command's start, before the command; ``look_now`` (a woken session, whose
    namespace may hold what was made before its sleep): look once first, and
    send it if anything is held. A new session's namespace holds nothing yet."""
    first = held_bytes() if look_now else 0
    if first:
        send(first)
    w = Watch(send, spawned, first)
    before_spawn(w.ensure)
    return w
