"""Process trees read from ``/proc`` (daemon and worker side).

``descendants(pid)``: ``pid`` first, then every process below it, found
through each thread's ``children`` file (a child of any thread counts), by a
loop (no recursion, whatever the depth). A process that exits meanwhile is
skipped; one born meanwhile may be missed: callers that must miss none
(``proctree.kill_subtree``) look again until a look finds nothing new.
"""

from __future__ import annotations

import os

__all__ = ["descendants"]


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
