"""dispatchd.daemon.writelock.WriteLocks: one writer per worktree, nested ones included."""

from __future__ import annotations

from dispatchd.daemon.writelock import WriteLocks


def test_the_first_session_gets_the_lock_and_a_second_is_told_who_holds_it() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.acquire("b", "/home/u/wt") == "a"
    assert locks.holds("a") and not locks.holds("b")


def test_the_holder_asking_again_keeps_it() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.acquire("a", "/home/u/wt") is None


def test_a_worktree_inside_or_around_the_held_one_is_the_same_lock() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.acquire("b", "/home/u/wt/sub") == "a"
    assert locks.acquire("c", "/home/u") == "a"


def test_a_sibling_with_a_shared_prefix_is_another_worktree() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.acquire("b", "/home/u/wt2") is None


def test_released_it_passes_on() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    locks.release("a")
    assert not locks.holds("a")
    assert locks.acquire("b", "/home/u/wt") is None
    locks.release("nobody")  # a no-op
    assert locks.holds("b")
