"""Walks of trees a session shapes: iterative, by descriptor, bounded (``dispatchd/treewalk.py``)."""

from __future__ import annotations

import errno
import gc
import os
import warnings
import stat
from pathlib import Path


from dispatchd import treewalk
from dispatchd.daemon import leftovers
from dispatchd.tempfiles import sweep_temp_files, temp_name
from tests.unit.deeptrees import chain, touch

DEEP = 1500  # past Python's recursion limit (1,000)


def _nest(top: Path, depth: int, name: str = "d") -> Path:
    """``depth`` nested directories under ``top``, made by descriptor (the
    path grows past PATH_MAX), a file in the deepest; returns ``top``."""
    top.mkdir(parents=True, exist_ok=True)
    fd = chain(top, depth, name)
    try:
        touch(fd, "f", mode=0o600)
    finally:
        os.close(fd)
    return top


def test_the_recursive_walks_fail_on_a_deep_tree(tmp_path: Path) -> None:
    """The control: what the daemon used before raises on such a tree."""
    top = _nest(tmp_path / "t", DEEP)

    def fails() -> bool:
        try:
            for _ in os.fwalk(top, follow_symlinks=False):
                pass
        except RecursionError:
            return True
        except OSError as exc:  # or, under a lower descriptor limit, out of descriptors first (one a level)
            return exc.errno == errno.EMFILE
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the iterators it leaves open, collected here
        assert fails()
        gc.collect()


def test_remove_tree_removes_a_deep_tree_with_few_descriptors(tmp_path: Path) -> None:
    top = _nest(tmp_path / "t", DEEP)
    report = treewalk.remove_tree(str(top), treewalk.Budget(max_depth=16))
    assert report.skipped == [] and not top.exists()
    assert report.entries >= DEEP


def test_remove_tree_moves_up_deep_directories_made_unwritable(tmp_path: Path) -> None:
    top = _nest(tmp_path / "t", 40)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(40):  # every level r-x: nothing can be unlinked or moved as it is
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.chmod(f"/proc/self/fd/{nfd}", stat.S_IRUSR | stat.S_IXUSR)
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    report = treewalk.remove_tree(str(top), treewalk.Budget(max_depth=4))
    assert report.skipped == [] and not top.exists()


def test_remove_tree_gets_through_unreadable_directories_and_never_follows_a_symlink(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    top = tmp_path / "t"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("x")
    (top / "a" / "link").symlink_to(outside)
    (top / "a" / "b").chmod(0)
    (top / "a").chmod(stat.S_IRUSR | stat.S_IXUSR)  # not writable
    report = treewalk.remove_tree(str(top))
    assert report.skipped == [] and not top.exists()
    assert (outside / "keep").read_text() == "mine"  # the allowed twin: what the link points to stays


def test_remove_tree_over_its_entry_budget_stops_and_says_so(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    for i in range(50):
        (top / f"f{i}").write_text("")
    report = treewalk.remove_tree(str(top), treewalk.Budget(max_entries=10))
    assert report.over and "stopped after 10 entries" in report.describe()
    assert top.exists()  # left, not crashed on
    assert treewalk.remove_tree(str(top)).skipped == [] and not top.exists()  # with a budget that fits: gone


def test_remove_tree_of_a_file_a_symlink_or_nothing(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    assert treewalk.remove_tree(str(tmp_path / "l")).skipped == []
    assert (tmp_path / "f").exists() and not (tmp_path / "l").exists()
    assert treewalk.remove_tree(str(tmp_path / "f")).skipped == [] and not (tmp_path / "f").exists()
    assert treewalk.remove_tree(str(tmp_path / "none")).skipped == []


def test_walk_skips_below_its_depth_and_never_recurses(tmp_path: Path) -> None:
    top = _nest(tmp_path / "t", DEEP)
    budget = treewalk.Budget(max_depth=100)
    seen = [path for path, _, _ in treewalk.walk(str(top), budget)]
    assert len(seen) == 100
    assert "deeper than 100 levels, not walked" in budget.describe()


def test_walk_lists_as_fwalk_does_on_a_shallow_tree(tmp_path: Path) -> None:
    top = tmp_path / "t"
    (top / "a" / "b").mkdir(parents=True)
    (top / "c").mkdir()
    (top / "x").write_text("")
    (top / "a" / "y").write_text("")
    (top / "a" / "l").symlink_to(top / "c")
    ours = sorted((p, sorted(files)) for p, files, _ in treewalk.walk(str(top), treewalk.Budget()))
    # fwalk lists a symlink to a directory among the directories (not entered); here it is a non-directory.
    theirs = sorted((p, sorted(files + [d for d in dirs if os.path.islink(os.path.join(p, d))]))
                    for p, dirs, files, _ in os.fwalk(os.fsencode(top), follow_symlinks=False))
    assert ours == theirs


def test_the_sweep_survives_a_deep_worktree_and_still_removes_shallow_temp_files(tmp_path: Path) -> None:
    top = _nest(tmp_path / "wt", DEEP)
    leftover = top / temp_name("main.py")
    leftover.write_text("cut short")
    (top / "keep.txt").write_text("mine")
    removed = sweep_temp_files(str(top))
    assert removed == [str(leftover)] and (top / "keep.txt").exists()


def test_remove_stale_gets_through_a_deep_scratch_directory(tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    _nest(sessions / "0123456789ab" / "tmp", DEEP)
    assert leftovers.remove_stale(str(sessions)) == 1
    assert os.listdir(sessions) == []


def test_walk_over_its_entry_budget_lists_that_many_and_says_so(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"d{i}").mkdir()
        for j in range(4):
            (tmp_path / f"d{i}" / f"f{j}").write_text("x")
    budget = treewalk.Budget(max_entries=9)  # 3 directories + 12 files: over
    listed = sum(len(files) for _, files, _ in treewalk.walk(str(tmp_path), budget)) + 3
    assert budget.over and budget.entries == 10  # the one over the budget is counted, never listed
    assert listed <= 9
    assert budget.describe() == "stopped after 9 entries (its budget)"
    fits = treewalk.Budget(max_entries=15)  # the twin: exactly enough
    names = sorted(f.decode() for _, files, _ in treewalk.walk(str(tmp_path), fits) for f in files)
    assert not fits.over and fits.entries == 15 and fits.describe() == ""
    assert names == sorted(f"f{j}" for _ in range(3) for j in range(4))
