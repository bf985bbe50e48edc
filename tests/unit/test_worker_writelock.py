"""dispatchd.worker.control.WriteLock: asked once, answered by the daemon; the
sweep at the first grant is skipped only when the grant says the worktree is swept."""

from __future__ import annotations

import pytest

from dispatchd import protocol
from dispatchd.worker.control import WriteLock


class _Daemon:
    """Answers each request at once, as the daemon's grant would (pure logic: no socket)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.asked: list[protocol.AcquireWriteLock] = []
        self.lock: WriteLock | None = None

    def send(self, msg: protocol.AcquireWriteLock) -> None:
        self.asked.append(msg)
        assert self.lock is not None
        if isinstance(self.answer, protocol.ErrorReply):
            self.lock.answer(protocol.ErrorReply(id=msg.id, code=self.answer.code, message=self.answer.message))
        elif isinstance(self.answer, protocol.WriteLockGranted):
            self.lock.answer(protocol.WriteLockGranted(id=msg.id, swept=self.answer.swept))
        else:
            self.lock.answer(protocol.OkReply(id=msg.id))


def _lock(answer: object) -> tuple[WriteLock, _Daemon, list[str]]:
    daemon = _Daemon(answer)
    lock = WriteLock(daemon)  # type: ignore[arg-type]
    daemon.lock = lock
    swept: list[str] = []
    lock.on_granted = lambda: swept.append("swept")
    return lock, daemon, swept


@pytest.mark.parametrize(("answer", "sweeps"), [
    (protocol.WriteLockGranted(id=0, swept=False), ["swept"]),
    (protocol.OkReply(id=0), ["swept"]),  # a daemon that says nothing of it: sweep
    (protocol.WriteLockGranted(id=0, swept=True), []),
], ids=["not_swept", "plain_ok", "swept"])
def test_the_first_grant_sweeps_unless_the_daemon_swept(answer: object, sweeps: list[str]) -> None:
    lock, daemon, swept = _lock(answer)
    assert lock.acquire("shell_exec") is None
    assert lock.acquire("write_file") is None  # held: not asked again
    assert len(daemon.asked) == 1 and lock.held
    assert swept == sweeps


def test_asked_ahead_the_answer_is_the_same() -> None:
    lock, daemon, swept = _lock(protocol.WriteLockGranted(id=0, swept=False))
    asked = lock.ask("shell_exec")
    assert not lock.held  # not granted until waited for
    assert lock.wait(asked) is None and lock.held and swept == ["swept"]
    assert lock.ask("shell_exec") is None  # held: nothing sent


def test_a_refusal_says_why_and_is_asked_again() -> None:
    lock, daemon, swept = _lock(protocol.ErrorReply(id=0, code="write_locked", message="held by s1"))
    assert lock.acquire("shell_exec") == "held by s1"
    assert lock.acquire("shell_exec") == "held by s1"
    assert len(daemon.asked) == 2 and not lock.held and swept == []
