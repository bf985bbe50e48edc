"""Real repositories for the git unit tests, made and changed by git itself
(as a session could), never by hand unless a test says why."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ENV = dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@example.invalid",
           GIT_COMMITTER_NAME="a", GIT_COMMITTER_EMAIL="a@example.invalid")


def git(cwd: Path, *args: str, stdin: str | None = None) -> str:
    # protocol.file.allow: submodules are added from local paths here.
    return subprocess.run(["git", "-c", "protocol.file.allow=always", *args], cwd=cwd, check=True,
                          capture_output=True, text=True, env=ENV, input=stdin).stdout


def empty_repo(path: Path, message: str = "empty") -> Path:
    """A repository whose one commit is empty."""
    path.mkdir()
    git(path, "init", "-q")
    git(path, "commit", "-q", "--allow-empty", "-m", message)
    return path


def one_file_repo(path: Path, name: str = "f") -> Path:
    """A repository whose one commit holds one file, ``name``."""
    path.mkdir()
    git(path, "init", "-q")
    (path / name).write_text(name)
    git(path, "add", name)
    git(path, "commit", "-qm", name)
    return path


def commits_repo(path: Path, n: int = 3, object_format: str = "sha1") -> Path:
    """A repository of ``n`` commits, each writing ``f`` (``0``, ``1``, ...),
    its object ids SHA-1 or (``object_format="sha256"``) SHA-256."""
    path.mkdir()
    git(path, "init", "-q", f"--object-format={object_format}")
    for i in range(n):
        (path / "f").write_text(f"{i}\n")
        git(path, "add", "f")
        git(path, "commit", "-qm", f"c{i}")
    return path


def nested_submodules(root: Path, name: str, paths: list[str]) -> Path:
    """``root/name``, with a submodule at each of ``paths`` (its git directory
    in .git/modules), each holding its own submodule ``inner`` (in
    .git/modules/PATH/modules/inner), checked out."""
    inner = empty_repo(root / "inner-src", "inner")
    lib = empty_repo(root / "lib-src", "lib")
    git(lib, "submodule", "add", "-q", str(inner), "inner")
    git(lib, "commit", "-q", "-m", "inner")
    r = root / name
    r.mkdir()
    git(r, "init", "-q")
    for path in paths:
        git(r, "submodule", "add", "-q", str(lib), path)
    git(r, "submodule", "update", "-q", "--init", "--recursive")
    git(r, "commit", "-q", "-m", "submodules")
    return r


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
