"""Scratch directories kept for the next session (daemon/scratchdirs.py,
leftovers.ScratchLocks): a session's tmp and home removed whole, never
handed on; the directory above them kept only when then empty and the
daemon's, handed on by rename with its lock (every name it has backed by
the held lock), and removed by the next start once its daemon is dead."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dispatchd import flocks
from dispatchd.daemon import leftovers, scratchdirs


def _scratch(sessions: Path, locks: leftovers.ScratchLocks, sid: str) -> Path:
    """A session's scratch directory as the daemon makes it (pooling._make_scratch)."""
    locks.take(sid)
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
    os.chmod(scratch / "home", 0o500)


def test_the_directory_goes_to_the_next_session_with_its_lock_and_never_its_tmp_or_home(tmp_path: Path) -> None:
    """A descriptor of the last session's /tmp (handed to another session
    meanwhile) must show nothing of the next one's: so tmp and home are
    new each time, and only the directory above them is kept."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    scratch = _scratch(sessions, locks, "a" * 12)
    _left_behind(scratch)
    top = scratch.stat().st_ino
    held = os.open(scratch / "tmp", os.O_RDONLY | os.O_DIRECTORY)  # what another session could hold
    assert scratchdirs.clear_for_reuse(str(scratch), os.getuid())
    assert os.listdir(scratch) == []
    assert locks.keep("a" * 12)
    # Kept under an id of its own, still locked: no session's name is left.
    (spare,) = os.listdir(sessions)
    assert spare != "a" * 12 and os.listdir(locks.dir) == [f"{spare}.lock"]
    assert flocks.held(os.path.join(locks.dir, f"{spare}.lock"))
    _scratch(sessions, locks, "b" * 12)
    assert os.listdir(sessions) == ["b" * 12] and (sessions / ("b" * 12)).stat().st_ino == top
    assert os.listdir(locks.dir) == [f"{'b' * 12}.lock"] and flocks.held(os.path.join(locks.dir, f"{'b' * 12}.lock"))
    (sessions / ("b" * 12) / "tmp" / "next").write_text("the next session's")
    assert os.listdir(held) == []  # the old tmp: gone, and not the new one
    os.close(held)
    # None kept now: the next is made.
    assert locks.take("c" * 12) is False
    for sid in ("b" * 12, "c" * 12):
        locks.release(sid)
    assert os.listdir(locks.dir) == []


def test_a_fresh_directory_can_be_kept_the_twin_of_each_refusal(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    assert scratchdirs.clear_for_reuse(str(_scratch(sessions, locks, "a" * 12)), os.getuid())


@pytest.mark.parametrize("change", ["extra entry", "symlinked", "other owner", "gone part"])
def test_a_directory_not_as_made_is_not_kept(tmp_path: Path, change: str) -> None:
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    scratch = _scratch(sessions, locks, "a" * 12)
    if change == "extra entry":
        (scratch / "other").write_text("")
    elif change == "symlinked":
        os.rename(scratch, tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", scratch)
    elif change == "gone part":
        os.rmdir(scratch / "home")
    else:
        assert scratchdirs.clear_for_reuse(str(scratch), os.getuid() + 1) is False
        return
    assert scratchdirs.clear_for_reuse(str(scratch), os.getuid()) is False


def test_at_most_a_few_are_kept(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    sids = [f"{i:012x}" for i in range(scratchdirs.KEEP + 1)]
    for sid in sids:
        assert scratchdirs.clear_for_reuse(str(_scratch(sessions, locks, sid)), os.getuid())
    assert [locks.keep(sid) for sid in sids] == [True] * scratchdirs.KEEP + [False]
    locks.drop_spares()
    assert os.listdir(sessions) == [sids[-1]] and os.listdir(locks.dir) == [f"{sids[-1]}.lock"]


def test_a_kept_directory_is_a_live_daemons_until_it_dies(tmp_path: Path) -> None:
    """Another daemon's start leaves it (locked); once its daemon is dead
    (the lock free) the next start removes it."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    assert scratchdirs.clear_for_reuse(str(_scratch(sessions, locks, "a" * 12)), os.getuid())
    assert locks.keep("a" * 12)
    assert leftovers.remove_stale(str(sessions)) == 0 and len(os.listdir(sessions)) == 1
    (spare,) = os.listdir(sessions)
    os.close(locks._fds.pop(spare))  # what the daemon's death does: its lock file left, unheld
    assert leftovers.remove_stale(str(sessions)) == 1 and os.listdir(sessions) == []
    assert os.listdir(locks.dir) == []


def test_a_start_of_another_daemon_while_it_is_handed_on_never_removes_it(tmp_path: Path) -> None:
    """Every name the directory has while it moves is backed by its held
    lock: a start looking at every moment of the move removes nothing."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    scratch = _scratch(sessions, locks, "a" * 12)
    (scratch / "tmp" / "f").write_text("x")
    real_rename, real_unlink = os.rename, os.unlink
    removed: list[int] = []
    looking = threading.Lock()

    def look_then(real):  # type: ignore[no-untyped-def]
        def step(*args, **kwargs):  # type: ignore[no-untyped-def]
            if looking.acquire(blocking=False):  # not within the start's own unlinks
                try:
                    removed.append(leftovers.remove_stale(str(sessions)))
                finally:
                    looking.release()
            return real(*args, **kwargs)
        return step

    assert scratchdirs.clear_for_reuse(str(scratch), os.getuid())
    os.rename, os.unlink = look_then(real_rename), look_then(real_unlink)  # type: ignore[assignment]
    try:
        assert locks.keep("a" * 12)
        assert locks.take("b" * 12) is True
    finally:
        os.rename, os.unlink = real_rename, real_unlink  # type: ignore[assignment]
    assert removed and set(removed) == {0}, removed
    assert os.listdir(sessions) == ["b" * 12]
    locks.release("b" * 12)


def test_keeping_and_taking_from_two_threads_lose_nothing(tmp_path: Path) -> None:
    """The afterwards thread keeps while the pool's thread takes."""
    sessions = tmp_path / "sessions"
    locks = leftovers.ScratchLocks(str(sessions))
    made = [f"{i:012x}" for i in range(40)]
    for sid in made:
        assert scratchdirs.clear_for_reuse(str(_scratch(sessions, locks, sid)), os.getuid())
    taken: list[str] = []

    def keep() -> None:
        for sid in made:
            if not locks.keep(sid):
                locks._drop(sid)

    def take() -> None:
        for i in range(40):
            sid = f"{i + 100:012x}"
            locks.take(sid)
            taken.append(sid)

    threads = [threading.Thread(target=keep), threading.Thread(target=take)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    held = sorted(n[:-5] for n in os.listdir(locks.dir))
    assert held == sorted(set(taken) | set(locks._spares)), (held, taken, locks._spares)
    assert all(flocks.held(os.path.join(locks.dir, f"{sid}.lock")) for sid in held)
