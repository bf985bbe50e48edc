"""The interpreter's at-fork hooks, left out of the fork server's forks.

``threading`` and ``logging`` register hooks that every ``os.fork`` (and the
fork server's ``clone3``, which runs the same hooks) calls: in the child,
``threading`` rebuilds its table of threads and re-makes their locks, and
``logging`` re-makes the lock it took in the parent (``before``) and every
handler's. They exist for a fork taken while other threads run, which may
hold those locks or be in those tables. The fork server never has a second
thread, so in its children they rebuild what is already right; and they are
the first Python code a worker runs: measured on the fork server's modules,
a sleeping child of an ``os.fork`` holds 980 KiB of private pages with them
and 510 KiB without them.

Guarantees:
- ``leave_out`` (the fork server, once, at its start) takes those hooks out
  of the interpreter's lists, and only when this process has exactly one
  thread and finds each hook exactly where ``os.register_at_fork`` put it;
  otherwise it changes nothing. ``random``'s reseed stays: each session gets
  its own random state.
- ``put_back`` (the fork server's child) puts them back where they were: a
  worker, which starts threads, forks (degraded mode's tool server) with
  every hook, as any process does. Its parent's state was single-threaded at
  the fork, which is all the hooks would have restored.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading

# (list, index, hook): the interpreter's at-fork lists and what was taken out.
_taken: list[tuple[list[object], int, object]] = []


def _hooks() -> list[object]:
    # Those os.register_at_fork was given (threading.py, logging/__init__.py):
    # the child's, then logging's before and after_in_parent pair, which
    # Python 3.13 renamed (_acquireLock and _releaseLock on 3.11 and 3.12).
    pair = ("_acquireLock", "_releaseLock") if sys.version_info < (3, 13) else ("_prepareFork", "_afterFork")
    names = (
        (threading, "_after_fork"),
        (logging, "_after_at_fork_child_reinit_locks"),
        (logging, pair[0]),
        (logging, pair[1]),
    )
    return [getattr(module, name) for module, name in names if hasattr(module, name)]


def leave_out() -> bool:
    """Take ``threading``'s and ``logging``'s at-fork hooks out of this
    process's forks; True when done (all of them or none)."""
    if _taken or threading.active_count() != 1 or len(os.listdir("/proc/self/task")) != 1:
        return False
    hooks = _hooks()
    if len(hooks) != 4:
        return False
    found: list[tuple[list[object], int, object]] = []
    for hook in hooks:
        # The interpreter keeps them in plain lists (``before_forkers``,
        # ``after_forkers_parent``, ``after_forkers_child``); logging's pair
        # are also module globals, found through the same referrers.
        lists = [r for r in gc.get_referrers(hook) if type(r) is list and r is not hooks and r.count(hook) == 1]
        if len(lists) != 1:
            return False
        found.append((lists[0], lists[0].index(hook), hook))
    # Highest index first in each list, so that put_back can insert in the
    # reverse order and find every position as it was.
    found.sort(key=lambda t: (id(t[0]), -t[1]))
    for lst, index, _ in found:
        del lst[index]
    _taken.extend(found)
    return True


def put_back() -> None:
    """In a child of the fork server: every hook where it was."""
    for lst, index, hook in reversed(_taken):
        lst.insert(index, hook)
    _taken.clear()
