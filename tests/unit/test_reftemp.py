"""A ref the daemon puts back is written through a temporary file: what a
daemon killed before the rename leaves is listed by git as no branch, and
the next start removes it, and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import baselines, history, layouts, ournames, redirects, reftemp, snapshots
from tests.unit.gitrepo import git
from tests.unit.leftovers import adopt


pytestmark = pytest.mark.process  # git makes the repositories


_MADE: dict[tuple[str, str], str] = {}


def _T(leaf: str, key: str) -> str:
    """A temporary's name of ours for ``leaf`` (``ournames``: only the daemon's key makes one), one per ``key``."""
    return _MADE.setdefault((leaf, key), os.path.basename(ournames.make(leaf)))


class Killed(BaseException):
    """The daemon's death between the temporary file and its rename."""


def _repo(path: Path) -> tuple[Path, str]:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / "f").write_text("f\n")
    git(path, "add", "f")
    git(path, "commit", "-qm", "one")
    return path, git(path, "rev-parse", "HEAD").strip()


def _refs(repo: Path) -> list[str]:
    return git(repo, "for-each-ref", "--format=%(refname)").split()


def _killed_at_rename(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon killed between taking a ref's lock (``reflock.held``:
    ``NAME.lock``, made whole with a second name of ours) and its rename
    over the ref."""
    real = os.rename

    def rename(src: str, dst: str, *args: object, **kwargs: object) -> None:
        if "src_dir_fd" in kwargs and str(src).endswith(".lock"):
            raise Killed
        real(src, dst, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(history.os, "rename", rename)


def test_a_put_back_cut_short_leaves_files_git_lists_as_no_ref_and_the_next_put_back_writes_the_ref(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, head = _repo(tmp_path / "repo")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / ".git" / "refs" / "heads" / "main").unlink()  # a session's deed
    with monkeypatch.context() as patched:
        _killed_at_rename(patched)
        with pytest.raises(Killed):
            history.restore(kept)
    heads = repo / ".git" / "refs" / "heads"
    left = sorted(os.listdir(heads))
    assert len(left) == 2 and left[0].startswith("main.dispatchd-") and left[0].endswith(".lock")
    assert left[1] == "main.lock" and os.stat(heads / "main.lock").st_nlink == 2  # one file, two names
    assert (heads / "main.lock").read_text() == head + "\n"  # the value was written
    git(repo, "update-ref", "refs/heads/other", head)
    assert _refs(repo) == ["refs/heads/other"]
    # The next put back (a start's check) takes the lock it left, not waiting for it, and writes the ref.
    done, failed = history.restore(kept)
    assert failed == [] and ("refs/heads/main", f"deleted by a session; put back at {head[:12]}") in done
    assert _refs(repo) == ["refs/heads/main", "refs/heads/other"]
    assert reftemp.sweep(str(repo / ".git"), ["refs/heads/main"]) == [str(heads / left[0])]
    assert sorted(os.listdir(heads)) == ["main", "other"]
    # The twin: the same file under the name the daemon used before is a branch to git.
    (heads / "main.dispatchd-1.tmp").write_text(head + "\n")
    assert _refs(repo) == ["refs/heads/main", "refs/heads/main.dispatchd-1.tmp", "refs/heads/other"]


def _joined(tmp_path: Path) -> tuple[Path, str, baselines.Baselines]:
    """A repository, its HEAD, and a daemon's baselines that joined a session on it (to be closed as dead)."""
    repo, head = _repo(tmp_path / "repo")
    dead = baselines.Baselines(str(tmp_path / "state"))
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    dead.join("s", str(repo), layout, snapshots.take(str(repo), layout),
              redirects.redirects_present(layout, str(repo)), ())
    return repo, head, dead


