"""The daemon's temporaries beside git's files are its own only once
written down in its journal (``gitguard/ournames.py``): a lock of the
user's running git that a session gave a second name of that shape (or a
name it saw a daemon use) was taken for a killed daemon's, removed by the
start's sweep (a ``git commit`` with its editor open then failed half way),
taken over by the last end, and not named among the locks left. Each
beside its twin, a real leftover of a daemon's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, leftlocks, lockfile, ournames, reftemp
from tests.unit.gitrepo import commits_repo

FORGED = "index.dispatchd-0123456789abcdef.lock"


@pytest.fixture(autouse=True)
def _no_journal() -> None:
    """Each test as a process outside a daemon, unless it starts one (``use``)."""
    ournames._journal = -1
    ournames._planned.clear()


def _dead_pair(common: Path, leaf: str) -> str:
    """What a daemon killed holding ``leaf``'s lock leaves: its temporary (written down) and ``leaf.lock``."""
    fd = os.open(common, os.O_PATH | os.O_DIRECTORY)
    try:
        dead = lockfile.temporary(fd, leaf, b"the dead daemon's\n")
        dead.take(lockfile.Policy(0.05))
        dead.close()
        return dead.temp
    finally:
        os.close(fd)


def test_a_name_of_a_temporary_s_shape_is_ours_only_once_written_down(tmp_path: Path) -> None:
    made = os.path.basename(reftemp.temp_name(str(tmp_path / "main")))
    assert ournames.shaped(made) == "main" and ournames.shaped("main.lock") is None
    (tmp_path / made).write_text("x")
    st = os.lstat(tmp_path / made)
    assert not ournames.ours(made, st)  # made by hand: anyone's
    ournames.note(str(tmp_path / made), st)
    assert ournames.ours(made, st)
    assert not ournames.ours(made.replace("main.", "other.", 1), st)  # another name for the same file: not ours
    ournames.forget((st.st_dev, st.st_ino))
    assert not ournames.ours(made, st)


def test_a_killed_daemon_s_leftover_is_recognised_by_the_next_start_and_nothing_else(tmp_path: Path) -> None:
    state, common = tmp_path / "state", tmp_path / "git"
    common.mkdir()
    ournames.use(str(state))  # the first daemon
    temp = _dead_pair(common, "main")
    (common / "other.dispatchd-0123456789abcdef.lock").write_text("a session's\n")
    st = os.lstat(common / temp)
    ournames._known.clear()  # the daemon's death: its memory gone, its journal on disk
    os.close(ournames._journal)
    ournames._journal = -1
    ournames.use(str(state))  # the next start
    assert ournames.ours(temp, st)
    assert not ournames.ours("other.dispatchd-0123456789abcdef.lock", os.lstat(common / "other.dispatchd-0123456789abcdef.lock"))
    assert len(os.listdir(state / "temporaries")) == 1  # the dead run's journal taken into this one's


def _death_after_the_open(state: Path, common: Path, leaf: str) -> str:
    """A daemon killed between making a temporary (``plan``, then the open) and its ``note``."""
    ournames.use(str(state))
    fd = os.open(common, os.O_PATH | os.O_DIRECTORY)
    try:
        temp = os.path.basename(reftemp.temp_name(leaf))
        ournames.plan(fd, temp)
        os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    ournames._known.clear()
    ournames._planned.clear()
    os.close(ournames._journal)
    ournames._journal = -1
    return temp


