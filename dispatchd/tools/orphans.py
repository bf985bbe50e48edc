"""What a call that returned by itself left running, ended before it returns.

Guarantees:
- ``end_leftovers`` ends what the call's bash left running (``cmd &``,
  ``setsid env -i cmd &``, a fork loop that returned at once), in a process
  that ``adopt_orphans`` made a child subreaper (the tool server): when bash
  exits, the kernel gives its live descendants to the nearest subreaper
  above it, this process. Every child of ours that no ``proctree.spawn`` of
  ours started (``proctree.owns``) is then an orphan of a call whose bash
  has exited: a running call's orphans stay below its living bash (a child
  subreaper, ``proctree``), a background job's below its keeper
  (``jobs.py``, which ``spawn`` started). Those, and everything below them,
  are killed in rounds until a look finds none, and reaped; then the call
  returns.
- Orphans are handed to a subreaper's first live thread, its main thread
  (the kernel's ``find_alive_thread``), which in the tool server lives as
  long as the process: one read of its ``children`` file finds them all (on
  a kernel without that file, every process's stat). With nothing left, the
  whole of it takes about 9 µs.
- Only pids ``owns`` does not know are waited for: a call's bash and a job's
  keeper keep their status for their own thread.
- In a process that does not adopt orphans (a test runner, whose own
  children would look like leftovers) it ends nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from dispatchd import procfs
from dispatchd.tools import proctree

__all__ = ["adopt_orphans", "adopting", "end_leftovers"]


_adopting = False
_SWEEP_LOCK = threading.Lock()  # one sweep at a time: each counts what it ends for its call
# Processes one call's sweep ended for another call (by their marker), until
# that call's own sweep collects the count. Bounded: a count is collected at
# once, or never (a call that had returned already cannot have left one).
_ENDED_FOR: dict[str, int] = {}
_MAX_ENDED_FOR = 1024


def adopt_orphans() -> None:
    """Make this process a child subreaper, so that ``end_leftovers`` finds
    what an ended call left (see the module docstring). The tool server calls
    it once, before its first command; a process with children of its own
    that it did not start with ``spawn`` (a test runner) must not, since
    every such child would count as left by a call."""
    global _adopting
    proctree.set_subreaper()
    _adopting = True


def adopting() -> bool:
    return _adopting


def _reap_orphan(pid: int) -> bool | None:
    """Reap a zombie child that is no command of ours: True when reaped,
    False when it cannot be yet (a thread-group leader that exited while
    its other threads run: alive, to be killed), None when it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped meanwhile (the session's reaper thread)
        return None


def _marker_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    start = (b"\0" + env).find(f"\0{proctree.MARKER}=".encode())
    if start < 0:
        return None
    return env[start + len(proctree.MARKER) + 1:].split(b"\0", 1)[0].decode("ascii", "replace")


def _orphans(me: int) -> list[int]:
    """Live processes below the children of ours that ``owns`` does not know
    (orphans of ended calls), those children included; zombie children
    reaped on the way."""
    try:
        with open(f"/proc/{me}/task/{me}/children", "rb") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: the slow way, as exact
        children = _zombie_or_live_children(me)
    found: list[int] = []
    for child in children:
        if proctree.owns(child):
            continue
        if proctree.live_stat(str(child)) is None:  # a zombie, or gone
            reaped = _reap_orphan(child)
            if reaped is None or reaped:
                continue
        found.append(child)
        found += [pid for pid in procfs.descendants(child)[1:] if proctree.live_stat(str(pid)) is not None]
    return found


def _zombie_or_live_children(me: int) -> list[int]:
    return [pid for pid, _state in procfs.children_by_stat(me)]


def end_leftovers(token: str, budget_s: float = proctree.KILL_BUDGET_S) -> int:
    """End every process the calls that returned left running (see the
    module docstring); how many of them were this call's (``token``), or
    carried no marker. 0 at once in a process that does not adopt orphans.

    Called once the call's bash has exited (its descendants are ours then).
    Kills by pid, as ``kill_subtree`` does: a pid is reused only after the
    whole pid space was gone through (the kernel allocates them in turn)."""
    if not _adopting:
        return 0
    me = os.getpid()
    with _SWEEP_LOCK:
        signalled: set[int] = set()
        mine = 0
        deadline = time.monotonic() + budget_s
        while found := _orphans(me):
            for pid in found:
                if pid not in signalled:
                    signalled.add(pid)
                    owner = _marker_of(pid)
                    if owner is None or owner == token:
                        mine += 1
                    elif len(_ENDED_FOR) < _MAX_ENDED_FOR:
                        _ENDED_FOR[owner] = _ENDED_FOR.get(owner, 0) + 1
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)  # the killed exit, and hand their children to us
        return mine + _ENDED_FOR.pop(token, 0)
