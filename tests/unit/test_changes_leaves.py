"""dispatchd/tools/changes.py: the first build skips listing the directories
whose link count says they hold no subdirectory, and still misses nothing."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from dispatchd.tools import changes
from dispatchd.tools.changes import Watcher

BTRFS = 0x9123683E  # directories there always have a link count of 1


def _tree(root: Path) -> None:
    for d in ("a/b/c", "x", "y", ".git/objects"):
        (root / d).mkdir(parents=True)
    for i in range(20):
        (root / "a" / f"f{i}").write_text("x")
        (root / "y" / f"g{i}").write_text("x")


@pytest.fixture
def listed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The directories the module lists (``os.scandir``), relative to nothing: full paths."""
    seen: list[str] = []
    real = os.scandir

    def scandir(path: Any) -> Any:
        seen.append(os.fsdecode(path))
        return real(path)

    monkeypatch.setattr(changes.os, "scandir", scandir)
    yield seen


def _exact(path: Path) -> bool:
    return changes._fs_type(str(path)) in changes._EXACT_NLINK


def test_leaves_are_not_listed_where_link_counts_are_exact(tmp_path: Path, listed: list[str]) -> None:
    if not _exact(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext2/3/4, xfs or tmpfs")
    _tree(tmp_path)
    with closing(Watcher(str(tmp_path), 100)) as w:
        assert sorted(w._wds.values()) == ["", "a", "a/b", "a/b/c", "x", "y"]  # every directory watched
        # Listed: those with a subdirectory (the root, a, a/b); not x, y, a/b/c.
        assert sorted(os.path.relpath(p, tmp_path) for p in listed) == [".", "a", "a/b"]
        before = time.monotonic()
        (tmp_path / "y" / "g0").write_text("changed")  # in a leaf not listed
        (tmp_path / "a" / "b" / "c" / "new").mkdir()  # a directory made in one
        paths, truncated, unknown = w.since(before)
        assert sorted(paths) == ["a/b/c/new", "y/g0"] and (truncated, unknown) == (False, False)
        later = time.monotonic()
        (tmp_path / "a" / "b" / "c" / "new" / "f").write_text("z")  # and that one is watched
        assert w.since(later) == (["a/b/c/new/f"], False, False)


@pytest.mark.parametrize("fs_type", [BTRFS, None], ids=["btrfs", "not known"])
def test_every_directory_is_listed_elsewhere(tmp_path: Path, listed: list[str], monkeypatch: pytest.MonkeyPatch,
                                             fs_type: int | None) -> None:
    """The twin: a file system whose link counts do not tell (btrfs says 1),
    or one that cannot be asked (statfs failed): every directory is listed."""
    monkeypatch.setattr(changes, "_fs_type", lambda path: fs_type)
    _tree(tmp_path)
    with closing(Watcher(str(tmp_path), 100)) as w:
        assert w._exact_dev is None
        assert sorted(w._wds.values()) == ["", "a", "a/b", "a/b/c", "x", "y"]
        assert sorted(os.path.relpath(p, tmp_path) for p in listed) == [".", "a", "a/b", "a/b/c", "x", "y"]
        before = time.monotonic()
        (tmp_path / "x" / "new").write_text("y")
        assert w.since(before) == (["x/new"], False, False)


def _lstat_hook(monkeypatch: pytest.MonkeyPatch, at: str, before: Callable[[], None] | None,
                after: Callable[[], None] | None) -> None:
    """``os.lstat`` of ``at`` (in the module) runs ``before``/``after`` around the real one."""
    real = os.lstat

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        hit = os.fsdecode(path) == at
        if hit and before is not None:
            before()
        st = real(path, *args, **kwargs)
        if hit and after is not None:
            after()
        return st

    monkeypatch.setattr(changes.os, "lstat", lstat)


@pytest.mark.parametrize("when", ["before the count", "after the count"])
def test_a_directory_made_in_a_leaf_during_the_build_is_not_missed(tmp_path: Path, when: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """After the watch is added and before its link count is read: the count
    shows it (listed, watched). After the count: an event of the watch."""
    if not _exact(tmp_path):
        pytest.skip(f"{tmp_path} is not on ext2/3/4, xfs or tmpfs")
    _tree(tmp_path)

    def make() -> None:
        (tmp_path / "x" / "late").mkdir()
        (tmp_path / "x" / "late" / "f").write_text("z")

    leaf = str(tmp_path / "x")
    _lstat_hook(monkeypatch, leaf, make if when == "before the count" else None,
                make if when == "after the count" else None)
    with closing(Watcher(str(tmp_path), 100)) as w:
        monkeypatch.undo()
        w.drain()
        assert "x/late" in w._wds.values()  # watched either way
        later = time.monotonic()
        (tmp_path / "x" / "late" / "g").write_text("z")
        assert w.since(later) == (["x/late/g"], False, False)
