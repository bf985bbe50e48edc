"""dispatchd.daemon.pool.SandboxPool's bookkeeping, with fake sandboxes (pure
logic: real ones are made in tests/integration/test_pool.py)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dispatchd import protocol
from dispatchd.daemon import pool as pool_mod
from dispatchd.daemon.pool import Kind, Made, SandboxPool
from dispatchd.daemon.spawn import Worker

OFF: Kind = ("default", "off")
ON: Kind = ("default", "on")


class Fakes:
    """make() returns a fake sandbox whose "pidfd" is a pipe's read end: it
    reads as exited once ``die`` closes the write end."""

    def __init__(self) -> None:
        self.made: list[Made] = []
        self.let_go: list[Made] = []
        self.fail: Exception | None = None
        self.cannot: set[Kind] = set()
        self._ends: dict[int, int] = {}
        self.lock = threading.Lock()

    def make(self, kind: Kind) -> Made | None:
        if self.fail is not None:
            raise self.fail
        if kind in self.cannot:
            return None
        r, w = os.pipe()
        a, b = socket.socketpair()
        b.close()
        made = Made(kind=kind, sid=f"s{len(self.made)}", key=b"k", worker=Worker(1000 + len(self.made), r),
                    control=protocol.FrameSocket(a))
        with self.lock:
            self._ends[r] = w
            self.made.append(made)
        return made

    def release(self, made: Made) -> None:
        with self.lock:
            self.let_go.append(made)
        w = self._ends.pop(made.worker.pidfd, -1)
        if w >= 0:
            os.close(w)
        made.worker.close()
        made.control.close()

    def die(self, made: Made) -> None:
        os.close(self._ends.pop(made.worker.pidfd))


@pytest.fixture
def fakes() -> Iterator[Fakes]:
    f = Fakes()
    yield f
    for w in f._ends.values():
        os.close(w)


def until(cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def ready(p: SandboxPool, kind: Kind) -> int:
    with p._cond:
        return len(p._ready.get(kind, []))


def test_it_fills_the_first_kind_and_hands_each_sandbox_out_once(fakes: Fakes) -> None:
    p = SandboxPool(size=2, make=fakes.make, let_go=fakes.release)
    assert p.take(OFF) is None  # not started: nothing made
    p.start(OFF)
    until(lambda: ready(p, OFF) == 2)
    # The pool's thread back asleep before the takes: a take between its second make and its next look
    # found a kind with none left, and the look made a third at once (a kind left with none is refilled).
    time.sleep(0.3)
    a, b = p.take(OFF), p.take(OFF)
    assert a is not None and b is not None and a is not b
    assert p.take(OFF) is None  # refilled only once the caller says it wants more
    p.want(OFF)
    until(lambda: ready(p, OFF) == 2)
    c = p.take(OFF)
    assert c is not None and c not in (a, b)
    p.stop()
    assert {m.sid for m in fakes.let_go} == {m.sid for m in fakes.made} - {a.sid, b.sid, c.sid}
    for m in (a, b, c):
        fakes.release(m)  # the callers' (a session's end, in the daemon)


def test_a_close_ends_the_wait_an_open_set_for_the_refill(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refill waits after an open for the session's first calls; a close
    says they are over, and it waits only for the close's reply. (Opened
    back to back, each open pushed the wait on: a network-on session's
    sandbox was not made again before the next one came.)"""
    monkeypatch.setattr(pool_mod, "AFTER_CLOSE_S", 0.0)
    p = SandboxPool(size=2, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 2)
    monkeypatch.setattr(pool_mod, "AFTER_OPEN_S", 30.0)
    taken = p.take(OFF)
    assert taken is not None
    p.want(OFF)  # the open is done: its first calls come
    time.sleep(0.2)
    assert ready(p, OFF) == 1  # the twin: while they may run, no refill
    p.idle()  # the session is closed
    until(lambda: ready(p, OFF) == 2, timeout=5)
    p.stop()
    fakes.release(taken)