def test_a_start_removes_what_a_put_back_cut_short_left_and_nothing_else(tmp_path: Path) -> None:
    repo, head, dead = _joined(tmp_path)
    heads = repo / ".git" / "refs" / "heads"
    ours = heads / _T("main", "0123456789abcdef")
    ours.write_text(head + "\n")
    displaced = repo / ".git" / "refs" / "dispatchd" / "displaced" / "20261130T000000" / "refs" / "heads"
    displaced.mkdir(parents=True)
    (displaced / _T("main", "fedcba9876543210")).write_text(head + "\n")
    (repo / ".git" / _T("HEAD", "00000000000000aa")).write_text("ref: refs/heads/main\n")
    # What stays: git's own lock, a name not wholly ours, a directory and a symlink named like ours.
    (heads / "main.lock").write_text(head + "\n")
    (heads / "main.dispatchd-0123456789abcdef.tmp").write_text(head + "\n")
    (heads / _T("x", "1111111111111111")).mkdir()
    victim = tmp_path / "victim"
    victim.write_text("the user's\n")
    (heads / _T("y", "2222222222222222")).symlink_to(victim)
    adopt(heads, displaced, repo / ".git")
    os.close(next(iter(dead._domains.values())).lock_fd)  # what the kernel does for a dead daemon
    baselines.Baselines(str(tmp_path / "state")).recover()
    assert sorted(os.listdir(heads)) == ["main", "main.dispatchd-0123456789abcdef.tmp", "main.lock",
                                         _T("x", "1111111111111111"), _T("y", "2222222222222222")]
    assert os.listdir(displaced) == [] and not (repo / ".git" / _T("HEAD", "00000000000000aa")).exists()
    assert victim.read_text() == "the user's\n"


def test_the_sweep_goes_into_no_symlinked_directory(tmp_path: Path) -> None:
    """Neither as the last component nor on the way: ``refs`` or
    ``refs/dispatchd/displaced`` a symlink to the user's files (with
    directories below it). The twin: the same files in real directories go."""
    common = tmp_path / "git"
    (common / "refs" / "dispatchd").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "heads").mkdir(parents=True)
    (elsewhere / "sub").mkdir()
    ours = _T("a", "0123456789abcdef")
    for d in (elsewhere, elsewhere / "heads", elsewhere / "sub"):
        (d / ours).write_text("x\n")
    adopt(elsewhere, elsewhere / "heads", elsewhere / "sub")
    (common / "refs" / "dispatchd" / "displaced").symlink_to(elsewhere)
    assert reftemp.sweep(str(common), ["refs/heads/a", "refs/sub/a"]) == []
    os.rename(common / "refs", tmp_path / "refs-aside")
    (common / "refs").symlink_to(elsewhere)  # refs/heads/ and refs/sub/ then lead into the user's files
    assert reftemp.sweep(str(common), ["refs/heads/a", "refs/sub/a"]) == []
    assert all((d / ours).exists() for d in (elsewhere, elsewhere / "heads", elsewhere / "sub"))
    os.unlink(common / "refs")  # the twin: real directories are swept, displaced ones at any depth
    (common / "refs" / "heads").mkdir(parents=True)
    (common / "refs" / "heads" / ours).write_text("x\n")
    deep = common / "refs" / "dispatchd" / "displaced" / "20261130T000000" / "refs" / "sub"
    deep.mkdir(parents=True)
    (deep / ours).write_text("x\n")
    adopt(common / "refs" / "heads", deep)
    assert reftemp.sweep(str(common), ["refs/heads/a"]) == sorted(
        [str(common / "refs" / "dispatchd" / "displaced" / "20261130T000000" / "refs" / "sub" / ours),
         str(common / "refs" / "heads" / ours)])


