"""SessionManager._points_back: a linked worktree's common directory is granted
only if its git directory names, literally, the ``.git`` of the path the
daemon walked and checked (a path swapped for a symlink to another
repository's linked worktree while git was inspected does not)."""

from __future__ import annotations

from pathlib import Path

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.sessions import SessionManager


def _layout(tmp_path: Path, back: str) -> GitLayout:
    gitdir = tmp_path / "repo" / ".git" / "worktrees" / "wt"
    gitdir.mkdir(parents=True)
    (gitdir / "gitdir").write_text(back + "\n")
    return GitLayout("linked", gitdirs=[str(gitdir)])


def test_a_git_directory_pointing_back_at_the_checked_path(tmp_path: Path):
    assert SessionManager._points_back(_layout(tmp_path, "/src/mono/proj/.git"), "/src/mono/proj")


def test_a_git_directory_of_another_worktree_reached_through_a_swap(tmp_path: Path):
    assert not SessionManager._points_back(_layout(tmp_path, "/home/u/other-wt/.git"), "/src/mono/proj")


def test_a_git_directory_without_its_pointer(tmp_path: Path):
    layout = _layout(tmp_path, "/src/mono/proj/.git")
    (Path(layout.gitdirs[0]) / "gitdir").unlink()
    assert not SessionManager._points_back(layout, "/src/mono/proj")
    (Path(layout.gitdirs[0]) / "gitdir").symlink_to(tmp_path / "elsewhere")  # never followed
    (tmp_path / "elsewhere").write_text("/src/mono/proj/.git\n")
    assert not SessionManager._points_back(layout, "/src/mono/proj")
