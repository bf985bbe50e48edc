"""Waiting for one descriptor, whatever its number.

``readable`` uses poll, never select: select refuses descriptors above 1,023
(``ValueError: filedescriptor out of range``), and the daemon holds thousands
(a thousand sessions: their pidfds, channels and namespaces).
"""

from __future__ import annotations

import select


def readable(fd: int, timeout_s: float) -> bool:
    """Whether ``fd`` becomes readable (a pidfd: its process has exited)
    within ``timeout_s`` (0: now, without waiting)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0.0, timeout_s) * 1000))
