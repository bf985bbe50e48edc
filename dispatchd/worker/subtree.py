"""The fork server's ending of what it holds but did not mean to: whole trees.

The fork server is a child subreaper. A process it did not start on purpose
(anything but a session's first process or a running network stack) lands
on it when its parent dies: the orphans of a session whose init was killed,
what a stopped stack forked. Such a process may have forked in turn, and a
tree can be built to fork again as soon as a parent goes: ending the fork
server's direct children alone leaves its grandchildren, which become the
next direct children, for ever.

Guarantees:
- ``plan_kill`` is pure: from a snapshot of the tree (each process's
  children, the ones no longer live), every live descendant of each child
  of the root that is not spared, deepest first;
- ``end_subtrees`` repeats snapshot, plan, kill and reap until one pass finds
  no live process in those trees, or its deadline passed: on a return
  before it, every process of them has exited (a zombie has closed its
  descriptors, a tap device's with them) and what was reparented to the
  root is reaped;
- deepest first, a process is killed before its parent, so none of them
  sees its parent die; a SIGKILLed process cannot complete a fork (the
  kernel refuses one with a fatal signal pending); what was forked between
  a snapshot and its kill is in the next pass's snapshot;
- only those trees are signalled: each pid's parent is read again, the
  shallowest first, and must be the root (for a child not spared) or a pid
  confirmed so before it; then, deepest first, the pid is opened as a
  pidfd, its parent read once more (still the one confirmed), and SIGKILL
  sent through the pidfd, which never names another process: a pid reused
  between the snapshot and the kill fails that check, and one reused after
  it is not the pidfd's process (``ESRCH``, nothing sent);
- a pass is linear in the trees' size: each pid's parent is read twice,
  whatever the depth (a chain of 2,000 under a stack took 53 s of reads
  when every kill read its whole chain of parents again).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Collection, Mapping, Sequence

from dispatchd import procfs

__all__ = ["end_subtrees", "plan_kill"]

def plan_kill(root: int, spared: Collection[int], children: Mapping[int, Sequence[int]],
              not_live: Collection[int]) -> list[tuple[int, int]]:
    """The (pid, parent) pairs to kill, deepest first: every live process
    below a child of ``root`` not in ``spared`` (that child included), each
    with the parent the snapshot saw it under. ``children`` maps a pid to
    its children's; ``not_live`` lists the zombies (and the gone)."""
    found: list[tuple[int, int, int]] = []  # (depth, pid, parent)
    seen = {root}
    todo = [(pid, root, 1) for pid in children.get(root, ()) if pid not in spared]
    while todo:
        pid, parent, depth = todo.pop()
        if pid in seen:  # a snapshot read while the tree changed may list a pid twice
            continue
        seen.add(pid)
        if pid not in not_live:
            found.append((depth, pid, parent))
        todo.extend((child, pid, depth + 1) for child in children.get(pid, ()))
    found.sort(key=lambda item: -item[0])
    return [(pid, parent) for _, pid, parent in found]


def end_subtrees(root: int, spared: Collection[int], deadline_s: float = 0.0) -> list[int]:
    """Kill (``plan_kill``) every tree below a child of ``root`` (this
    process) not in ``spared``, again until a pass finds none live or
    ``deadline_s`` has passed (0: one pass, the fork server's periodic
    sweep). Returns the pids killed, each once. A pass reads each process's
    parent a bounded number of times, whatever the trees' depth: a chain of
    thousands is ended in one pass of a few thousand reads."""
    ended: dict[int, None] = {}
    deadline = time.monotonic() + deadline_s
    while True:
        direct = _children_of(root)
        if not any(pid not in spared for pid in direct):
            return list(ended)  # the fork server's half-second case: one read, nothing else
        children, not_live = _snapshot(root, direct, spared)
        for pid in direct:
            if pid not in spared and pid in not_live:
                _reap(pid)
        plan = plan_kill(root, spared, children, not_live)
        if not plan:
            return list(ended)
        below = _confirmed(root, spared, plan)
        for pid, parent in plan:
            if (pid, parent) in below and _kill_if_under(pid, parent):
                ended[pid] = None
        if time.monotonic() >= deadline:
            return list(ended)
        time.sleep(0.001)  # the killed exit, and hand their children to the root


def _confirmed(root: int, spared: Collection[int], plan: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """The pairs of ``plan`` whose parent, read again now (once a pid, the
    shallowest first), is the one planned and is the root (for a child not
    spared) or a pid already confirmed: so each is, now, below a child of
    the root not spared. Linear: a chain's every link is never read again
    for each link below it."""
    ok: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    for pid, parent in reversed(plan):  # shallowest first
        if parent == root and pid in spared:
            continue
        if (parent == root or parent in ok) and _parent(pid) == parent:
            ok.add(pid)
            pairs.add((pid, parent))
    return pairs


def _children_of(root: int) -> list[int]:
    """The root's children: its main thread's ``children`` file (the fork
    server is single-threaded), read with os.open/os.read: every half second,
    the fewest objects (what the fork server writes after a fork is copied
    for the newest worker)."""
    try:
        fd = os.open(f"/proc/{root}/task/{root}/children", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        raw = b"".join(iter(lambda: os.read(fd, 65536), b""))
    except OSError:
        return []
    finally:
        os.close(fd)
    return [int(pid) for pid in raw.split()]


def _snapshot(root: int, direct: list[int], spared: Collection[int]) -> tuple[dict[int, list[int]], set[int]]:
    """Each process's children below the root's children not spared (every
    thread's children count), and which of them are not live."""
    children: dict[int, list[int]] = {root: direct}
    not_live: set[int] = set()
    for top in direct:
        if top in spared:
            continue
        for pid in procfs.descendants(top):
            if pid in children:
                continue
            if _parent(pid) is None:
                not_live.add(pid)
            children[pid] = procfs.thread_children(pid)
    return children, not_live


def _parent(pid: int) -> int | None:
    """The parent of a live process; None when it is gone or a zombie."""
    st = procfs.live_stat(pid)
    return None if st is None else st[0]


def _kill_if_under(pid: int, parent: int) -> bool:
    """SIGKILL ``pid`` through a pidfd, once the process it names is seen
    still to be a child of ``parent`` (confirmed below the root this pass);
    whether it was sent. A pid reused since is another process: its parent
    is not ``parent`` unless it is itself a child of that tree's process."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone
    try:
        if _parent(pid) != parent:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False  # exited since the check: the pidfd names it still, no other process
    finally:
        os.close(pidfd)


def _reap(pid: int) -> None:
    """A child of ours that has exited: reaped (a pid only ours to wait for)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
