"""The daemon's temporaries beside git's files carry a tag only a daemon of
the state directory can make (``gitguard/ournames.py``): a lock of the
user's running git that a session gave a second name of that shape was
taken for a killed daemon's, removed by the start's sweep (a ``git commit``
with its editor open then failed half way), taken over by the last end, and
not named among the locks left. Each beside its twin, a real leftover of ours."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, leftlocks, lockfile, ournames, reftemp
from tests.unit.gitrepo import commits_repo

FORGED = "index.dispatchd-0123456789abcdef.lock"


def test_a_name_of_ours_is_told_and_one_of_its_shape_is_not(tmp_path: Path) -> None:
    made = os.path.basename(ournames.make(str(tmp_path / "main")))
    assert ournames.ours(made) == "main" and ournames.shaped(made) == "main"
    assert ournames.ours("main.dispatchd-0123456789abcdef.lock") is None
    assert ournames.shaped("main.dispatchd-0123456789abcdef.lock") == "main"
    # A tag is for its file's name: another file's temporary with the same 16 hex is not ours.
    assert ournames.ours(made.replace("main.", "index.", 1)) is None


def test_the_key_lives_in_the_state_directory_and_a_second_start_reads_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    ournames.use(str(state))
    made = os.path.basename(ournames.make("main"))
    key = (state / "temporaries.key").read_bytes()
    assert len(key) == 32 and (state / "temporaries.key").stat().st_mode & 0o777 == 0o600
    ournames.use(str(tmp_path / "other"))  # another state directory: its own key, ours not recognised
    assert ournames.ours(made) is None
    ournames.use(str(state))  # the next start on the first: recognised again
    assert ournames.ours(made) == "main" and (state / "temporaries.key").read_bytes() == key


def _forged(common: Path) -> None:
    """The user's ``git commit`` holds ``index.lock``; a session links it to a name of our shape."""
    (common / "index.lock").write_text("the user's git\n")
    os.link(common / "index.lock", common / FORGED)


def test_the_sweep_leaves_the_user_s_lock_given_a_second_name_and_removes_ours(tmp_path: Path) -> None:
    common = tmp_path / "git"
    common.mkdir()
    _forged(common)
    fd = os.open(common, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert reftemp.sweep_names(fd, str(common), os.listdir(fd)) == []
        assert (common / "index.lock").read_text() == "the user's git\n"
        # The twin: a killed daemon's pair (a temporary of ours, and its second name as the lock).
        ours = os.path.basename(ournames.make("config"))
        (common / ours).write_text("x\n")
        os.link(common / ours, common / "config.lock")
        assert sorted(reftemp.sweep_names(fd, str(common), os.listdir(fd))) == sorted([
            str(common / "config.lock"), str(common / ours)])
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
        dead = lockfile.temporary(fd, "packed-refs", b"the dead daemon's\n")
        dead.take(lockfile.Policy(0.05))
        dead.close()
        lock = lockfile.temporary(fd, "packed-refs", b"ours\n")
        lock.take(lockfile.Policy(0.05, take_over=True))
        assert (common / "packed-refs.lock").read_text() == "ours\n"
        lock.release()
    finally:
        os.close(fd)


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
    dead = lockfile.temporary(os.open(common, os.O_PATH | os.O_DIRECTORY), "index", b"")
    dead.take(lockfile.Policy(0.05))
    dead.close()
    assert leftlocks.said(str(common), kept.stamped_ns) == []
    (repo / "new.txt").write_text("new\n")
    add = subprocess.run(["git", "add", "new.txt"], cwd=repo, capture_output=True, text=True)
    assert add.returncode == 128 and "index.lock': File exists" in add.stderr  # it blocks: the start sweeps it
