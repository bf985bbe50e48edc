"""statemodes: modes set back parents first, never through a symlink (dispatchd/statemodes.py)."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd import statemodes
from dispatchd.statemodes import Repair


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    top = tmp_path / "dispatchd"
    (top / "inuse").mkdir(parents=True, mode=0o700)
    top.chmod(0o700)
    (top / "inuse" / ".mutex").write_bytes(b"")
    (top / "inuse" / ".mutex").chmod(0o600)
    return Path(os.path.realpath(top))


def test_a_file_in_a_directory_of_mode_000_is_healed_parents_first(state: Path) -> None:
    mutex = state / "inuse" / ".mutex"
    mutex.chmod(0)
    (state / "inuse").chmod(0)
    assert statemodes.heal(str(mutex), 0o600, top=str(state)) == [
        Repair(str(state / "inuse"), 0, 0o700), Repair(str(mutex), 0, 0o600)]
    assert (_mode(state / "inuse"), _mode(mutex)) == (0o700, 0o600)


def test_an_open_refused_is_healed_and_tried_once_more(state: Path) -> None:
    mutex = state / "inuse" / ".mutex"
    statemodes.own(str(state))
    mutex.chmod(0)
    with pytest.raises(PermissionError):  # the twin: the mode refuses the open
        os.close(os.open(mutex, os.O_RDWR))
    os.close(statemodes.retried(lambda: os.open(mutex, os.O_RDWR), str(mutex), 0o600))
    assert _mode(mutex) == 0o600


def test_a_symlink_is_never_followed(state: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    victim.chmod(0o640)
    link = state / "inuse" / "x.uses"
    link.symlink_to(victim)
    assert statemodes.heal(str(link), 0o600, top=str(state)) == []
    assert _mode(victim) == 0o640
    (state / "inuse" / ".mutex").chmod(0o644)
    assert statemodes.heal_tree(str(state)) == [Repair(str(state / "inuse" / ".mutex"), 0o644, 0o600)]
    assert _mode(victim) == 0o640


def test_the_start_heals_the_layout_and_leaves_the_rest(state: Path) -> None:
    (state / "keep" / "k1").mkdir(parents=True, mode=0o700)
    (state / "keep").chmod(0o777)
    (state / "keep" / "k1").chmod(0o755)
    (state / "keep" / "k1" / ".stamps").write_bytes(b"")
    (state / "keep" / "k1" / ".stamps").chmod(0o644)  # not in the layout: as it was made
    (state / "sessions" / "s1" / "home").mkdir(parents=True, mode=0o755)  # a session's own: not the daemon's
    (state / "sessions").chmod(0)
    state.chmod(0o755)
    got = statemodes.heal_tree(str(state))
    assert got == [Repair(str(state), 0o755, 0o700), Repair(str(state / "sessions"), 0, 0o700),
                   Repair(str(state / "keep"), 0o777, 0o700), Repair(str(state / "keep" / "k1"), 0o755, 0o700)]
    assert _mode(state / "keep" / "k1" / ".stamps") == 0o644
    assert _mode(state / "sessions" / "s1" / "home") == 0o755
    assert statemodes.heal_tree(str(state)) == []  # a second start finds nothing to do


def test_a_top_that_cannot_be_opened_gives_way_to_the_owned_tree_around_it(state: Path) -> None:
    """The table of worktrees in use is a top of its own inside the state
    directory: the state directory made 000, the heal starts above it."""
    table, mutex = state / "inuse", state / "inuse" / ".mutex"
    statemodes.own(str(state))
    statemodes.own(str(table))
    state.chmod(0)
    try:
        with pytest.raises(PermissionError):  # the twin: nothing below it can be reached
            os.close(os.open(mutex, os.O_RDWR))
        assert statemodes.heal(str(mutex), 0o600) == [Repair(str(state), 0, 0o700)]
    finally:
        state.chmod(0o700)
    assert _mode(mutex) == 0o600


def test_the_start_heals_the_keep_s_directories_and_the_restore_preimages(state: Path) -> None:
    keep = state / "keep" / "k1"
    for d in ("ab", "cd", "pack"):
        (keep / d).mkdir(parents=True, mode=0o700)
    (keep / "ab" / "0123").write_bytes(b"")
    (keep / "ab" / "0123").chmod(0o444)  # an object file: maybe the repository's inode, never changed
    before = state / "before-restore" / "20260101T000000Z-s-c"
    (before / "worktree").mkdir(parents=True, mode=0o700)
    for d in (state / "before-restore", before, state / "keep", keep):
        d.chmod(0o700)  # as the daemon makes them (the parents above made at 0755)
    for d in (keep / "ab", keep / "pack", before / "worktree", state / "before-restore"):
        d.chmod(0)
    got = statemodes.heal_tree(str(state))
    assert got == [Repair(str(state / "keep" / "k1" / "ab"), 0, 0o700),
                   Repair(str(state / "keep" / "k1" / "pack"), 0, 0o700),
                   Repair(str(state / "before-restore"), 0, 0o700),
                   Repair(str(before / "worktree"), 0, 0o700)]
    assert _mode(keep / "ab" / "0123") == 0o444 and _mode(keep / "cd") == 0o700
    assert statemodes.heal_tree(str(state)) == []  # as made: one lstat each, nothing walked again


def _in_thread(call: Callable[[], object]) -> object:
    """``call()`` in a thread, waited for 5 s: a FIFO opened for reading with
    no writer would block it for good, and fail the test rather than hang it."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(call()), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "blocked"
    return got[0]


