"""dispatchd/tools/changes.py on a real directory (inotify needs no privilege)."""

from __future__ import annotations

import os
import time
from contextlib import closing
from pathlib import Path

import pytest

from dispatchd.tools.changes import MAX_CHANGED, TooLarge, Watcher


def test_what_changed_since_a_mark(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    (tmp_path / "old.txt").write_text("x")
    (tmp_path / ".git").mkdir()
    with closing(Watcher(str(tmp_path), 100)) as w:
        before = time.monotonic()
        (tmp_path / "new.txt").write_text("y")
        (tmp_path / "old.txt").unlink()
        (tmp_path / "d" / "e").mkdir(parents=True)
        (tmp_path / "d" / "e" / "f").write_text("z")
        (tmp_path / ".git" / "HEAD").write_text("ref")
        (tmp_path / "keep.txt").read_text()  # read only: not a change
        paths, truncated, unknown = w.since(before)
        assert sorted(paths) == ["d", "d/e", "d/e/f", "new.txt", "old.txt"]
        assert (truncated, unknown) == (False, False)
        later = time.monotonic()
        assert w.since(later) == ([], False, False)  # each call its own window
        (tmp_path / "d" / "e" / "g").write_text("a")  # a directory made after the watch started is watched
        assert w.since(later)[0] == ["d/e/g"]


def test_a_long_list_is_cut(tmp_path: Path) -> None:
    with closing(Watcher(str(tmp_path), 100)) as w:
        before = time.monotonic()
        for i in range(MAX_CHANGED + 5):
            os.close(os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY))
        paths, truncated, _ = w.since(before)
        assert len(paths) == MAX_CHANGED and truncated


def test_a_name_that_is_not_utf8_is_shown_escaped(tmp_path: Path) -> None:
    with closing(Watcher(str(tmp_path), 100)) as w:
        before = time.monotonic()
        os.close(os.open(os.path.join(os.fsencode(tmp_path), b"bad\xff"), os.O_CREAT | os.O_WRONLY))
        os.mkdir(os.path.join(os.fsencode(tmp_path), b"dir\xfe"))
        paths = w.since(before)[0]
        assert sorted(paths) == ["bad\\xff", "dir\\xfe"]
        for p in paths:
            p.encode("utf-8")  # a reply can carry it


def test_a_tree_there_before_the_watch_is_watched_whole(tmp_path: Path) -> None:
    for d in ("a/b/c", "x", ".git/hooks", "a/.git"):
        (tmp_path / d).mkdir(parents=True)
    for i in range(30):
        (tmp_path / "a" / f"f{i}").write_text("x")
    with closing(Watcher(str(tmp_path), 100)) as w:
        # Every directory but the root's .git (git's churn, reported by the git protection).
        assert sorted(w._wds.values()) == ["", "a", "a/.git", "a/b", "a/b/c", "x"]
        before = time.monotonic()
        (tmp_path / "a" / "b" / "c" / "deep").write_text("y")
        (tmp_path / ".git" / "hooks" / "pre-commit").write_text("z")
        assert w.since(before) == (["a/b/c/deep"], False, False)


@pytest.mark.parametrize("dirs", [3, 5])
def test_the_first_build_counts_directories_against_its_bound(tmp_path: Path, dirs: int) -> None:
    """A tree too large is not watched; one directory more allowed, it is."""
    for i in range(dirs):
        (tmp_path / f"d{i}").mkdir()
    with pytest.raises(TooLarge, match=f"more than {dirs} directories"):
        Watcher(str(tmp_path), dirs)  # one more with the root
    Watcher(str(tmp_path), dirs + 1).close()
