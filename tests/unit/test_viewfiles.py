"""``shallow`` and the alternates are put back at the end as they were at
the baseline (dispatchd/daemon/gitguard/viewfiles.py): a session's hide
the user's history or lead their git elsewhere; the user's, deleted,
leave their repository without its objects or its graft points."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, viewfiles
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process


def _repo(tmp_path: Path, name: str = "repo") -> Path:
    return commits_repo(tmp_path / name)


def _count(repo: Path) -> str:
    return subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=repo, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def test_a_session_s_shallow_goes_and_the_history_shows_again(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.views == {"shallow": None, "objects/info/alternates": None, "objects/info/http-alternates": None}
    assert history.restore(kept) == ([], [])  # the twin: nothing changed, nothing done
    (repo / ".git" / "shallow").write_text(git(repo, "rev-parse", "HEAD"))
    assert _count(repo) == "1"  # the plant works
    done, failed = history.restore(kept)
    assert not failed and _count(repo) == "3" and not (repo / ".git" / "shallow").exists()
    assert "made or deleted by a session; gone" in done[0][1]


def test_the_user_s_shallow_clone_gets_its_shallow_back(tmp_path: Path) -> None:
    origin = _repo(tmp_path, "origin")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{origin}", str(clone))
    shallow = (clone / ".git" / "shallow").read_bytes()
    kept = history.record(str(clone / ".git"), str(tmp_path / "keep"), own=[])
    for change in ("deleted", "changed"):
        if change == "deleted":
            (clone / ".git" / "shallow").unlink()
        else:
            (clone / ".git" / "shallow").write_text("0" * 40 + "\n")
        done, failed = history.restore(kept)
        assert not failed and (clone / ".git" / "shallow").read_bytes() == shallow and "put back" in done[0][1]
        assert _count(clone) == "1"


def test_alternates_a_session_planted_go_and_the_user_s_come_back(tmp_path: Path) -> None:
    origin = _repo(tmp_path, "origin")
    shared = tmp_path / "shared"
    git(tmp_path, "clone", "-q", "--shared", str(origin), str(shared))
    alternates = shared / ".git" / "objects" / "info" / "alternates"
    mine = alternates.read_bytes()
    kept = history.record(str(shared / ".git"), str(tmp_path / "keep"), own=[])
    alternates.unlink()
    assert subprocess.run(["git", "log"], cwd=shared, capture_output=True).returncode != 0  # no objects
    done, failed = history.restore(kept)
    assert not failed and alternates.read_bytes() == mine and _count(shared) == "3"
    alternates.write_text("/nowhere/objects\n")
    done, failed = history.restore(kept)
    assert not failed and alternates.read_bytes() == mine
    assert any(p.name.startswith("alternates.quarantined") for p in alternates.parent.iterdir())


def test_a_symlinked_objects_info_is_moved_aside_and_nothing_written_through_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "alternates").write_text("precious\n")
    info = repo / ".git" / "objects" / "info"
    for p in info.iterdir():
        p.unlink()
    info.rmdir()
    info.symlink_to(outside)
    done, failed = history.restore(kept)
    assert not failed and not info.is_symlink()
    assert sorted(os.listdir(outside)) == ["alternates"] and (outside / "alternates").read_text() == "precious\n"


def test_a_file_over_the_bound_at_the_baseline_is_left_unchecked(tmp_path: Path) -> None:
    """Its bytes would go into every open's record; the twin, a small one, is kept."""
    repo = _repo(tmp_path)
    (repo / ".git" / "shallow").write_bytes(b"0" * (viewfiles._MAX + 1))
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert kept.views is not None and "shallow" not in kept.views and "objects/info/alternates" in kept.views
