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


def test_a_grant_says_whether_the_worktree_was_swept_since_anyone_could_write_it() -> None:
    locks = WriteLocks()
    assert locks.grant("a", "/home/u/wt") == (None, False)  # a daemon that starts knows nothing swept
    assert locks.mark_swept("a", "/home/u/wt")  # a's processes gone, its sweep left none
    locks.release("a")
    assert locks.grant("b", "/home/u/wt") == (None, True)
    assert locks.grant("b", "/home/u/wt") == (None, False)  # b may have written since its grant
    locks.release("b")
    assert locks.grant("c", "/home/u/wt") == (None, False)  # b ended without a sweep marking it


def test_a_refused_grant_leaves_the_mark_alone() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.mark_swept("a", "/home/u/wt")
    assert locks.grant("b", "/home/u/wt") == ("a", False)  # refused: b writes nothing
    locks.release("a")
    assert locks.grant("b", "/home/u/wt") == (None, True)


@pytest.mark.parametrize("path", ["/home/u/wt/sub", "/home/u"], ids=["inside", "around"])
def test_a_grant_of_an_overlapping_worktree_unmarks_it(path: str) -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.mark_swept("a", "/home/u/wt")
    locks.release("a")
    assert locks.grant("b", path) == (None, False)  # only a sweep of that very path vouches for it
    locks.release("b")
    assert locks.grant("c", "/home/u/wt") == (None, False)


def test_a_sibling_with_a_shared_prefix_keeps_the_mark() -> None:
    locks = WriteLocks()
    assert locks.acquire("a", "/home/u/wt") is None
    assert locks.mark_swept("a", "/home/u/wt")
    locks.release("a")
    assert locks.grant("b", "/home/u/wt2") == (None, False)
    assert locks.grant("c", "/home/u/wt") == (None, True)


def test_only_the_holder_marks_and_not_while_one_that_gave_it_back_lives() -> None:
    locks = WriteLocks()
    assert not locks.mark_swept("a", "/home/u/wt")  # holds nothing
    assert locks.acquire("a", "/home/u/wt") is None
    locks.give_back("a")  # a's call running, its jobs, may still write
    assert not locks.holds("a")
    assert locks.acquire("b", "/home/u/wt/sub") is None
    assert not locks.mark_swept("b", "/home/u/wt/sub")  # a may write there still
    locks.release("a")  # a has ended: its processes are gone
    assert locks.mark_swept("b", "/home/u/wt/sub")
    locks.release("b")
    assert locks.grant("c", "/home/u/wt/sub") == (None, True)