def test_set_mode_at_never_follows_a_symlink(tmp_path: Path) -> None:
    victim, other = tmp_path / "victim", tmp_path / "victim-dir"
    victim.write_bytes(b"")
    victim.chmod(0o640)
    other.mkdir(mode=0o755)
    other.chmod(0o755)
    for target in (victim, other):
        link = tmp_path / f"link-{target.name}"
        link.symlink_to(target)
        assert statemodes.set_mode_at(None, str(link), 0o600, statemodes.ANY_KIND) is None
        fd = os.open(link, os.O_PATH | os.O_NOFOLLOW)
        try:  # the descriptor form too: a symlink's own descriptor is left alone
            assert statemodes.set_mode(fd, 0o600, statemodes.ANY_KIND) is None
        finally:
            os.close(fd)
    assert (_mode(victim), _mode(other)) == (0o640, 0o755)  # the targets as they were


def test_set_mode_at_sets_a_regular_file_s_and_a_directory_s_mode(tmp_path: Path) -> None:
    """The allowed twin: the same call on the file and the directory themselves."""
    f, d = tmp_path / "f", tmp_path / "d"
    f.write_bytes(b"")
    f.chmod(0o640)
    d.mkdir()
    d.chmod(0)
    assert statemodes.set_mode_at(None, str(f), 0o600) == (0o640, 0o600)
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:  # below a descriptor, with the mode worked out from the one it has
        assert statemodes.set_mode_at(fd, "d", lambda was: was | 0o700) == (0, 0o700)
        assert statemodes.set_mode_at(fd, "d", 0o700) == (0o700, 0o700)  # already so: nothing done
    finally:
        os.close(fd)
    assert (_mode(f), _mode(d)) == (0o600, 0o700)


def test_set_mode_at_leaves_a_kind_not_asked_for_and_never_opens_a_fifo(tmp_path: Path) -> None:
    fifo, f = tmp_path / "fifo", tmp_path / "f"
    os.mkfifo(fifo, 0o600)
    f.write_bytes(b"")
    f.chmod(0o600)
    assert _in_thread(lambda: statemodes.set_mode_at(None, str(fifo), 0o644)) is None  # a file or a directory only
    assert statemodes.set_mode_at(None, str(f), 0o700, statemodes.DIRS) is None  # a directory only
    assert (_mode(fifo), _mode(f)) == (0o600, 0o600)
    # The twin: asked for, the FIFO's mode is set, and still it is not opened (no writer: an open would block).
    assert _in_thread(lambda: statemodes.set_mode_at(None, str(fifo), 0o644, statemodes.ANY_KIND)) == (0o600, 0o644)
    assert _mode(fifo) == 0o644


def test_set_mode_at_raises_the_lookup_s_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        statemodes.set_mode_at(None, str(tmp_path / "missing"), 0o600)
    assert err.value.errno == errno.ENOENT
    (tmp_path / "shut").mkdir()
    (tmp_path / "shut" / "f").write_bytes(b"")
    (tmp_path / "shut").chmod(0)
    try:
        with pytest.raises(PermissionError) as err:  # a directory on the way that cannot be searched
            statemodes.set_mode_at(None, str(tmp_path / "shut" / "f"), 0o600)
        assert err.value.errno == errno.EACCES
    finally:
        (tmp_path / "shut").chmod(0o700)
    assert statemodes.set_mode_at(None, str(tmp_path / "shut" / "f"), 0o600) is not None  # once searchable
