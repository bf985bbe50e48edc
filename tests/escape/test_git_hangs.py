"""A FIFO a session leaves where git reads a file (``packed-refs``,
``shallow``, ``objects/info/alternates``, a remote-tracking ref) hung every
git command the user ran afterwards; the end moves it out of the way
(daemon/gitguard/hangs.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)

NAMES = ("shallow", "objects/info/alternates", "refs/remotes/origin/main")


def _git_log(repo: Path, seconds: int = 10) -> int:
    return subprocess.run(["timeout", str(seconds), "git", "log", "--all", "--oneline"], cwd=repo,
                          capture_output=True, timeout=60).returncode


def test_control_a_fifo_hangs_the_users_git(repo: Path) -> None:
    for name in NAMES:
        path = repo / ".git" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        assert _git_log(repo, 1) == 124, name  # timeout's exit: git waited for a writer
        path.unlink()


def test_fifos_a_session_leaves_do_not_hang_the_users_git(client: dispatch.Client, repo: Path) -> None:
    git(repo, "pack-refs", "--all")
    with client.open_session(str(repo)) as s:
        r = shell(s, "cd .git && mkdir -p objects/info refs/remotes/origin && mv packed-refs packed-refs.old && "
                     "mkfifo packed-refs " + " ".join(NAMES) + " && echo planted")
        assert r.is_success and r.output == "planted\n", (r.output, r.error)
    hangs = [p for p in s.protected if "would hang the user's git" in p["why"]]
    assert len(hangs) == len(NAMES) + 1, s.protected
    assert _git_log(repo) == 0
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0
