"""Sandboxes made ahead: a session's open without the kernel's slow steps.

Most of what opening a session costs does not depend on the session: the
namespaces and pid 1 (one ``clone3``), the root with its system binds,
``/dev``, ``/proc`` and the ``pivot_root`` (which walks every thread on the
machine), loopback, the network stack. A sandbox made ahead has done those
(``session_init.confine_shared``) and waits; at open it is given the
session's plan and worktree and applies the rest (``confine_session``:
the session's own binds, the host's root detached, rlimits, capabilities,
Landlock, seccomp), as a fresh one would.

Guarantees:
- a sandbox made ahead serves one session, and only one: ``take`` removes it
  from the pool; one that is never taken is killed (``let_go``) when it is
  retired: too old, its kind no longer among the recent ones, the daemon
  stopping;
- it runs no code of a session's before the whole plan is applied (it holds
  the host's root until then);
- a session gets one only when its plan has the ``pool_key`` the sandbox was
  made for (checked by the daemon and again by the sandbox); otherwise, or
  when giving it its session fails, the session's sandbox is made at open, as
  without a pool: a pool can make an open faster, never different;
- making them never holds up an open for long: one at a time, on a thread
  of their own; an open that finds none waits for the one of its kind being
  made, if one is, at most ``TAKE_WAIT_S`` (it is most of the way there, and
  a second made beside it takes the same CPUs), else makes its own;
- at most ``size`` per kind (policy and network mode), for the ``kinds`` most
  recently opened, each at most ``max_age_s`` old, and only for kinds opened
  in the last ``idle_s`` (an idle daemon keeps none, and makes none);
- never a mount table older than the open: a sandbox made ahead holds a copy
  of the host's from when it was made, and binds the session's paths from
  it. Once the host's changes (a mount or an unmount, seen on the daemon's
  ``/proc/self/mountinfo``, which the kernel flags ``POLLPRI``), every sandbox
  made before is let go (at the next take, or within ``MOUNTS_CHECK_S``:
  a filesystem the user unmounted is not kept busy), and none is made for
  ``MOUNTS_SETTLE_S`` (a host whose mounts churn gets sandboxes made at
  open, not a pool that makes and discards).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from dispatchd import fdwait, protocol
from dispatchd.confine import netstack
from dispatchd.daemon.planahead import Planned
from dispatchd.daemon.spawn import Worker
from dispatchd.netmodes import NetworkMode

log = logging.getLogger("dispatchd.pool")

Kind = tuple[str, NetworkMode]  # (policy, network mode)
RETRY_S = 10.0  # after a kind failed to be made ahead
MAX_AGE_S = 30.0
AFTER_OPEN_S = 0.02  # a refill waits this long after an open (its first calls), unless its kind has none left
AFTER_CLOSE_S = 0.005  # and this long after a close (its reply goes first)
KINDS = 4
# A kind not opened for this long is kept no more: its sandboxes are let go
# and none is made until its next open (made at open, as without a pool). An
# idle daemon then makes nothing: each sandbox made ahead lives MAX_AGE_S,
# so a pool kept for ever remakes its sandboxes (and their pastas) twice a
# minute, every minute (measured: 8 in 65 s, 280 ms of CPU, two kinds).
IDLE_S = 300.0
# How long an open that finds no sandbox of its kind waits for the one being
# made (a make takes 5-10 ms idle, a few times that loaded; one made at open
# takes as long and more, beside it): past it, the open makes its own.
TAKE_WAIT_S = 0.1
MOUNTS_CHECK_S = 1.0  # how often the host's mount table is looked at while sandboxes wait
MOUNTS_SETTLE_S = 1.0  # after it changed, before the next sandbox is made


class MountWatch:
    """Whether the mount table of this process's mount namespace (the
    host's, for the daemon) has changed since the last look: the kernel flags
    an open ``mountinfo`` ``POLLPRI`` (and ``POLLERR``) once per change."""

    def __init__(self, path: str = "/proc/self/mountinfo") -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLPRI)

    def changed(self) -> bool:
        return bool(self._poll.poll(0))  # only POLLPRI (and POLLERR) are reported: a change

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Made:
    """One sandbox made ahead, and what the daemon set up for it."""

    kind: Kind
    sid: str  # the session id it was made for (its cgroup, its plan)
    key: bytes  # ``pool_key`` of that plan
    worker: Worker
    control: protocol.FrameSocket
    ns_fds: tuple[int, int] | None = None  # its user and network namespaces
    door: tuple[socket.socket, socket.socket] | None = None  # the DNS relay's door it made, until its stack starts
    net: netstack.NetworkPlan | None = None  # how its network is held
    stack: netstack.Stack | None = None  # its network stack, started
    cgroup: str = ""
    scratch: str = ""  # its session's scratch directory, made with it (until a session takes it)
    made: float = field(default_factory=time.monotonic)
    planned: Planned | None = None  # its session's plan made ahead (planahead.py), used if equal by content

    # The attribute the daemon's network code reads of a session: the same here.
    @property
    def id(self) -> str:
        return self.sid

    def alive(self) -> bool:
        """False once its process, or its network stack, has exited (a pidfd
        is readable then): a sandbox whose stack is gone would give its
        session no way out, where one made at open has its stack."""
        for pidfd in (self.worker.pidfd, self.stack.pidfd if self.stack is not None else None):
            if pidfd is not None and (pidfd < 0 or fdwait.readable(pidfd, 0)):
                return False
        return True


class SandboxPool:
    """``size`` sandboxes made ahead per kind, for the ``kinds`` most recent.

    ``make(kind)`` makes one (None: that kind cannot be made ahead; raises on
    a failure); ``let_go(made)`` kills one never used and frees what it held.
    Both are called on the pool's own thread (``let_go`` also from ``stop``).
    """

    def __init__(self, *, size: int, make: Callable[[Kind], Made | None], let_go: Callable[[Made], None],
                 kinds: int = KINDS, max_age_s: float = MAX_AGE_S, idle_s: float = IDLE_S,
                 mounts_changed: Callable[[], bool] | None = None) -> None:
        self.size = size
        # Set by start (a MountWatch of the daemon's mountinfo) unless given (tests).
        self._mounts_changed = mounts_changed
        self._mounts: MountWatch | None = None
        self._epoch = 0  # changes of the host's mount table seen so far
        self._settle_until = 0.0
        self._quiet_until = 0.0  # no refill before (want: an open's first calls)
        self._make = make
        self._let_go = let_go
        self._kinds = kinds
        self._max_age_s = max_age_s
        self._idle_s = idle_s
        self._last_open: dict[Kind, float] = {}  # when each kind was last wanted (an open, or the start)
        self._ready: dict[Kind, list[Made]] = {}
        self._wanted: OrderedDict[Kind, None] = OrderedDict()  # most recent last
        self._not_before: dict[Kind, float] = {}  # after a failure
        self._notes: dict[Kind, str] = {}  # why a kind is not made ahead
        self._never: set[Kind] = set()  # kinds that cannot be made ahead (asked again after a while)
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the pool's thread waits on it
        self._made = threading.Condition(lock)  # opens waiting for the make under way
        self._making: Kind | None = None  # the kind being made now, if any
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.served = 0  # sessions given a sandbox made ahead
        self.asked = 0  # opens that asked for one (``take``)

    def start(self, kind: Kind | None) -> None:
        """Start making sandboxes, first of ``kind`` (the default policy's)."""
        if self.size <= 0 or self._thread is not None:
            return
        if self._mounts_changed is None:
            self._mounts = MountWatch()
            self._mounts_changed = self._mounts.changed
        if kind is not None:
            self.want(kind)
        thread = threading.Thread(target=self._run, daemon=True, name="pool")
        thread.start()  # at the daemon's start: one that cannot start a thread stops there, saying so
        self._thread = thread

    def want(self, kind: Kind) -> None:
        """A session of ``kind`` was opened: keep some ready (the most recent
        ``kinds`` kinds; the least recent beyond them is let go)."""
        if self.size <= 0:
            return
        with self._cond:
            if kind in self._never and time.monotonic() < self._not_before.get(kind, 0.0):
                return  # cannot be made ahead (no root of its own): takes no place among the kinds
            self._never.discard(kind)
            self._last_open[kind] = time.monotonic()
            self._wanted[kind] = None
            self._wanted.move_to_end(kind)
            while len(self._wanted) > 4 * self._kinds:  # remembered beyond those kept, for a while
                self._wanted.popitem(last=False)
            # The session just opened makes its first calls now: a refill
            # (a clone3 and its confinement, ~5 ms of CPU) waits for them.
            self._quiet_until = time.monotonic() + AFTER_OPEN_S
            self._cond.notify()

    def idle(self) -> None:
        """A session is being closed: its calls are over, so a refill waiting
        for an open's first calls (``AFTER_OPEN_S``) waits only for the
        close's reply (``AFTER_CLOSE_S``). Opened back to back, each open
        pushed the wait on, and a kind taken by one session was not made
        again before the next session of that kind came."""
        if self.size <= 0:
            return
        with self._cond:
            self._quiet_until = min(self._quiet_until, time.monotonic() + AFTER_CLOSE_S)
            self._cond.notify()

    def _kept(self, idle: bool = False) -> list[Kind]:
        """Under the lock: the kinds sandboxes are kept for, most recent first
        (none not opened for ``idle_s``); with ``idle``, those left out for that."""
        now = time.monotonic()
        return [k for k in reversed(self._wanted) if k not in self._never
                and (now - self._last_open.get(k, now) > self._idle_s) == idle][:self._kinds]

    def take(self, kind: Kind, wait_s: float = TAKE_WAIT_S) -> Made | None:
        """A sandbox made ahead for ``kind``, now the caller's alone (to adopt
        or to let go), or None: none ready, and none of that kind made within
        ``wait_s`` by the make under way. The caller says ``want(kind)`` once
        its open is done: a refill made meanwhile would compete with it for
        the CPUs (measured: the open's own steps took twice as long)."""
        found = None
        dead: list[Made] = []
        deadline = time.monotonic() + wait_s
        with self._cond:
            self.asked += 1
            while True:
                dead += self._stale()  # made with a mount table older than the host's now
                ready = self._ready.get(kind, [])
                while ready and found is None:
                    made = ready.pop(0)  # the oldest first: fewer reach their age unused
                    if made.alive():
                        found = made
                    else:
                        dead.append(made)
                left = deadline - time.monotonic()
                if found is not None or self._making != kind or left <= 0 or self._stopped:
                    break
                self._made.wait(left)  # the make's end (kept, let go, or failed) wakes it
        for made in dead:
            self._let_go(made)
        return found

    def _stale(self) -> list[Made]:
        """Under the lock: every ready sandbox, taken out, when the host's
        mount table has changed since the last look; else none."""
        if self._mounts_changed is None or not self._mounts_changed():
            return []
        self._epoch += 1
        self._settle_until = time.monotonic() + MOUNTS_SETTLE_S
        stale = [m for ready in self._ready.values() for m in ready]
        self._ready.clear()
        if stale:
            log.info("event=pool_mounts_changed let_go=%d", len(stale))
        return stale

    def served_one(self) -> None:
        with self._cond:
            self.served += 1

    def stop(self) -> None:
        """Make no more, and let go of those made (the daemon is stopping)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            self._made.notify_all()
            left = [m for ready in self._ready.values() for m in ready]
            self._ready.clear()
        if self._thread is not None:
            self._thread.join(timeout=15)  # a make in flight ends within the ready timeout
        for made in left:
            self._let_go(made)
        if self._mounts is not None and (self._thread is None or not self._thread.is_alive()):
            self._mounts.close()

    def report(self) -> str:
        """What ``status`` says of the pool."""
        if self.size <= 0:
            return "off (dispatchd --pool 0): every session's sandbox is made at open"
        with self._cond:
            kept = self._kept()
            parts = []
            for kind in kept:
                note = self._notes.get(kind)
                n = len(self._ready.get(kind, []))
                parts.append(f"{kind[0]}/{kind[1]}: {n} ready" + (f" ({note})" if note else ""))
            for kind, note in self._notes.items():
                if kind not in kept:
                    parts.append(f"{kind[0]}/{kind[1]}: {note}")
            idle = [f"{k[0]}/{k[1]}" for k in self._kept(idle=True) if k not in self._notes]
            if idle:
                parts.append(f"none kept for {', '.join(idle)} (no open for {self._idle_s:g} s: "
                             "the next is made at open, then kept again)")
        return (f"{self.size} per kind of session (policy/network), for the {self._kinds} kinds most "
                f"recently opened, each at most {self._max_age_s:g} s old; {self.served} of {self.asked} "
                f"opens so far served by one"
                + ("; " + "; ".join(parts) if parts else ""))

    # --- the pool's thread -----------------------------------------------------

    def _next(self) -> tuple[list[Made], Kind | None, float]:
        """Under the lock: what to let go, what to make, how long to sleep."""
        old = self._stale()
        now = time.monotonic()
        kept = self._kept()
        for kind in list(self._ready):
            keep = kind in kept
            ready = self._ready[kind]
            old += [m for m in ready if not keep or now - m.made > self._max_age_s]
            self._ready[kind] = [m for m in ready if keep and now - m.made <= self._max_age_s]
        wake = self._max_age_s
        if any(self._ready.values()):
            wake = min(wake, MOUNTS_CHECK_S)  # a filesystem unmounted meanwhile is let go of soon
        if now < self._settle_until:
            return old, None, min(wake, self._settle_until - now)  # the host's mounts are changing
        short = []
        for kind in kept:  # the most recent first
            later = self._not_before.get(kind, 0.0) - now
            if later > 0:
                wake = min(wake, later)
                continue
            if len(self._ready.get(kind, [])) < self.size:
                short.append(kind)
        if short:
            # The wait for an open's first calls holds while every kind short
            # of sandboxes still has one: a kind with none would have its next
            # open make its own (a whole make, network stack and all, on that
            # open's path), far worse than a refill beside a first call. Back
            # to back, the wait let sessions take a kind's last sandbox before
            # its refill began: a quarter of the opens found none.
            if now < self._quiet_until and all(self._ready.get(k) for k in short):
                return old, None, self._quiet_until - now
            # The kind with the fewest ready, the most recent of those: kinds
            # opened in turn are made in turn (the most recent first starved
            # the other while opens of one kind took each as it was made).
            return old, min(short, key=lambda k: len(self._ready.get(k, []))), 0.0
        for ready in self._ready.values():
            for m in ready:
                wake = min(wake, m.made + self._max_age_s - now)
        return old, None, max(wake, 0.05)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                old, kind, sleep = self._next()
                if kind is None and not old:
                    self._cond.wait(sleep)
                    continue
            try:
                for made in old:
                    self._let_go(made)
                if kind is not None:
                    self._make_one(kind)
            except Exception:  # a bug: say so, and keep the pool going (it retires what it made)
                log.exception("event=pool_error")
                time.sleep(RETRY_S / 10)

    def _make_one(self, kind: Kind) -> None:
        with self._cond:
            epoch = self._epoch
            self._making = kind
        try:
            self._make_kept(kind, epoch)
        finally:
            with self._cond:
                self._making = None
                self._made.notify_all()

    def _make_kept(self, kind: Kind, epoch: int) -> None:
        try:
            made = self._make(kind)
        except Exception as exc:  # logged and shown by status; opens go on without
            log.warning("event=pool_make_failed kind=%s/%s error=%s", kind[0], kind[1], exc)
            with self._cond:
                self._notes[kind] = f"not made ahead: {exc}; retried every {RETRY_S:g} s"
                self._not_before[kind] = time.monotonic() + RETRY_S
            return
        with self._cond:
            if made is None:
                self._notes[kind] = "not made ahead: its sessions have no root of their own (degraded mode, " \
                                    "or root = \"host\")"
                self._not_before[kind] = time.monotonic() + RETRY_S * 6
                self._never.add(kind)
                return
            self._notes.pop(kind, None)
            old = self._stale()
            # A change seen while it was made: its copy may be older than the host's.
            keep = not self._stopped and kind in self._kept() and self._epoch == epoch
            if keep:
                self._ready.setdefault(kind, []).append(made)
                self._made.notify_all()  # before the lock is let go: an open waiting takes it first
        for m in old:
            self._let_go(m)
        if not keep:
            self._let_go(made)
