"""Process trees read from ``/proc`` (daemon and worker side).

``children_by_stat(parent)``: (pid, state) of every child of ``parent``,
zombies included, read from each process's ``stat`` (slower than a
``children`` file, but it needs none and counts every thread's children).

``thread_children(pid)``: the children of every thread of ``pid``.

``live_stat(pid)``: (ppid, pgrp, session) of a live process; None for a
zombie or one gone.

``descendants(pid)``: ``pid`` first, then every process below it, found
through each thread's ``children`` file (a child of any thread counts), by a
loop (no recursion, whatever the depth). A process that exits meanwhile is
skipped; one born meanwhile may be missed: callers that must miss none
(``proctree.kill_subtree``) look again until a look finds nothing new.
"""

from __future__ import annotations

import os

__all__ = ["children_by_stat", "descendants", "live_stat", "thread_children"]


def thread_children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(thread_children(p))
    return found


def live_stat(pid: int | str) -> tuple[int, int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces or ')': split after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    if len(fields) < 4 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[2]), int(fields[3])


def children_by_stat(parent: int) -> list[tuple[int, bytes]]:
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces or ')': split after the last ')'.
        fields = raw[raw.rfind(b")") + 2 :].split()
        if len(fields) >= 2 and int(fields[1]) == parent:
            found.append((int(name), fields[0]))
    return found
