"""proctree: the tool server's reaper starts at its first command; the slow look for children."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

import pytest

from dispatchd.tools import orphans, proctree


@dataclasses.dataclass
class _FakeChild:
    pid: int
    returncode: int | None = 0  # already reaped: spawn forgets it at the next spawn


def test_hook_runs_after_the_first_spawn_and_again_until_it_succeeds() -> None:
    calls: list[int] = []
    answers = iter([False, True])

    def hook() -> bool:
        calls.append(len(calls))
        return next(answers)

    proctree.after_first_spawn(hook)
    try:
        assert calls == []  # nothing before a spawn
        proctree.spawn(lambda _limits: _FakeChild(pid=999_990), budget=1000)
        assert calls == [0]  # failed (the thread could not start): asked again at the next spawn
        proctree.spawn(lambda _limits: _FakeChild(pid=999_991), budget=1000)
        assert calls == [0, 1]
        proctree.spawn(lambda _limits: _FakeChild(pid=999_992), budget=1000)
        assert calls == [0, 1]  # succeeded once: never again
        assert proctree.CHILD_BORN.is_set()
    finally:
        proctree.after_first_spawn(lambda: True)
        proctree.spawn(lambda _limits: _FakeChild(pid=999_993), budget=1000)  # leave no hook for other tests
        proctree.CHILD_BORN.clear()


@pytest.mark.process
def test_the_slow_look_for_children_finds_what_the_children_file_lists() -> None:
    """Where the kernel has no ``children`` file, ``end_leftovers`` looks for
    its children in every process's stat: the same list, a zombie included."""
    live = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    try:
        while proctree.live_stat(str(dead.pid)) is not None:  # a zombie, not reaped yet
            time.sleep(0.01)
        me = os.getpid()
        with open(f"/proc/{me}/task/{me}/children", "rb") as f:
            listed = {int(c) for c in f.read().split()}
        found = set(orphans._zombie_or_live_children(me))
        # The file lists the main thread's children; the look, those of every thread.
        assert {live.pid, dead.pid} <= listed <= found
    finally:
        live.kill()
        live.wait()
        dead.wait()


def test_a_check_before_spawn_that_refuses_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    started: list[int] = []

    def refuse() -> None:
        raise OSError(errno.EAGAIN, "no watch")

    monkeypatch.setattr(proctree, "_BEFORE_SPAWN", [refuse])
    with pytest.raises(OSError):
        proctree.spawn(lambda _limits: started.append(1) or _FakeChild(pid=999_980), budget=1000)
    assert started == []
    monkeypatch.setattr(proctree, "_BEFORE_SPAWN", [lambda: None])  # the twin: a check that passes
    proctree.spawn(lambda _limits: started.append(1) or _FakeChild(pid=999_981), budget=1000)
    assert started == [1]