def test_a_kind_left_with_none_is_refilled_at_once_first_calls_or_not(
        fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its next open would make its own sandbox, on its path: the refill does
    not wait for the first calls of the open that took the last one. The
    twin: with one left, it waits (the test above)."""
    p = SandboxPool(size=2, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 2)
    monkeypatch.setattr(pool_mod, "AFTER_OPEN_S", 30.0)
    monkeypatch.setattr(pool_mod, "AFTER_CLOSE_S", 30.0)
    taken = [p.take(OFF), p.take(OFF)]
    assert None not in taken
    p.want(OFF)  # the open that took the last one is done; no close comes
    until(lambda: ready(p, OFF) == 1, timeout=5)
    time.sleep(0.2)
    assert ready(p, OFF) == 1  # one there: the rest waits for the first calls, as before
    p.stop()
    for m in taken:
        assert m is not None
        fakes.release(m)


def test_a_sandbox_that_died_is_let_go_not_handed_out(fakes: Fakes) -> None:
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 1)
    dead = fakes.made[0]
    fakes.die(dead)
    assert p.take(OFF) is None
    assert dead in fakes.let_go
    p.stop()


def test_only_the_most_recent_kinds_are_kept(fakes: Fakes) -> None:
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release, kinds=2)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 1)
    p.want(ON)
    until(lambda: ready(p, ON) == 1)
    p.want(("read-only", "off"))  # a third kind: the least recent (OFF) goes
    until(lambda: ready(p, ("read-only", "off")) == 1)
    until(lambda: any(m.kind == OFF for m in fakes.let_go))
    assert ready(p, OFF) == 0 and ready(p, ON) == 1
    p.stop()


def test_sandboxes_are_remade_when_too_old(fakes: Fakes) -> None:
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release, max_age_s=0.2)
    p.start(OFF)
    until(lambda: len(fakes.made) >= 3)  # made, retired, made again ...
    assert fakes.made[0] in fakes.let_go
    assert all(time.monotonic() - m.made <= 0.2 + 0.1 for m in p._ready.get(OFF, []))
    p.stop()


def test_a_kind_not_opened_for_a_while_is_let_go_and_made_again_at_its_next_open(fakes: Fakes) -> None:
    """An idle daemon makes nothing: without this, each sandbox made ahead
    reached its age and was remade, twice a minute, for ever."""
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release, idle_s=0.3)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 1)
    until(lambda: fakes.made[0] in fakes.let_go, timeout=10)  # no open since: let go
    made = len(fakes.made)
    time.sleep(0.5)
    assert len(fakes.made) == made and ready(p, OFF) == 0  # and none made while idle
    assert "none kept for default/off (no open for 0.3 s" in p.report()
    p.want(OFF)  # an open of that kind (made at open): kept again
    until(lambda: ready(p, OFF) == 1, timeout=5)
    assert "none kept" not in p.report()
    p.stop()


def test_a_kind_that_fails_is_said_and_retried_later(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "RETRY_S", 0.2)
    fakes.fail = OSError("clone3: no more processes")
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    until(lambda: "not made ahead: clone3: no more processes" in p.report())
    assert p.take(OFF) is None
    fakes.fail = None
    until(lambda: ready(p, OFF) == 1)  # after RETRY_S
    assert "not made ahead" not in p.report()
    p.stop()


def test_a_kind_that_cannot_be_made_ahead_takes_no_place(fakes: Fakes) -> None:
    fakes.cannot.add(("host-root", "off"))
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release, kinds=1)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 1)
    p.want(("host-root", "off"))
    until(lambda: "host-root/off: not made ahead: its sessions have no root of their own" in p.report())
    until(lambda: ready(p, OFF) == 1)
    gone = len(fakes.let_go)
    p.want(("host-root", "off"))  # known now: it takes no place from OFF
    time.sleep(0.05)
    assert ready(p, OFF) == 1 and len(fakes.let_go) == gone
    p.stop()


def test_off_makes_nothing_and_says_so(fakes: Fakes) -> None:
    p = SandboxPool(size=0, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    p.want(OFF)
    assert p.take(OFF) is None and fakes.made == []
    assert p.report().startswith("off (dispatchd --pool 0)")


def test_stop_lets_every_sandbox_go_and_makes_no_more(fakes: Fakes) -> None:
    p = SandboxPool(size=2, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 2)
    p.stop()
    assert sorted(m.sid for m in fakes.let_go) == sorted(m.sid for m in fakes.made)
    p.want(OFF)
    time.sleep(0.05)
    assert len(fakes.made) == 2


class Mounts:
    """A host mount table that changes when told (``MountWatch.changed``'s
    stand-in: True once per change)."""

    def __init__(self) -> None:
        self.pending = False

    def change(self) -> None:
        self.pending = True

    def changed(self) -> bool:
        was, self.pending = self.pending, False
        return was


def _watching(fakes: Fakes, size: int) -> tuple[SandboxPool, Mounts]:
    """A pool of ``size`` sandboxes of OFF, started, that watches ``Mounts``."""
    mounts = Mounts()
    p = SandboxPool(size=size, make=fakes.make, let_go=fakes.release, mounts_changed=mounts.changed)
    p.start(OFF)
    return p, mounts


def test_a_change_of_the_hosts_mounts_lets_go_of_every_sandbox_made_before(
        fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "MOUNTS_SETTLE_S", 1.0)
    p, mounts = _watching(fakes, 2)
    p.want(ON)
    until(lambda: ready(p, OFF) == 2 and ready(p, ON) == 2)
    before = list(fakes.made)
    mounts.change()
    changed = time.monotonic()
    assert p.take(OFF) is None  # none made before the change is given
    assert sorted(m.sid for m in fakes.let_go) == sorted(m.sid for m in before)
    made = len(fakes.made)
    time.sleep(0.15)
    if time.monotonic() - changed < 1.0:  # still within the settling time (a loaded machine may be past it)
        assert len(fakes.made) == made  # none made while the mounts settle
    until(lambda: ready(p, OFF) == 2 and ready(p, ON) == 2)
    taken = p.take(OFF)
    assert taken is not None and taken not in before
    fakes.release(taken)
    p.stop()


def test_waiting_sandboxes_are_let_go_soon_after_a_change_without_an_open(
        fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unmounted filesystem is not kept busy until the next open."""
    monkeypatch.setattr(pool_mod, "MOUNTS_CHECK_S", 0.05)
    p, mounts = _watching(fakes, 1)
    until(lambda: ready(p, OFF) == 1)
    first = fakes.made[0]
    mounts.change()
    until(lambda: first in fakes.let_go)
    p.stop()


def test_a_sandbox_made_while_the_mounts_changed_is_not_kept(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "MOUNTS_SETTLE_S", 0.05)
    mounts = Mounts()
    made = fakes.make

    def make_during_a_change(kind: Kind) -> Made | None:
        m = made(kind)
        if len(fakes.made) == 1:
            mounts.change()
        return m

    p = SandboxPool(size=1, make=make_during_a_change, let_go=fakes.release, mounts_changed=mounts.changed)
    p.start(OFF)
    until(lambda: ready(p, OFF) == 1)
    taken = p.take(OFF)
    assert fakes.made[0] in fakes.let_go and taken is fakes.made[1]
    fakes.release(taken)
    p.stop()


def test_mount_watch_sees_no_change_of_its_own() -> None:
    watch = pool_mod.MountWatch()
    try:
        assert watch.changed() is False
    finally:
        watch.close()


def test_a_bug_in_letting_go_does_not_stop_the_pool(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_mod, "RETRY_S", 0.2)
    calls = {"n": 0}

    def flaky_release(made: Made) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            fakes.release(made)
            raise RuntimeError("a bug")
        fakes.release(made)

    p = SandboxPool(size=1, make=fakes.make, let_go=flaky_release, max_age_s=0.2)
    p.start(OFF)
    until(lambda: calls["n"] >= 2)  # retired again after the error: the thread lives on
    until(lambda: ready(p, OFF) == 1)
    p.stop()


class Gated(Fakes):
    """make() of ``gate_kind`` waits for ``go``: a make under way, held."""

    def __init__(self, gate_kind: Kind) -> None:
        super().__init__()
        self.gate_kind = gate_kind
        self.go = threading.Event()
        self.started = threading.Event()

    def make(self, kind: Kind) -> Made | None:
        if kind == self.gate_kind:
            self.started.set()
            assert self.go.wait(30)
        return super().make(kind)  # raises ``fail``, if set


def _gated(kind: Kind) -> tuple[Gated, SandboxPool]:
    """A pool whose first make, of ``kind``, is under way and held."""
    fakes = Gated(kind)
    p = SandboxPool(size=1, make=fakes.make, let_go=fakes.release)
    p.start(kind)
    assert fakes.started.wait(30)
    return fakes, p


def _take_beside(p: SandboxPool, kind: Kind, wait_s: float) -> tuple[threading.Thread, list[Made | None]]:
    got: list[Made | None] = []
    t = threading.Thread(target=lambda: got.append(p.take(kind, wait_s)))
    t.start()
    return t, got


def test_an_open_that_finds_none_waits_for_the_one_of_its_kind_being_made() -> None:
    fakes, p = _gated(OFF)  # the first make is under way, and held
    t, got = _take_beside(p, OFF, 30.0)
    time.sleep(0.1)
    assert t.is_alive() and got == []  # waiting, not making its own
    fakes.go.set()
    t.join(30)
    assert got and got[0] is fakes.made[0]  # the one made, handed to the open that waited
    assert ready(p, OFF) == 0
    p.stop()
    fakes.release(got[0])


def test_an_open_of_another_kind_or_with_nothing_under_way_does_not_wait() -> None:
    fakes, p = _gated(ON)
    started = time.monotonic()
    assert p.take(OFF, 30.0) is None  # ON is being made, not OFF: at once
    assert time.monotonic() - started < 10
    fakes.go.set()
    until(lambda: ready(p, ON) == 1)
    taken = p.take(ON, 30.0)
    assert taken is not None
    started = time.monotonic()
    assert p.take(ON, 30.0) is None  # none ready, none under way (the refill waits for want()): at once
    assert time.monotonic() - started < 10
    p.stop()
    fakes.release(taken)


def test_an_open_waiting_for_a_make_that_fails_goes_on_without(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes, p = _gated(OFF)
    fakes.fail = OSError("the fork server is gone")  # the make under way fails once let go on
    t, got = _take_beside(p, OFF, 30.0)
    time.sleep(0.1)
    assert t.is_alive()
    started = time.monotonic()
    fakes.go.set()
    t.join(30)
    assert got == [None] and time.monotonic() - started < 10  # woken by the failure, not the wait's end
    p.stop()


def test_an_open_waits_no_longer_than_it_was_told() -> None:
    fakes, p = _gated(OFF)
    started = time.monotonic()
    assert p.take(OFF, 0.2) is None
    assert 0.15 < time.monotonic() - started < 10
    fakes.go.set()
    until(lambda: ready(p, OFF) == 1)
    p.stop()


def test_the_kind_with_the_fewest_ready_is_made_first(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kinds opened in turn are made in turn: the most recent kind first
    starved the other while its opens took each sandbox as it was made."""
    monkeypatch.setattr(pool_mod, "AFTER_OPEN_S", 0.0)
    p = SandboxPool(size=2, make=fakes.make, let_go=fakes.release)
    p.start(OFF)
    p.want(ON)
    until(lambda: ready(p, OFF) == 2 and ready(p, ON) == 2)
    with p._cond:  # both kinds taken from, ON the most recent: ON keeps 1, OFF none
        taken = p._ready[OFF] + p._ready[ON][:1]
        p._ready[OFF], p._ready[ON] = [], p._ready[ON][1:]
        p._wanted.move_to_end(ON)
        made_before = len(fakes.made)
        p._cond.notify()
    until(lambda: ready(p, OFF) == 2 and ready(p, ON) == 2)
    # OFF (none ready) before ON (one); then, one each, the most recent (ON); then OFF.
    assert [m.kind for m in fakes.made[made_before:]] == [OFF, ON, OFF]
    p.stop()
    for m in taken:
        fakes.release(m)
