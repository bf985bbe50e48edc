"""The session memory bound where no cgroup holds it: a watchdog in the daemon.

With a delegated cgroup and its memory controller, ``memory.max`` bounds a
session (``confine/cgroups.py``). Without one, only RLIMIT_DATA bounds each
process, and three processes of 3 GiB took 9 GiB. This module closes that:
every ``INTERVAL_S`` one daemon thread sums the memory of each such session's
processes and ends a session over its ``limits.session_memory_bytes``.

Guarantees and costs:
- the processes counted are every descendant of the session's first process
  (W1): the session init reaps orphans (pid 1 of its namespace, or a child
  subreaper), so a command that detached (``setsid``, double fork) is still one;
- the cheap sum is resident memory (``/proc/PID/statm``), which counts a page
  shared by several processes once per process; only when that sum is over the
  limit is the proportional set size (``smaps_rollup`` PSS, shared pages split
  between their sharers) summed, and that decides: a fork of many small
  processes sharing their pages is not ended by mistake;
- a session over its limit is ended whole (every process), with
  ``reason=memory`` in the log and the amount and limit in its client's error;
- its cost: 0.1 ms a look for a session of 3 processes, 2 ms for 100, 30 ms
  for 1,000 (then it looks less often: at most a fifth of one core);
- memory files count: memfds and ``/dev/shm`` files a process of the session
  holds open are added (their allocated bytes, each file once; a mapped one
  is in the PSS already and not added again), and so does what the session's
  IPC namespace holds in System V segments and message queues, as its tool
  server tells (``worker/ipcwatch.py``; the segments its processes map are
  subtracted, being in their PSS);
- what it does not bound: memory allocated faster than it looks (a process may
  go over for up to one interval, at most ``max_data_bytes`` per process), and
  memory that is no process's (socket buffers, pipes, a memfd only held by a
  message in flight, tmpfs files no process holds open): SECURITY.md and
  docs/budgets.md have the numbers. A cgroup bounds all of these.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

from dispatchd import procfs, threads
from dispatchd.errors import ConfinementError
from dispatchd.protocol.reports import MemoryHold

log = logging.getLogger("dispatchd.watchdog")
INTERVAL_S = 0.2
_PAGE = os.sysconf("SC_PAGE_SIZE")
_MEMORY_FILES = ("/memfd:", "/dev/shm/")  # what a descriptor of a memory file reads as


def mechanism(cgroup_memory: bool, limit: int) -> MemoryHold:
    """What holds a session's memory, for ``status``."""
    if cgroup_memory:
        return MemoryHold(mechanism="cgroup", limit_bytes=limit, detail="memory.max over the session's cgroup")
    return MemoryHold(mechanism="watchdog", limit_bytes=limit, interval_s=INTERVAL_S,
                      detail=f"the daemon sums the PSS of the session's processes every {INTERVAL_S:g} s "
                             "and ends the session over the limit")


descendants = procfs.descendants  # the processes counted: W1 and every process below it


