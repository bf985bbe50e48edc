"""dispatchd.daemon.gitguard.redirects: redirect files a session created, in any
git directory or linked worktree entry, moved aside; nothing reached through
a symlink touched."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import layouts, redirects
from tests.unit import permission_bits
from tests.unit.gitrepo import git, submodule_repo

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


def test_redirects_in_any_git_directory_are_moved_aside(tmp_path: Path) -> None:
    r = submodule_repo(tmp_path)
    layout = layouts.inspect_git(str(r), uid=os.getuid())
    before = redirects.redirects_present(layout, str(r))
    assert before == []  # the other worktree's commondir leads back to .git
    # A worktree the session adds itself is fine, until its commondir is aimed elsewhere.
    git(r, "worktree", "add", "-q", str(r / "added"), "-b", "added")
    assert redirects.redirects_present(layout, str(r)) == []
    planted = [r / ".git" / "modules" / "libs" / "sub" / "commondir", r / "emb" / ".git" / "config.worktree",
               r / ".git" / "commondir"]
    for p in planted:
        p.write_text("../evil\n")
    assert sorted(redirects.redirects_present(layout, str(r))) == sorted(map(str, planted))
    (r / ".git" / "worktrees" / "added" / "commondir").write_text(str(tmp_path / "evil") + "\n")
    moved, failed = redirects.quarantine_new_redirects(layout, before, str(r))
    assert failed == [] and len(moved) == 4 and all(".quarantined-by-dispatchd-" in m for m in moved)
    assert not any(p.exists() for p in planted)
    assert not (r / ".git" / "worktrees" / "added" / "commondir").exists()


def test_a_garbled_commondir_is_a_redirect_not_a_crash(repo: Path) -> None:
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    entry = repo / ".git" / "worktrees" / "zz"
    entry.mkdir(parents=True)
    (entry / "commondir").write_bytes(b"\0")
    assert redirects.redirects_present(layout, str(repo)) == [str(entry / "commondir")]
    moved, failed = redirects.quarantine_new_redirects(layout, [], str(repo))
    assert failed == [] and len(moved) == 1 and not (entry / "commondir").exists()


def test_a_read_only_git_directory_does_not_keep_a_redirect(repo: Path) -> None:
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    (repo / ".git" / "commondir").write_text("../evil\n")
    os.chmod(repo / ".git", 0o555)
    try:
        with permission_bits.obeyed():  # the rename meets EACCES, and the chmod is tried
            moved, failed = redirects.quarantine_new_redirects(layout, [], str(repo))
    finally:
        os.chmod(repo / ".git", 0o755)
    assert failed == [] and len(moved) == 1 and not (repo / ".git" / "commondir").exists()


def test_quarantine_names_cannot_be_taken_in_advance(repo: Path) -> None:
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    (repo / ".git" / "commondir").write_text("../evil\n")
    now = int(time.time())
    for t in range(now - 2, now + 300):
        (repo / ".git" / f"commondir.quarantined-by-dispatchd-{t}").mkdir()
        (repo / ".git" / f"commondir.quarantined-by-dispatchd-{t}" / "x").write_text("x")
    moved, failed = redirects.quarantine_new_redirects(layout, [], str(repo))
    assert failed == [] and len(moved) == 1 and not (repo / ".git" / "commondir").exists()


def test_symlinks_under_git_never_take_the_daemon_elsewhere(repo: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    git(other, "commit", "-q", "--allow-empty", "-m", "o")
    git(other, "worktree", "add", "-q", str(tmp_path / "owt"), "-b", "o")
    foreign = other / ".git" / "worktrees" / "owt" / "commondir"
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    # .git/worktrees and .git/modules made symlinks to another repository's.
    (repo / ".git" / "worktrees").symlink_to(other / ".git" / "worktrees")
    (repo / ".git" / "modules").symlink_to(tmp_path)
    (foreign).write_text("../../../../elsewhere\n")  # as if aimed elsewhere: still not ours to touch
    assert redirects.redirects_present(layout, str(repo)) == []
    assert redirects.quarantine_new_redirects(layout, [], str(repo)) == ([], [])
    assert foreign.exists()
    again = layouts.inspect_git(str(repo), uid=os.getuid())
    assert again.gitdirs == [str(repo / ".git")]  # the modules symlink is not walked
    assert not (tmp_path / "hooks").exists()


def test_a_git_directory_replaced_by_a_symlink_is_itself_moved_aside(repo: Path, tmp_path: Path) -> None:
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "index").write_text("not ours")
    os.rename(repo / ".git", repo / ".git-real")
    (repo / ".git").symlink_to(elsewhere)
    assert redirects.redirects_present(layout, str(repo)) == [str(repo / ".git")]
    moved, failed = redirects.quarantine_new_redirects(layout, [], str(repo))
    assert failed == [] and len(moved) == 1 and not os.path.lexists(repo / ".git")
    assert (elsewhere / "index").read_text() == "not ours"
