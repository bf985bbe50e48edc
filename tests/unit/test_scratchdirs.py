"""Scratch directories kept for the next session (daemon/scratchdirs.py,
leftovers.ScratchLocks): emptied whole, kept only when as new, handed on by
rename with their lock, and removed by the next start once their daemon is
dead."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dispatchd import flocks
from dispatchd.daemon import leftovers, scratchdirs


def _scratch(sessions: Path, locks: leftovers.ScratchLocks, sid: str) -> Path:
    """A session's scratch directory as the daemon makes it (pooling._make_scratch)."""
    assert locks.take(sid) is False  # none kept: made
    (sessions / sid / "tmp").mkdir(parents=True, mode=0o700)
    (sessions / sid / "home").mkdir(mode=0o700)
    return sessions / sid


def _left_behind(scratch: Path) -> None:
    """What a session can leave: files, deep trees, a directory it made unreadable."""
    (scratch / "tmp" / "f").write_text("secret")
    deep = scratch / "tmp" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "g").write_text("x")
    (scratch / "home" / ".cache").mkdir()
    (scratch / "home" / ".cache" / "h").write_text("x")
    os.symlink("/etc/passwd", scratch / "home" / "link")
    os.chmod(scratch / "tmp" / "a", 0)


def test_an_emptied_directory_goes_to_the_next_session_by_rename_with_its_lock(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    scratch = _scratch(sessions, locks, "a" * 12)
    _left_behind(scratch)
    inode = (scratch / "tmp").stat().st_ino
    assert scratchdirs.empty_for_reuse(str(scratch), os.getuid())
    assert os.listdir(scratch / "tmp") == [] and os.listdir(scratch / "home") == []
    assert locks.keep("a" * 12)
    # Kept under an id of its own, still locked: no session's name is left.
    (spare,) = os.listdir(sessions)
    assert spare != "a" * 12 and flocks.held(os.path.join(locks.dir, f"{spare}.lock"))
    assert not os.path.exists(os.path.join(locks.dir, f"{'a' * 12}.lock"))
    assert locks.take("b" * 12) is True
    assert os.listdir(sessions) == ["b" * 12] and (sessions / ("b" * 12) / "tmp").stat().st_ino == inode
    assert sorted(os.listdir(locks.dir)) == [f"{'b' * 12}.lock"] and flocks.held(os.path.join(locks.dir, f"{'b' * 12}.lock"))
    # None kept now: the next is made.
    assert locks.take("c" * 12) is False
    locks.release("b" * 12)
    locks.release("c" * 12)
    assert os.listdir(locks.dir) == []


def test_a_fresh_directory_is_as_new_the_twin_of_each_refusal(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    assert scratchdirs.empty_for_reuse(str(_scratch(sessions, locks, "a" * 12)), os.getuid())


@pytest.mark.parametrize("change", ["mode", "xattr", "extra entry", "symlinked part", "gone part", "other owner"])
def test_a_directory_not_as_new_is_not_kept(tmp_path: Path, change: str) -> None:
    """A session's chmod of its home, an attribute it set (a default ACL
    reaches the next session's files), anything beside tmp and home."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    scratch = _scratch(sessions, locks, "a" * 12)
    if change == "mode":
        os.chmod(scratch / "home", 0o755)
    elif change == "xattr":
        try:
            os.setxattr(scratch / "tmp", "user.left", b"1")
        except OSError as exc:
            assert exc.errno == errno.EOPNOTSUPP, exc
            pytest.fail(f"{tmp_path}: user extended attributes not supported here; this test needs them")
    elif change == "extra entry":
        (scratch / "other").write_text("")
    elif change == "symlinked part":
        os.rmdir(scratch / "home")
        os.symlink(scratch / "tmp", scratch / "home")
    elif change == "gone part":
        os.rmdir(scratch / "home")
    else:
        assert scratchdirs.empty_for_reuse(str(scratch), os.getuid() + 1) is False
        return
    assert scratchdirs.empty_for_reuse(str(scratch), os.getuid()) is False


def test_at_most_a_few_are_kept(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    sids = [f"{i:012x}" for i in range(scratchdirs.KEEP + 1)]
    for sid in sids:
        _scratch(sessions, locks, sid)
    assert [locks.keep(sid) for sid in sids] == [True] * scratchdirs.KEEP + [False]
    locks.drop_spares()
    assert os.listdir(sessions) == [sids[-1]] and os.listdir(locks.dir) == [f"{sids[-1]}.lock"]


def test_a_kept_directory_is_a_live_daemons_until_it_dies(tmp_path: Path) -> None:
    """Another daemon's start leaves it (locked); once its daemon is dead
    (the lock free) the next start removes it."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    _scratch(sessions, locks, "a" * 12)
    assert locks.keep("a" * 12)
    assert leftovers.remove_stale(str(sessions)) == 0 and len(os.listdir(sessions)) == 1
    (spare,) = os.listdir(sessions)
    os.close(locks._fds.pop(spare))  # what the daemon's death does: its lock file left, unheld
    assert leftovers.remove_stale(str(sessions)) == 1 and os.listdir(sessions) == []
    assert os.listdir(locks.dir) == []


def test_a_kept_directory_removed_meanwhile_leaves_the_lock_to_the_new_session(tmp_path: Path) -> None:
    """A start of another daemon between the lock's rename and the
    directory's removes the directory: the session's open makes its own."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    _scratch(sessions, locks, "a" * 12)
    assert locks.keep("a" * 12)
    (spare,) = os.listdir(sessions)
    for part in ("tmp", "home"):
        os.rmdir(sessions / spare / part)
    os.rmdir(sessions / spare)
    assert locks.take("b" * 12) is False
    assert flocks.held(os.path.join(locks.dir, f"{'b' * 12}.lock"))
    locks.release("b" * 12)
