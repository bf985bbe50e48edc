"""proctree.after_first_spawn: the tool server's reaper starts at its first command."""

from __future__ import annotations

import dataclasses

from dispatchd.tools import proctree


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
        proctree.spawn(lambda: _FakeChild(pid=999_990), budget=1000)
        assert calls == [0]  # failed (the thread could not start): asked again at the next spawn
        proctree.spawn(lambda: _FakeChild(pid=999_991), budget=1000)
        assert calls == [0, 1]
        proctree.spawn(lambda: _FakeChild(pid=999_992), budget=1000)
        assert calls == [0, 1]  # succeeded once: never again
        assert proctree.CHILD_BORN.is_set()
    finally:
        proctree.after_first_spawn(lambda: True)
        proctree.spawn(lambda: _FakeChild(pid=999_993), budget=1000)  # leave no hook for other tests
        proctree.CHILD_BORN.clear()
