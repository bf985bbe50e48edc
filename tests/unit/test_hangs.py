"""A FIFO, socket or device where git reads a file is moved out of the way
at the last end, so that the user's git does not hang on it afterwards
(dispatchd/daemon/gitguard/hangs.py). The twins: regular files, directories
and symlinks are left where they are."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import hangs, history
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process

PLACES = ["packed-refs", "shallow", "objects/info/alternates", "refs/remotes/origin/main", "logs/HEAD",
          "info/exclude", "objects/pack/pack-0.idx", "worktrees/wt/index"]


def _repo(tmp_path: Path) -> Path:
    return commits_repo(tmp_path / "repo", 1)


def _git_log(repo: Path, seconds: int = 10) -> int:
    return subprocess.run(["timeout", str(seconds), "git", "log", "--oneline"], cwd=repo,
                          capture_output=True).returncode


@pytest.mark.parametrize("rel", PLACES)
def test_a_fifo_where_git_reads_is_moved_out_of_the_way(tmp_path: Path, rel: str) -> None:
    repo = _repo(tmp_path)
    common = repo / ".git"
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    path = common / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    done, failed = history.restore(kept)
    assert not failed, (done, failed)
    if rel == "logs/HEAD":  # the user's reflog, put back in its place (reflogsback.py)
        assert path.is_file() and len(git(repo, "reflog").splitlines()) == 1
    else:
        assert not os.path.lexists(path)
    aside = [p for p in common.iterdir() if p.name.startswith("hang-" + rel.replace("/", "-") + ".quarantined")]
    assert len(aside) == 1 and any("would hang the user's git" in why for _, why in done)
    assert _git_log(repo) == 0


def test_a_control_fifo_hangs_the_users_git(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    os.mkfifo(repo / ".git" / "shallow")
    assert _git_log(repo, 1) == 124  # timeout's: git waited for a writer


def test_a_socket_and_a_new_object_s_fifo_go_and_files_dirs_and_symlinks_stay(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    common = repo / ".git"
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(common / "refs" / "sock"))
    sock.close()
    (common / "objects" / "ee").mkdir(exist_ok=True)
    os.mkfifo(common / "objects" / "ee" / ("e" * 38))
    (common / "refs" / "heads" / "plain").write_text(git(repo, "rev-parse", "HEAD"))
    (common / "info" / "link").symlink_to("/nonexistent")
    (common / "refs" / "sub").mkdir()
    done, failed = history.restore(kept)
    assert not failed and sorted(p for p, _ in done) == sorted([str(common / "refs" / "sock"),
                                                                 str(common / "objects" / "ee" / ("e" * 38))])
    assert (common / "refs" / "heads" / "plain").is_file() and (common / "info" / "link").is_symlink()
    assert (common / "refs" / "sub").is_dir()


def test_past_the_bound_the_rest_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path)
    monkeypatch.setattr(hangs, "_MAX_ENTRIES", 3)
    done, failed = hangs.sweep(str(repo / ".git"), set())
    assert done == [] and f"{repo / '.git'}: more than 3 entries; the rest was not looked at for FIFOs" in failed


def test_a_symlink_to_a_directory_below_logs_is_moved_out_and_called_what_it_is(tmp_path: Path) -> None:
    """``logs/refs`` swapped for a symlink to a directory leads git's reflogs
    elsewhere: moved out as before, and reported as a symlink to a
    directory, not as a FIFO. The twin: a FIFO is still called one (above)."""
    repo = _repo(tmp_path)
    common = repo / ".git"
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    elsewhere = tmp_path / "elsewhere"
    shutil.move(common / "logs" / "refs", elsewhere)
    (common / "logs" / "refs").symlink_to(elsewhere)
    done, failed = history.restore(kept)
    said = [why for path, why in done if path == str(common / "logs" / "refs")]
    assert not failed and len(said) == 1 and said[0].startswith("a symlink to a directory where git reads a file"), done
    assert (elsewhere / "heads" / "master").exists()
