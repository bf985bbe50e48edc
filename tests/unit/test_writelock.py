"""dispatchd.daemon.writelock.WriteLocks: one writer per worktree, nested ones included."""

from __future__ import annotations

import pytest

from dispatchd.daemon.writelock import WriteLocks


def test_the_first_session_gets_the_lock_and_a_second_is_told_who_holds_it() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.acquire("b", "/home/u/wt") == "a"
    assert locks.holds("a") and not locks.holds("b")


@pytest.mark.parametrize(("who", "path", "holder"), [
    ("a", "/home/u/wt", None),  # the holder asking again keeps it
    ("b", "/home/u/wt/sub", "a"),  # a worktree inside the held one is the same lock
    ("c", "/home/u", "a"),  # ...and one around it
    ("b", "/home/u/wt2", None),  # a sibling with a shared prefix is another worktree
], ids=["the_holder_again", "inside", "around", "a_sibling_with_a_shared_prefix"])
def test_a_second_acquire_while_one_holds_it(who: str, path: str, holder: str | None) -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.acquire(who, path) == holder


def test_released_it_passes_on() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    locks.release("a")
    assert not locks.holds("a")
    assert locks.acquire("b", "/home/u/wt") is None
    locks.release("nobody")  # a no-op
    assert locks.holds("b")
