"""Real repositories for the git unit tests, made and changed by git itself
(as a session could), never by hand unless a test says why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ENV = dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@example.invalid",
           GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@example.invalid")


def git(cwd: Path, *args: str) -> str:
    # protocol.file.allow: submodules are added from local paths here.
    return subprocess.run(["git", "-c", "protocol.file.allow=always", *args], cwd=cwd, check=True,
                          capture_output=True, text=True, env=ENV).stdout


def make_repo(path: Path) -> Path:
    """A repository with one commit of 20 files in three directories."""
    path.mkdir()
    git(path, "init", "-q")
    for i in range(20):
        (path / f"d{i % 3}").mkdir(exist_ok=True)
        (path / f"d{i % 3}" / f"file-with-a-longer-name-{i}.txt").write_text("x")
    git(path, "add", ".")
    git(path, "commit", "-qm", "init")
    return path


def empty_repo(path: Path, message: str) -> Path:
    """A new repository at ``path`` with one empty commit."""
    path.mkdir()
    git(path, "init", "-q")
    git(path, "commit", "-q", "--allow-empty", "-m", message)
    return path


def add_gitlink(repo: Path, path: str, hexsha: str = "1" * 40) -> None:
    """Record a submodule at ``path`` in the index, as a session's
    ``git update-index`` can, whatever is there."""
    git(repo, "update-index", "--add", "--cacheinfo", f"160000,{hexsha},{path}")


def submodule_repo(tmp_path: Path) -> Path:
    """A repository with a submodule named with a slash (its git directory in
    .git/modules/libs/sub), one kept in place (emb/.git), a second linked
    worktree, and no hooks directory."""
    src = empty_repo(tmp_path / "src", "src")
    r = empty_repo(tmp_path / "super", "super")
    git(r, "submodule", "add", "-q", str(src), "libs/sub")
    emb = empty_repo(r / "emb", "emb")
    add_gitlink(r, "emb", git(emb, "rev-parse", "HEAD").strip())
    git(r, "worktree", "add", "-q", str(tmp_path / "other"), "-b", "other")
    shutil.rmtree(r / ".git" / "hooks")
    return r
