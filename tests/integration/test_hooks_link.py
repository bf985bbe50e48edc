"""A hooks path reached through a symbolic link (``core.hooksPath =
.githooks``, ``.githooks -> tools/hooks``, as a repository tracks it), with
a real daemon, both modes (gitguard/hookslinks.py): a session that replaces
the link by a plain empty directory changed none of the user's hooks, and
the end said nothing; the user's next commit then ran none of them. The
end now makes the link again, keeps the directory aside, and says both;
the user's commit runs their hook. The twin: a link left alone is left,
nothing said, the hook runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import dispatch
from tests.conftest import shell

ASIDE = "git configuration, hooks or state changed or new"
PUT_BACK = ("yours, a link to tools/hooks on the way to the hooks path (core.hooksPath), as it was before the "
            "session changed it, put back")


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.invalid",
           "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@example.invalid"}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = Path(os.path.realpath(tmp_path)) / "repo"
    r.mkdir()
    assert git(r, "init", "-q", "-b", "main").returncode == 0
    (r / "tools" / "hooks").mkdir(parents=True)
    hook = r / "tools" / "hooks" / "pre-commit"
    hook.write_text(f"#!/bin/sh\ntouch {tmp_path}/USER-HOOK-RAN\n")
    hook.chmod(0o755)
    (r / ".githooks").symlink_to("tools/hooks")
    assert git(r, "config", "core.hooksPath", ".githooks").returncode == 0
    assert git(r, "add", ".").returncode == 0
    assert git(r, "commit", "-q", "--no-verify", "-m", "init").returncode == 0
    return r


def _user_commit_runs_the_hook(repo: Path) -> bool:
    marker = repo.parent / "USER-HOOK-RAN"
    marker.unlink(missing_ok=True)
    assert git(repo, "commit", "-q", "--allow-empty", "-m", "mine").returncode == 0
    return marker.exists()


def test_a_hooks_link_replaced_by_an_empty_directory_is_made_again_and_said(
        mode_client: tuple[str, dispatch.Client], repo: Path) -> None:
    _, client = mode_client
    with client.open_session(str(repo)) as s:
        r = shell(s, "rm .githooks && mkdir .githooks && echo replaced")
        assert r.output == "replaced\n", (r.output, r.error)
    [aside] = [p for p in repo.iterdir() if p.name.startswith(".githooks.quarantined-by-dispatchd-")]
    said = {p["path"]: p["why"] for p in s.protected}
    assert said == {str(aside): ASIDE, str(repo / ".githooks"): PUT_BACK}
    assert os.readlink(repo / ".githooks") == "tools/hooks" and aside.is_dir()
    assert _user_commit_runs_the_hook(repo)
    client.open_session(str(repo)).close()  # checked whole: opens again


def test_the_twin_a_hooks_link_left_alone_is_left_and_nothing_said(
        mode_client: tuple[str, dispatch.Client], repo: Path) -> None:
    _, client = mode_client
    ino = os.lstat(repo / ".githooks").st_ino
    with client.open_session(str(repo)) as s:
        r = shell(s, "echo work > notes.txt && ls .githooks/")
        assert r.output == "pre-commit\n", (r.output, r.error)
    assert s.protected == []
    assert os.lstat(repo / ".githooks").st_ino == ino and _user_commit_runs_the_hook(repo)
