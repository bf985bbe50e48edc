"""Around a checkpoint's restore, the refs it moved other than forward kept
(daemon/gitguard/refsback.py ``keep_moved``), in a repository made by
``git clone --shared``: its commits are all in the store its alternates
name. Forward is told by that store too, as the end's ``put_back`` tells
it; a move that is not forward is kept whatever the stores say."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, refsback, viewfiles
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process  # git makes the repositories


def _shared(tmp_path: Path) -> tuple[Path, dict[str, str], list[str]]:
    """A shared clone of three commits c0..c2 (main at c2) and a branch
    ``side`` off c0, none of them in the clone's own objects; the commits
    by name, and the stores its alternates name (``history.borrowed`` of
    a baseline's record)."""
    src = commits_repo(tmp_path / "src", 3)
    git(src, "checkout", "-q", "-b", "side", "HEAD~2")
    (src / "s").write_text("side\n")
    git(src, "add", "s")
    git(src, "commit", "-qm", "side")
    git(src, "checkout", "-q", "-")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--shared", str(src), str(clone))
    git(clone, "branch", "-q", "side", "origin/side")
    assert list((clone / ".git" / "objects" / "pack").iterdir()) == []  # all borrowed
    ids = {name: git(clone, "rev-parse", rev).strip() for name, rev in
           (("c0", "HEAD~2"), ("c2", "HEAD"), ("side", "side"))}
    common = str(clone / ".git")
    borrowed = history.borrowed(history.History(common=common, views=viewfiles.read(common)))
    assert borrowed == [str(src / ".git" / "objects")]
    return clone, ids, borrowed


def _branch(clone: Path) -> str:
    return git(clone, "symbolic-ref", "HEAD").strip()


def test_a_ref_moved_forward_along_borrowed_commits_is_not_kept(tmp_path: Path) -> None:
    clone, ids, borrowed = _shared(tmp_path)
    main = _branch(clone)
    kept, failed = refsback.keep_moved(str(clone / ".git"), {main: ids["c0"]}, borrowed)  # the restore: c0 -> c2
    assert (kept, failed) == ([], [])
    assert git(clone, "for-each-ref", "refs/dispatchd/") == ""
    # Without the alternates the ancestry cannot be told: the old value is kept (nothing lost, noise).
    kept, failed = refsback.keep_moved(str(clone / ".git"), {main: ids["c0"]})
    assert failed == [] and len(kept) == 1 and kept[0].endswith(main)


@pytest.mark.parametrize("was", ["c2-backward", "side"])
def test_a_ref_moved_backward_or_sideways_is_kept_with_the_alternates_asked(tmp_path: Path, was: str) -> None:
    """The twins: main moved from c2 back to c0, or from ``side`` to c2
    (neither an ancestor of the other): the value it had is kept."""
    clone, ids, borrowed = _shared(tmp_path)
    main = _branch(clone)
    if was == "c2-backward":
        git(clone, "update-ref", main, ids["c0"])
    old = ids["c2"] if was == "c2-backward" else ids["side"]
    kept, failed = refsback.keep_moved(str(clone / ".git"), {main: old}, borrowed)
    assert failed == [] and len(kept) == 1
    assert kept[0].startswith("refs/dispatchd/displaced/") and kept[0].endswith(f"/{main}")
    assert git(clone, "rev-parse", kept[0]).strip() == old