def test_two_values_kept_in_one_second_under_one_name_are_both_kept(tmp_path: Path) -> None:
    """Two restores (or a restore and an end) in the same second that each
    keep a value of ``main``: the second is kept beside the first, never
    over it; the same value kept again (a restore finished after a death)
    takes the same name."""
    repo, first = _repo(tmp_path / "r")
    git(repo, "commit", "-q", "--allow-empty", "-m", "two")
    second = git(repo, "rev-parse", "HEAD").strip()
    common = str(repo / ".git")
    when = "20261201T101500"
    a = reftemp.keep_displaced(common, when, "refs/heads/main", first)
    again = reftemp.keep_displaced(common, when, "refs/heads/main", first)
    b = reftemp.keep_displaced(common, when, "refs/heads/main", second)
    assert (a, again, b) == (f"{reftemp.DISPLACED}{when}/refs/heads/main",) * 2 + (
        f"{reftemp.DISPLACED}{when}.2/refs/heads/main",)
    git(repo, "pack-refs", "--all")  # as git gc leaves them: the name held in packed-refs only
    assert not (repo / ".git" / a).exists() and not (repo / ".git" / b).exists()
    c = reftemp.keep_displaced(common, when, "refs/heads/main", git(repo, "rev-parse", "HEAD~1^{tree}").strip())
    assert c == f"{reftemp.DISPLACED}{when}.3/refs/heads/main"
    assert git(repo, "rev-parse", a, b).split() == [first, second]


def test_a_value_kept_in_another_second_takes_its_own_name(tmp_path: Path) -> None:
    """The twin: nothing kept under WHEN yet, the plain name is taken."""
    repo, first = _repo(tmp_path / "r")
    common = str(repo / ".git")
    reftemp.keep_displaced(common, "20261201T101500", "refs/heads/main", first)
    assert reftemp.keep_displaced(common, "20261201T101501", "refs/heads/main", first) == \
        f"{reftemp.DISPLACED}20261201T101501/refs/heads/main"


def test_a_start_removes_a_ref_lock_a_killed_end_left_with_its_second_name(tmp_path: Path) -> None:
    """An end killed holding a ref's lock (``reflock``: a temporary of ours
    hard-linked to ``NAME.lock``) left both names; when no later check writes
    that ref, nothing took the lock over, and the user's git could not move
    the branch again. The start's sweep removes both. The twin: a lock of
    git's own (one name) is left, and so is a lock that is another file than
    a temporary's second name (the temporary itself goes: a name of ours)."""
    repo, head, dead = _joined(tmp_path)
    heads = repo / ".git" / "refs" / "heads"
    (heads / _T("side", "0123456789abcdef")).write_text(head + "\n")
    os.link(heads / _T("side", "0123456789abcdef"), heads / "side.lock")
    (heads / "main.lock").write_text(head + "\n")  # git's own
    (heads / _T("other", "fedcba9876543210")).write_text(head + "\n")
    os.link(heads / _T("other", "fedcba9876543210"), heads / "other.extra")
    (heads / "other.lock").write_text(head + "\n")  # a file of its own, not the pair's second name
    adopt(heads)  # the killed end's: written down in its journal
    os.close(next(iter(dead._domains.values())).lock_fd)
    baselines.Baselines(str(tmp_path / "state")).recover()
    assert not (heads / "side.lock").exists() and not (heads / _T("side", "0123456789abcdef")).exists()
    assert (heads / "main.lock").exists() and (heads / "other.lock").exists() and (heads / "other.extra").exists()
    assert not (heads / _T("other", "fedcba9876543210")).exists()


def test_the_sweep_reaches_a_lock_left_on_a_ref_it_was_not_told_of(tmp_path: Path) -> None:
    """A restore killed while it deleted a tag the session made: the tag's
    lock, a second name of our temporary, in a directory of no ref the
    baseline held. Before, the start swept only those refs' directories, and
    the lock refused the user's `git tag` for good."""
    common = tmp_path / "git"
    tags = common / "refs" / "tags"
    tags.mkdir(parents=True)
    ours = _T("t1", "0123456789abcdef")
    (tags / ours).write_text("x\n")
    os.link(tags / ours, tags / "t1.lock")
    adopt(tags)
    removed = reftemp.sweep(str(common), ["refs/heads/main", "HEAD"])
    assert removed == sorted([str(tags / "t1.lock"), str(tags / ours)])
    # The twin: a lock of one name (a running git's) stays.
    (tags / "t2.lock").write_text("")
    assert reftemp.sweep(str(common), ["refs/heads/main", "HEAD"]) == [] and (tags / "t2.lock").exists()
