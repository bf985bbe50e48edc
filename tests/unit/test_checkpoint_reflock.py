"""A restore's refs under git's lock (``checkpoints.reflock``, ``gitrefs``):
the value kept is the one read with the lock held, a held lock is waited
for and then refused, and a packed ref is deleted with its peeled line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon import gitguard
from dispatchd.daemon.checkpoints import gitrefs, reflock
from dispatchd.daemon.gitguard import ournames
from tests.unit.gitrepo import git
from tests.unit.leftovers import adopt


pytestmark = pytest.mark.process  # git runs


_MADE: dict[tuple[str, str], str] = {}


def _T(leaf: str, key: str) -> str:
    """A temporary's name of ours for ``leaf`` (``ournames``: only the daemon's key makes one), one per ``key``."""
    return _MADE.setdefault((leaf, key), os.path.basename(ournames.make(leaf)))


def _repo(tmp_path: Path) -> tuple[Path, str, str]:
    r = tmp_path / "wt"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "a").write_text("a\n")
    git(r, "add", "a")
    git(r, "commit", "-qm", "one")
    one = git(r, "rev-parse", "main").strip()
    (r / "a").write_text("b\n")
    git(r, "commit", "-qam", "two")
    return r, one, git(r, "rev-parse", "main").strip()


def _restore(r: Path, want: dict[str, str]) -> gitrefs.RefsDone:
    fd = os.open(r, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return gitrefs.restore_refs(fd, str(r / ".git"), want, [], "20250101T000000", [], "test")
    finally:
        os.close(fd)


def test_the_value_kept_is_the_one_read_under_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refs are listed (main at ``one``), then the user's git commits
    (main at ``two``), then the restore takes main's lock: it keeps ``two``,
    the value it replaces, not the one it listed."""
    r, one, two = _repo(tmp_path)
    stale = {"refs/heads/main": one}
    monkeypatch.setattr(gitguard, "read_all_refs", lambda common: dict(stale))
    done = _restore(r, {"HEAD": "ref: refs/heads/main", "refs/heads/main": "0" * 39 + "1"})
    assert done.kept == ["refs/dispatchd/displaced/20250101T000000/refs/heads/main"]
    assert git(r, "rev-parse", done.kept[0]).strip() == two
    assert (r / ".git" / "refs" / "heads" / "main").read_text() == "0" * 39 + "1\n"
    assert not (r / ".git" / "refs" / "heads" / "main.lock").exists()


def test_a_held_lock_is_refused_after_a_wait_and_left_in_place(tmp_path: Path) -> None:
    r, one, two = _repo(tmp_path)
    lock = r / ".git" / "refs" / "heads" / "main.lock"
    lock.write_text("the user's\n")
    common_fd = os.open(r / ".git", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(reflock.Busy, match=r"^refs/heads/main\.lock$"):
            reflock.take(common_fd, "refs/heads/main", wait_s=0.05)
        assert lock.read_text() == "the user's\n"
        # The twin: once git is done, the lock is taken, the value read under it, released unchanged.
        lock.unlink()
        held = reflock.take(common_fd, "refs/heads/main", wait_s=0.05)
        assert reflock.value(common_fd, held, 40) == two
        reflock.release(held)
    finally:
        os.close(common_fd)
    assert not lock.exists() and git(r, "rev-parse", "main").strip() == two


def test_a_packed_ref_is_deleted_with_its_peeled_line_and_its_value_kept(tmp_path: Path) -> None:
    r, one, two = _repo(tmp_path)
    git(r, "tag", "-a", "-m", "t", "v1", one)
    git(r, "tag", "v2", two)
    git(r, "pack-refs", "--all")
    done = _restore(r, {"HEAD": "ref: refs/heads/main", "refs/heads/main": two, "refs/tags/v2": two})
    assert done.moved == 1 and done.left == []
    assert "v1" not in (r / ".git" / "packed-refs").read_text() and git(r, "tag").split() == ["v2"]
    [kept] = done.kept
    assert kept == "refs/dispatchd/displaced/20250101T000000/refs/tags/v1"
    git(r, "fsck", "--no-dangling")


def test_without_drops_a_record_and_its_peeled_line_only() -> None:
    text = "# pack-refs with: peeled fully-peeled sorted \n" + "1" * 40 + " refs/tags/a\n^" + "2" * 40 + "\n" + \
           "3" * 40 + " refs/tags/b\n^" + "4" * 40 + "\n"
    assert reflock.without(text, {"refs/tags/a"}, 40) == \
        "# pack-refs with: peeled fully-peeled sorted \n" + "3" * 40 + " refs/tags/b\n^" + "4" * 40 + "\n"


def test_a_lock_a_killed_restore_left_is_taken_over_and_git_s_own_is_not(tmp_path: Path) -> None:
    """A restore's lock is made with a second name of ours: one a daemon
    killed mid-restore left (both names) is taken over by the restore
    finished at the next start, where it used to be taken for the user's
    git's, the branch left at the session's commit and the user's git
    refused for good. The twin: a lock of one name (git's) is waited for,
    then refused, and left."""
    refs = tmp_path / "refs" / "heads"
    refs.mkdir(parents=True)
    (refs / _T("main", "0123456789abcdef")).write_text("x\n")
    os.link(refs / _T("main", "0123456789abcdef"), refs / "main.lock")
    adopt(refs)  # a killed daemon's: written down in its journal
    common = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # A live restore takes no lock over: a session's process can give the
        # lock the user's git holds a second name (ln main.lock x).
        with pytest.raises(reflock.Busy):
            reflock.take(common, "refs/heads/main", wait_s=0.05)
        assert (refs / "main.lock").read_text() == "x\n"
        held = reflock.take(common, "refs/heads/main", wait_s=0.05, take_over=True)  # at a start
        reflock.commit(held, b"y\n")
        assert (refs / "main").read_text() == "y\n" and not (refs / "main.lock").exists()
        assert sorted(p.name for p in refs.iterdir()) == ["main", _T("main", "0123456789abcdef")]
        (refs / "side.lock").write_text("git's\n")
        with pytest.raises(reflock.Busy):
            reflock.take(common, "refs/heads/side", wait_s=0.05, take_over=True)
        assert (refs / "side.lock").read_text() == "git's\n"
        assert not any(".dispatchd-" in p.name and p.name.startswith("side") for p in refs.iterdir())
    finally:
        os.close(common)
