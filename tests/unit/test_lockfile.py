"""dispatchd.daemon.gitguard.lockfile: git's lock as the daemon takes it,
each policy choice beside its twin (``choose`` by equality, then the same
choices on real files: waited for, taken over, moved aside, refused), and
the one sweep of what a killed daemon left (``reftemp.sweep_names``)."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import lockfile, ournames, reftemp
from dispatchd.daemon.gitguard.lockfile import Act, Policy, choose
from tests.unit.leftovers import adopt


_MADE: dict[tuple[str, str], str] = {}


def _T(leaf: str, key: str) -> str:
    """A temporary's name of ours for ``leaf`` (``ournames``: only the daemon's key makes one), one per ``key``."""
    return _MADE.setdefault((leaf, key), os.path.basename(ournames.make(leaf)))


_WAIT = Policy(wait_s=0.05)
_TAKE_OVER = Policy(wait_s=0.05, take_over=True)


def _st(mode: int = stat.S_IFREG | 0o644, nlink: int = 1) -> os.stat_result:
    return os.stat_result((mode, 1, 1, nlink, 0, 0, 0, 0, 0, 0))


# --- choose: the pure policy ----------------------------------------------


def test_a_lock_gone_meanwhile_is_tried_again_at_once_whatever_the_policy() -> None:
    for policy in (_WAIT, _TAKE_OVER, Policy(0.05, True, "/x")):
        assert choose(policy, None, late=True, moved=True) is Act.AGAIN


def test_a_killed_daemons_lock_is_taken_over_only_with_take_over() -> None:
    two = _st(nlink=2)
    assert choose(_TAKE_OVER, two, late=False, moved=False, left=True) is Act.TAKE_OVER
    # The twin: a live restore or a put-back waits for it, then refuses, as for git's own.
    assert choose(_WAIT, two, late=False, moved=False, left=True) is Act.WAIT
    assert choose(_WAIT, two, late=True, moved=False, left=True) is Act.REFUSE


def test_two_names_alone_are_no_killed_daemons_lock() -> None:
    """A second name anyone can give (a link of the user's live lock): waited
    for, never removed; only one whose other name is a temporary of ours
    nobody holds is a killed daemon's (``left``: ``reftemp.second_name_ours``)."""
    assert choose(_TAKE_OVER, _st(nlink=2), late=False, moved=False) is Act.WAIT
    assert choose(_TAKE_OVER, _st(nlink=1), late=False, moved=False) is Act.WAIT  # git's own: one name
    assert choose(_TAKE_OVER, _st(nlink=2), late=False, moved=False, left=True) is Act.TAKE_OVER  # the twin


def test_a_lock_left_past_the_wait_is_moved_aside_once_where_the_policy_names_a_place() -> None:
    end = Policy(0.05, take_over=True, aside_to="/repo/.git")
    assert choose(end, _st(), late=False, moved=False) is Act.WAIT
    assert choose(end, _st(), late=True, moved=False) is Act.MOVE_ASIDE
    # One more in its place at once is someone's live git: refused, never moved twice.
    assert choose(end, _st(), late=True, moved=True) is Act.REFUSE
    # The twin: no place named (packed-refs.lock, a lock taken to remove, config): refused.
    assert choose(_TAKE_OVER, _st(), late=True, moved=False) is Act.REFUSE


# --- the same choices on real files ---------------------------------------


@pytest.fixture
def where(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    d = tmp_path / "refs"
    d.mkdir()
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield d, fd
    finally:
        os.close(fd)


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_lock_someone_holds_is_refused_after_the_wait_and_left(where: tuple[Path, int]) -> None:
    d, fd = where
    (d / "main.lock").write_text("git's\n")
    lock = lockfile.temporary(fd, "main", b"new\n")
    with pytest.raises(lockfile.Refused) as got:
        lock.take(_TAKE_OVER)
    assert (got.value.errno, str(got.value.strerror)) == (errno.EEXIST, "git's lock main.lock is held")
    lock.release()
    assert _names(d) == ["main.lock"] and (d / "main.lock").read_text() == "git's\n"


def test_the_twin_a_lock_let_go_within_the_wait_is_taken(where: tuple[Path, int]) -> None:
    d, fd = where
    (d / "main.lock").write_text("git's\n")
    timer = threading.Timer(0.1, (d / "main.lock").unlink)
    timer.start()
    lock = lockfile.temporary(fd, "main", b"new\n")
    try:
        lock.take(Policy(wait_s=2.0))
    finally:
        timer.join()
    assert (d / "main.lock").read_text() == "new\n" and (d / "main.lock").stat().st_nlink == 2  # ours: two names
    lock.commit()
    lock.release()
    assert _names(d) == ["main"] and (d / "main").read_text() == "new\n"


def test_a_killed_daemons_lock_is_taken_over_with_take_over(where: tuple[Path, int]) -> None:
    d, fd = where
    (d / _T("main", "0123456789abcdef")).write_text("old\n")
    os.link(d / _T("main", "0123456789abcdef"), d / "main.lock")
    adopt(d)
    lock = lockfile.temporary(fd, "main", b"new\n")
    lock.take(_TAKE_OVER)
    assert (d / "main.lock").read_text() == "new\n" and lock.moved == ""
    lock.release()
    assert _names(d) == [_T("main", "0123456789abcdef")]  # the other name: the sweep's


def test_the_twin_without_take_over_a_killed_daemons_lock_is_refused_and_left(where: tuple[Path, int]) -> None:
    d, fd = where
    (d / _T("main", "0123456789abcdef")).write_text("old\n")
    os.link(d / _T("main", "0123456789abcdef"), d / "main.lock")
    lock = lockfile.temporary(fd, "main", b"new\n")
    with pytest.raises(lockfile.Refused, match=r"^\[Errno 17\] git's lock main\.lock is held$"):
        lock.take(_WAIT)
    lock.release()
    assert _names(d) == [_T("main", "0123456789abcdef"), "main.lock"]
    assert (d / "main.lock").read_text() == "old\n"


def test_a_lock_left_past_the_wait_is_moved_aside_and_named(where: tuple[Path, int], tmp_path: Path) -> None:
    d, fd = where
    (d / "main.lock").write_text("a session's\n")
    lock = lockfile.temporary(fd, "main", b"new\n")
    lock.take(Policy(0.05, take_over=True, aside_to=str(tmp_path)))
    assert os.path.dirname(lock.moved) == str(tmp_path)
    assert os.path.basename(lock.moved).startswith("main.lock.quarantined-by-dispatchd-")
    assert Path(lock.moved).read_text() == "a session's\n"  # kept, never deleted
    lock.commit()
    lock.release()
    assert _names(d) == ["main"] and (d / "main").read_text() == "new\n"


def test_the_twin_a_lock_that_cannot_be_moved_aside_is_refused_and_left(where: tuple[Path, int],
                                                                         tmp_path: Path) -> None:
    d, fd = where
    (d / "main.lock").write_text("a session's\n")
    lock = lockfile.temporary(fd, "main", b"new\n")
    with pytest.raises(lockfile.Refused, match=r"^\[Errno 17\] git's lock main\.lock is held$"):
        lock.take(Policy(0.05, take_over=True, aside_to=str(tmp_path / "no-such-directory")))
    lock.release()
    assert _names(d) == ["main.lock"] and (d / "main.lock").read_text() == "a session's\n"


def test_release_removes_a_lock_only_while_it_is_this_one(where: tuple[Path, int]) -> None:
    d, fd = where
    lock = lockfile.temporary(fd, "main", b"new\n")
    lock.take(_WAIT)
    (d / "main.lock").unlink()
    (d / "main.lock").write_text("git's\n")  # another's lock in its place meanwhile
    with pytest.raises(OSError) as got:
        lock.rewrite(b"x\n")
    assert got.value.errno == errno.ESTALE
    lock.release()
    assert _names(d) == ["main.lock"] and (d / "main.lock").read_text() == "git's\n"
    # The twin: a lock still this one goes, with its second name.
    lock = lockfile.temporary(fd, "side", b"new\n")
    lock.take(_WAIT)
    lock.rewrite(b"y\n")
    assert (d / "side.lock").read_text() == "y\n"
    lock.release()
    assert _names(d) == ["main.lock"]


# --- the one sweep: a live lock's temporary is flocked --------------------


def test_a_closed_locks_names_are_swept_and_a_live_ones_are_left(where: tuple[Path, int]) -> None:
    d, fd = where
    live = lockfile.temporary(fd, "main", b"new\n")
    live.take(_WAIT)
    assert reftemp.sweep_names(fd, str(d), os.listdir(fd)) == []  # its flock held: a live daemon's
    assert _names(d) == sorted([live.temp, "main.lock"])
    # The twin: the descriptor let go (a daemon's death), both names are a leftover.
    live.close()
    assert reftemp.sweep_names(fd, str(d), os.listdir(fd)) == [str(d / "main.lock"), str(d / live.temp)]
    assert _names(d) == []


def test_the_sweep_keeps_to_the_leaves_it_is_given_and_to_a_lock_of_that_inode(where: tuple[Path, int]) -> None:
    d, fd = where
    (d / _T("config", "0123456789abcdef")).write_text("x\n")
    os.link(d / _T("config", "0123456789abcdef"), d / "config.lock")
    (d / _T("HEAD", "0123456789abcdef")).write_text("x\n")
    (d / "HEAD.lock").write_text("git's\n")  # a file of its own: never removed
    (d / _T("hooks", "0123456789abcdef")).write_text("x\n")
    os.link(d / _T("hooks", "0123456789abcdef"), d / "hooks.lock")
    os.link(d / _T("hooks", "0123456789abcdef"), d / "third")  # a third name: not our pair
    adopt(d)
    assert reftemp.sweep_names(fd, str(d), os.listdir(fd), {"config"}) == [
        str(d / "config.lock"), str(d / _T("config", "0123456789abcdef"))]
    assert sorted(reftemp.sweep_names(fd, str(d), os.listdir(fd))) == [
        str(d / _T("HEAD", "0123456789abcdef")), str(d / _T("hooks", "0123456789abcdef"))]
    assert _names(d) == ["HEAD.lock", "hooks.lock", "third"]


def test_a_temporary_that_cannot_be_removed_stays_ours_and_the_next_sweep_removes_it(
        where: tuple[Path, int]) -> None:
    """A session beside a put-back takes back the write permission lent to
    its directory (``chmod 555`` in a loop): the release cannot remove the
    temporary. Forgotten then, the next end took the daemon's own leftover
    for a session's new hook, moved it aside and named it as one."""
    d, fd = where
    lock = lockfile.temporary(fd, "h00", b"mine\n")
    d.chmod(0o555)
    try:
        with pytest.raises(PermissionError) as got:
            lock.release()
        assert got.value.errno == errno.EACCES
    finally:
        d.chmod(0o755)
    assert _names(d) == [lock.temp]
    assert ournames.ours(lock.temp, os.stat(d / lock.temp))  # still known as ours
    assert reftemp.sweep_names(fd, str(d), os.listdir(fd), {"h00"}) == [str(d / lock.temp)]
    assert _names(d) == []


def test_the_twin_a_temporary_removed_at_the_release_is_forgotten(where: tuple[Path, int]) -> None:
    d, fd = where
    lock = lockfile.temporary(fd, "h00", b"mine\n")
    st = os.stat(d / lock.temp)
    lock.release()
    assert _names(d) == [] and not ournames.ours(lock.temp, st)


# --- take_in: a lock and its directory held together -----------------------


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as exc:
        assert exc.errno == errno.EBADF
        return False
    return True


def test_a_lock_taken_in_a_directory_commits_once_and_lets_the_directory_go(tmp_path: Path) -> None:
    (tmp_path / "index").write_bytes(b"old")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    held = lockfile.take_in(dir_fd, "index", _WAIT, 0o600)
    assert (tmp_path / "index.lock").exists()
    held.commit(b"new", 0o600)
    assert (tmp_path / "index").read_bytes() == b"new" and stat.S_IMODE(os.stat(tmp_path / "index").st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["index"] and not _fd_open(dir_fd)
    held.release()  # once: a second call does nothing


def test_a_lock_refused_in_a_directory_leaves_the_other_s_lock_and_closes_the_directory(tmp_path: Path) -> None:
    (tmp_path / "index").write_bytes(b"old")
    (tmp_path / "index.lock").write_bytes(b"the user's git")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    with pytest.raises(lockfile.Refused):
        lockfile.take_in(dir_fd, "index", _WAIT)
    assert not _fd_open(dir_fd)
    assert sorted(os.listdir(tmp_path)) == ["index", "index.lock"]
    assert (tmp_path / "index.lock").read_bytes() == b"the user's git"
    # The twin: released unchanged, the file as it was.
    (tmp_path / "index.lock").unlink()
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    lockfile.take_in(dir_fd, "index", _WAIT).release()
    assert sorted(os.listdir(tmp_path)) == ["index"] and (tmp_path / "index").read_bytes() == b"old"
