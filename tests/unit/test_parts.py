"""A part's repository, as domains relate by it (``Part.related_common``):
resolved once, at its join, never again from what a session can plant; a
record of an older daemon resolved now, and a path that cannot be resolved
(a loop, a chain of symbolic links too deep to follow) taken as "/", which
relates to every worktree, instead of an error on every open."""

from __future__ import annotations

import os
from pathlib import Path

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import runnables, snapshots
from dispatchd.daemon.gitguard.parts import Part
from dispatchd.inside import worktrees_relate


def _part(root: Path, resolved_common: str = "") -> Part:
    return Part(root=str(root), layout=GitLayout("repository"), git=snapshots.GitSnapshot(), redirects=[],
                tree=runnables.TreeSnapshot(), names=[], resolved_common=resolved_common)


def test_the_common_resolved_at_the_join_is_kept(tmp_path: Path) -> None:
    (tmp_path / "r" / ".git").mkdir(parents=True)
    part = _part(tmp_path / "r", resolved_common=str(tmp_path / "r" / ".git"))
    os.rmdir(tmp_path / "r" / ".git")
    (tmp_path / "r" / ".git").symlink_to("/")  # planted later: not followed again
    assert part.related_common == str(tmp_path / "r" / ".git")


def test_an_older_record_is_resolved_now(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".git").symlink_to(tmp_path / "real")
    assert _part(tmp_path / "r").related_common == str(tmp_path / "real")


def test_a_chain_too_deep_to_follow_relates_to_every_worktree(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    target = tmp_path / "end"
    target.mkdir()
    for i in range(1200):
        link = tmp_path / f"l{i}"
        link.symlink_to(target)
        target = link
    (tmp_path / "r" / ".git").symlink_to(target)
    part = _part(tmp_path / "r")
    assert part.related_common == "/"
    assert worktrees_relate("/elsewhere", "", part.root, part.related_common)