def rss_bytes(pids: Iterable[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
    return total


def pss_bytes(pids: Iterable[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, IndexError, ValueError):
            continue
    return total


def _shared_files(pids: Iterable[int]) -> dict[tuple[int, int], int]:
    """Memory files (memfds, ``/dev/shm``) the processes hold open:
    ``(dev, inode) -> bytes allocated``, each counted once however many hold it."""
    found: dict[tuple[int, int], int] = {}
    for p in pids:
        base = f"/proc/{p}/fd"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{base}/{fd}")
                if not target.startswith(_MEMORY_FILES):
                    continue
                st = os.stat(f"{base}/{fd}")
            except OSError:
                continue
            found[(st.st_dev, st.st_ino)] = st.st_blocks * 512  # allocated: a sparse one costs nothing
    return found


def _mapped_files(pids: Iterable[int]) -> tuple[set[tuple[int, int]], list[int]]:
    """``(dev, inode)`` of the memory files the processes map: their pages
    are in the PSS already; and the processes that map a System V segment."""
    mapped: set[tuple[int, int]] = set()
    sysv: list[int] = []
    for p in pids:
        try:
            with open(f"/proc/{p}/maps", "rb") as f:
                for line in f:
                    if b"/SYSV" in line and (not sysv or sysv[-1] != p) and _is_segment(line):
                        sysv.append(p)
                    if b"/memfd:" not in line and b"/dev/shm/" not in line:
                        continue
                    fields = line.split(None, 5)
                    major, minor = (int(x, 16) for x in fields[3].split(b":"))
                    mapped.add((os.makedev(major, minor), int(fields[4])))
        except (OSError, ValueError, IndexError):
            continue
    return mapped, sysv


_shm_dev: list[int] = []


def _shm_device() -> int:
    """The device of the kernel's internal shmem mount, which holds every
    System V segment (and every memfd): a memfd's, looked at once."""
    if not _shm_dev:
        fd = os.memfd_create("dispatchd-shm-device", os.MFD_CLOEXEC)
        try:
            _shm_dev.append(os.fstat(fd).st_dev)
        finally:
            os.close(fd)
    return _shm_dev[0]


def _is_segment(line: bytes) -> bool:
    """Whether a maps (or smaps header) line maps a System V segment: by its
    device, the kernel's shmem mount, and a path the kernel gives segments
    alone there ("/SYSV" and the key; a memfd's is "/memfd:..."). Not by name
    only: a file named " /SYSV..." of the worktree, or of the session's own
    /dev/shm, is on another device."""
    fields = line.split(None, 5)
    if len(fields) < 6 or not fields[5].startswith(b"/SYSV"):
        return False
    try:
        major, minor = (int(x, 16) for x in fields[3].split(b":"))
    except ValueError:
        return False
    return os.makedev(major, minor) == _shm_device()


def _sysv_pss(pids: Iterable[int]) -> int:
    """The PSS of the System V segments the processes map: counted in their
    PSS already, and in what their IPC namespace holds (``ipcwatch``)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps", "rb") as f:
                inside = False
                for line in f:
                    if line[:1].isalnum() and b"-" in line.split(None, 1)[0]:  # a mapping's first line
                        inside = b"/SYSV" in line and _is_segment(line)
                    elif inside and line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def over_limit(pid: int, limit: int, ipc: int = 0) -> int | None:
    """The session's memory when it is over ``limit``, else None: the PSS of
    its processes, the memory files (memfd, shmem) they hold open and
    ``ipc``, the bytes its IPC namespace holds in System V memory
    (``worker/ipcwatch.py``). A memory file is no process's resident memory
    until mapped, nor is a segment no process maps: 10 GiB written into
    memfds by a process of 9 MiB, and 1 GiB in detached segments, went past
    the limit unseen."""
    pids = descendants(pid)
    files = _shared_files(pids)
    # The cheap sum counts a mapped memory file or segment twice (its pages
    # are resident too): it only decides whether to look closer.
    if rss_bytes(pids) + sum(files.values()) + ipc <= limit:
        return None
    mapped, sysv = _mapped_files(pids)
    used = pss_bytes(pids) + sum(size for key, size in files.items() if key not in mapped)
    if ipc:
        used += max(0, ipc - _sysv_pss(sysv))
    return used if used > limit else None


class MemoryWatchdog:
    """One thread for every session the cgroup does not bound.

    ``sessions()`` yields (session id, session init pid, limit, System V
    bytes its IPC namespace holds); ``end(sid, used, limit)``
    ends one (safe to call for a session already gone). ``any_session()``:
    whether the daemon has a session at all, in any state: with none, the
    thread sleeps until the next open asks (``ensure_running``), rather than
    wake five times a second in an idle daemon. While any session exists it
    looks every ``INTERVAL_S``, whatever they are doing: a session asleep may
    be woken, or its sandbox replaced, without an open, and is watched from
    its first look after that."""

    def __init__(self, sessions: Callable[[], list[tuple[str, int, int, int]]],
                 end: Callable[[str, int, int], None],
                 any_session: Callable[[], bool] = lambda: True) -> None:
        self._sessions = sessions
        self._end = end
        self._any_session = any_session
        self._runner = threads.Once(self._run, "memory-watchdog")
        self._asked = threading.Event()  # a session to watch may have come (set by ensure_running)

    def start(self) -> None:
        """The thread running, started if need be; ``ConfinementError``
        where it cannot be (the daemon's threads at the user's limit): an
        open calls this before it makes anything, and is refused then, never
        opened unwatched. A failed start is tried again by the next call."""
        try:
            self._runner.start()
        except RuntimeError as exc:  # can't start new thread
            raise ConfinementError("the memory bound", detail=f"the memory watchdog cannot start its "
                                   f"thread ({exc}): the daemon's processes and threads are at the "
                                   "user's limit; retry once commands or sessions end") from exc

    def ensure_running(self) -> None:
        """A session the cgroup does not bound has opened (call once it can
        be listed by ``sessions()``): watch it, starting the thread if need be."""
        self.start()
        self._asked.set()

    def _run(self) -> None:
        took = 0.0
        while True:
            # A session of a thousand processes takes 30 ms to sum: looking
            # less often then keeps the daemon's share of a core under 20 %.
            time.sleep(max(INTERVAL_S, 4 * took))
            self._asked.clear()  # before the look: an open after it wakes the wait below
            started = time.perf_counter()
            try:
                self.check_once()
            except Exception:  # a bug must not stop the bound for every other session
                log.exception("event=watchdog_error")
            took = time.perf_counter() - started
            if not self._any_session():
                self._asked.wait()  # no session at all: until an open asks

    def check_once(self) -> None:
        for sid, pid, limit, ipc in self._sessions():
            started = time.perf_counter()
            used = over_limit(pid, limit, ipc)
            if used is not None:
                log.warning("event=memory_exceeded session=%s pss_bytes=%d limit_bytes=%d scan_ms=%.1f",
                            sid, used, limit, (time.perf_counter() - started) * 1e3)
                self._end(sid, used, limit)
