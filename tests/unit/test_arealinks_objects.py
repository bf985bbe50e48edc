"""dispatchd.daemon.gitguard.arealinks on real repositories: a packed ref's
reflog split under its ref's lock."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import gitlock
from tests.unit.gitrepo import ENV, git, one_file_repo
from tests.unit.test_hardlinks_users import AREA, baseline, end

pytestmark = pytest.mark.process  # starts git


def _feature_reflog(tmp_path: Path, packed: bool) -> tuple[Path, Path, str]:
    repo = one_file_repo(tmp_path / "repo", "app.py")
    git(repo, "branch", "feature/x")
    if packed:
        git(repo, "pack-refs", "--all")  # prunes refs/heads/feature/x and its now empty directory
    assert (repo / ".git" / "refs" / "heads" / "feature").exists() != packed
    reflog = repo / ".git" / "logs" / "refs" / "heads" / "feature" / "x"
    newer = git(repo, "commit-tree", "-m", "c2", "-p", "HEAD", "HEAD^{tree}").strip()
    return repo, reflog, newer


def _update_ref(repo: Path, newer: str) -> str:
    run = subprocess.run(["git", "update-ref", "-m", "user's update", "refs/heads/feature/x", newer],
                         cwd=repo, env=ENV, capture_output=True, text=True)
    return f"{run.returncode}:{run.stderr}"


def _user_git_during_split(monkeypatch: pytest.MonkeyPatch, repo: Path, newer: str) -> list[str]:
    """The user's ``git update-ref`` run while the end has copied the reflog and not yet renamed the copy."""
    said: list[str] = []

    def step(name: str) -> None:
        if name == "written" and not said:
            said.append(_update_ref(repo, newer))
    monkeypatch.setattr(gitlock, "_step", step)
    return said


@pytest.mark.parametrize("packed", [True, False])
def test_a_reflog_is_split_under_its_ref_s_lock_its_ref_packed_or_loose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: bool) -> None:
    """A branch's reflog linked elsewhere by a session is split at the end
    holding ``refs/heads/feature/x.lock``, as git would take it: the user's
    git run meanwhile fails loudly, nothing of theirs lost, and succeeds
    after. A packed ref's directory (``git pack-refs --all`` removed
    ``refs/heads/feature/``) is made for the lock and removed after (before:
    no lock taken there, and the user's reflog line, appended to the old
    inode, was lost). The loose ref is the twin."""
    repo, reflog, newer = _feature_reflog(tmp_path, packed)
    part = baseline(repo)
    os.link(reflog, repo / "elsewhere")  # the session
    said = _user_git_during_split(monkeypatch, repo, newer)
    done, failed = end(part)
    assert failed == [] and (str(reflog), AREA.format(1)) in done, done
    assert said and said[0].startswith("128:") and "refs/heads/feature/x.lock" in said[0], said
    assert os.stat(reflog).st_nlink == 1
    assert (repo / ".git" / "refs" / "heads" / "feature").exists() != packed
    assert _update_ref(repo, newer) == "0:"
    assert "user's update" in reflog.read_text() and "user's update" not in (repo / "elsewhere").read_text()


def test_a_symlink_in_place_of_a_packed_ref_s_directory_is_not_followed(tmp_path: Path) -> None:
    """A session leaves ``refs/heads/feature`` a symlink to a directory of
    the user's: no lock is made there (nor anything else), and the reflog
    is split all the same. The twin is the packed ref's case above."""
    repo, reflog, _ = _feature_reflog(tmp_path, packed=True)
    part = baseline(repo)
    users = tmp_path / "users"
    users.mkdir()
    (repo / ".git" / "refs" / "heads" / "feature").symlink_to(users)
    os.link(reflog, repo / "elsewhere")
    done, failed = end(part)
    assert failed == [] and (str(reflog), AREA.format(1)) in done, done
    assert list(users.iterdir()) == []