def test_a_temporary_made_and_not_yet_noted_at_the_death_is_swept_by_the_next_start(tmp_path: Path) -> None:
    state, common = tmp_path / "state", tmp_path / "git"
    common.mkdir()
    temp = _death_after_the_open(state, common, "config")
    ournames.use(str(state))
    fd = os.open(common, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert reftemp.sweep_names(fd, str(common), os.listdir(fd)) == [str(common / temp)]
    finally:
        os.close(fd)
    assert os.listdir(common) == []


def test_a_planned_temporary_given_a_second_name_or_bytes_since_is_not_taken_for_ours(tmp_path: Path) -> None:
    """A session cannot make the user's lock ours by linking it under a
    planned name: only an empty file of one name is, as ``O_EXCL`` made it."""
    state, common = tmp_path / "state", tmp_path / "git"
    common.mkdir()
    linked = _death_after_the_open(state, common, "index")
    os.unlink(common / linked)  # the session's swap: the user's lock given the planned name
    (common / "index.lock").write_text("the user's git\n")
    os.link(common / "index.lock", common / linked)
    written = _death_after_the_open(state, common, "config")
    (common / written).write_text("a session's\n")
    ournames.use(str(state))
    assert not ournames.ours(linked, os.lstat(common / linked))
    assert not ournames.ours(written, os.lstat(common / written))
    fd = os.open(common, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert reftemp.sweep_names(fd, str(common), os.listdir(fd)) == []
    finally:
        os.close(fd)
    assert (common / "index.lock").read_text() == "the user's git\n"


def test_a_temporary_that_could_not_be_made_leaves_no_plan_behind(tmp_path: Path) -> None:
    state, common = tmp_path / "state", tmp_path / "git"
    common.mkdir()
    ournames.use(str(state))
    (common / "gone").mkdir()
    gone = os.open(common / "gone", os.O_PATH | os.O_DIRECTORY)
    (common / "gone").rmdir()
    fd = os.open(common, os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(FileNotFoundError):
            reftemp.open_temp(gone, "leaf", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        tmp, out = reftemp.open_temp(fd, "leaf", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        reftemp.discard(fd, tmp, out)
    finally:
        os.close(fd)
        os.close(gone)
    assert ournames._planned == set() and ournames._known == {}
    assert os.fstat(ournames._journal).st_size == 0  # nothing of ours left: the journal started again


def _forged(common: Path) -> None:
    """The user's ``git commit`` holds ``index.lock``; a session links it to a name of our shape."""
    (common / "index.lock").write_text("the user's git\n")
    os.link(common / "index.lock", common / FORGED)


def test_the_sweep_leaves_the_user_s_lock_given_a_second_name_and_removes_ours(tmp_path: Path) -> None:
    common = tmp_path / "git"
    common.mkdir()
    _forged(common)
    temp = _dead_pair(common, "config")  # the twin: a killed daemon's pair
    fd = os.open(common, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(reftemp.sweep_names(fd, str(common), os.listdir(fd))) == sorted(
            [str(common / "config.lock"), str(common / temp)])
        assert (common / "index.lock").read_text() == "the user's git\n" and (common / FORGED).exists()
    finally:
        os.close(fd)


def test_a_lock_of_the_user_s_given_a_second_name_is_not_taken_over(tmp_path: Path) -> None:
    common = tmp_path / "git"
    common.mkdir()
    (common / "packed-refs.lock").write_text("the user's pack-refs\n")
    os.link(common / "packed-refs.lock", common / "packed-refs.dispatchd-0123456789abcdef.lock")
    fd = os.open(common, os.O_PATH | os.O_DIRECTORY)
    try:
        lock = lockfile.temporary(fd, "packed-refs", b"ours\n")
        with pytest.raises(lockfile.Refused):
            lock.take(lockfile.Policy(0.05, take_over=True))
        lock.release()
        assert (common / "packed-refs.lock").read_text() == "the user's pack-refs\n"
        # The twin: a killed daemon's lock (its temporary's flock let go) is taken over.
        (common / "packed-refs.lock").unlink()
        _dead_pair(common, "packed-refs")
        lock = lockfile.temporary(fd, "packed-refs", b"ours\n")
        lock.take(lockfile.Policy(0.05, take_over=True))
        assert (common / "packed-refs.lock").read_text() == "ours\n"
        lock.release()
    finally:
        os.close(fd)


@pytest.mark.process  # git, run for the repository
def test_a_lock_left_by_a_session_and_given_a_second_name_is_still_named(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo", 1)
    common = repo / ".git"
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    _forged(common)
    done, _ = history.restore(kept)
    assert [p for p, _ in done if p.endswith(".lock")] == [str(common / "index.lock")]
    # The twin: a killed daemon's own lock is not named (the next write takes it over).
    os.unlink(common / FORGED)
    os.unlink(common / "index.lock")
    _dead_pair(common, "index")
    assert leftlocks.said(str(common), kept.stamped_ns) == []
    (repo / "new.txt").write_text("new\n")
    add = subprocess.run(["git", "add", "new.txt"], cwd=repo, capture_output=True, text=True)
    assert add.returncode == 128 and "index.lock': File exists" in add.stderr  # it blocks: the start sweeps it


def test_a_temporary_removed_by_another_is_forgotten_when_we_let_it_go(tmp_path: Path) -> None:
    """Our temporary unlinked by someone else (a take then refused, the lock
    released): it stayed written down, and its inode, freed, could be the
    user's next lock's, which a session linked to the remembered name. The
    twin: a temporary still in use is ours."""
    common = tmp_path / "git"
    common.mkdir()
    fd = os.open(common, os.O_PATH | os.O_DIRECTORY)
    try:
        lock = lockfile.temporary(fd, "packed-refs", b"ours\n")
        st = os.lstat(common / lock.temp)
        assert ournames.ours(lock.temp, st)
        os.unlink(common / lock.temp)  # someone else's deed
        lock.release()
        assert not ournames.ours(lock.temp, st)
    finally:
        os.close(fd)


def test_the_journal_starts_again_once_nothing_of_ours_is_left(tmp_path: Path) -> None:
    """Every close appended lines (776 KB a close in a loop of them) until a
    restart: the journal is emptied whenever no temporary of ours is left.
    The twin: while one is, its line is there."""
    common = tmp_path / "git"
    common.mkdir()
    ournames._known.clear()
    ournames.use(str(tmp_path / "state"))
    (journal,) = (tmp_path / "state" / "temporaries").iterdir()
    fd = os.open(common, os.O_PATH | os.O_DIRECTORY)
    try:
        for _ in range(3):
            reftemp.write_at(fd, "main", b"x\n")
        lock = lockfile.temporary(fd, "side", b"y\n")
        assert journal.read_text().count("+ ") == 1  # the one in use; those written and renamed: gone
        lock.release()
        assert journal.read_text() == ""
    finally:
        os.close(fd)
        os.close(ournames._journal)
        ournames._journal = -1
