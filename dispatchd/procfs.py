"""Process trees read from ``/proc`` (daemon and worker side).

``children_by_stat(parent)``: (pid, state) of every child of ``parent``,
zombies included, read from each process's ``stat`` (slower than a
``children`` file, but it needs none and counts every thread's children).

``descendants(pid)``: ``pid`` first, then every process below it, found
through each thread's ``children`` file (a child of any thread counts), by a
loop (no recursion, whatever the depth). A process that exits meanwhile is
skipped; one born meanwhile may be missed: callers that must miss none
(``proctree.kill_subtree``) look again until a look finds nothing new.
"""

from __future__ import annotations

import os

__all__ = ["children_by_stat", "descendants"]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    return found


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
