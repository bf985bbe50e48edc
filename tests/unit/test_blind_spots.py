"""The tree walk's blind spots closed (daemon/gitguard/runnables.py): a
repository hidden where the walk does not look and reached through a new
symlink, the worktree's root made to look like a git directory, a chain of
directories past the depth bound at a session's end, and the names the
user's tools run that are protected by default. Each with its twin: what the
user keeps."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import runnables
from tests.conftest import deep_tree
from tests.unit.gitrepo import git, make_repo

pytestmark = pytest.mark.process  # git makes the repositories


def _changes(repo: Path, before: runnables.TreeSnapshot, **kwargs: object) -> list[str]:
    return runnables.changes(before, runnables.take(str(repo), **kwargs))  # type: ignore[arg-type]


@pytest.mark.parametrize("hidden", [".git/objects/tools", ".git/refs/tools", "sub/.git/logs/x", "bare/objects/t"])
def test_a_new_link_into_a_place_the_walk_does_not_look_is_moved_aside(tmp_path: Path, hidden: str) -> None:
    repo = make_repo(tmp_path / "r")
    git(repo / "..", "init", "-q", str(repo / "sub"))
    git(repo / "..", "init", "-q", "--bare", str(repo / "bare"))
    before = runnables.take(str(repo))
    git(tmp_path, "init", "-q", "--bare", str(repo / hidden))
    git(repo / hidden, "config", "core.fsmonitor", "touch PWNED")
    os.symlink(hidden, repo / "tools")
    os.symlink(f"../{hidden}", repo / "sub" / "tools2")  # relative to its own directory
    os.symlink(str(repo / hidden), repo / "abs")  # by an absolute path into the worktree
    assert sorted(_changes(repo, before)) == ["abs", "sub/tools2", "tools"]


def test_links_a_project_keeps_are_left_alone(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "src" / "lib").mkdir(parents=True)
    before = runnables.take(str(repo))
    os.symlink("src/lib", repo / "lib")  # pnpm's and monorepos' links: not into git
    os.symlink("/usr/share", repo / "share")  # outside the worktree
    os.symlink("lib/../src", repo / "up")
    assert _changes(repo, before) == []


def test_a_worktree_root_made_to_look_like_a_git_directory_loses_its_head_and_config(tmp_path: Path) -> None:
    root = tmp_path / "plain"  # a directory in no repository (a monorepo's subdirectory is the same)
    root.mkdir()
    (root / "config").mkdir()  # the project's own config/ directory
    (root / "config" / "app.toml").write_text("x\n")
    before = runnables.take(str(root), skip_root_git=False)
    for name in ("objects", "refs"):
        (root / name).mkdir()
    (root / "HEAD").write_text("ref: refs/heads/main\n")
    assert _changes(root, before, skip_root_git=False) == ["HEAD"]  # git no longer enters it; config/ stays
    (root / "config").rename(root / "config.d")
    (root / "config").write_text("[core]\n\tbare = false\n\tworktree = .\n\tfsmonitor = touch PWNED\n")
    assert _changes(root, before, skip_root_git=False) == ["HEAD", "config"]


def test_a_git_directory_looking_root_the_user_had_keeps_it(tmp_path: Path) -> None:
    root = tmp_path / "bare.git"
    git(tmp_path, "init", "-q", "--bare", str(root))
    before = runnables.take(str(root), skip_root_git=False)
    assert _changes(root, before, skip_root_git=False) == []
    (root / "config").write_text((root / "config").read_text() + "[core]\n\tfsmonitor = touch PWNED\n")
    assert _changes(root, before, skip_root_git=False) == ["config"]


def test_at_an_end_a_chain_past_the_depth_bound_is_moved_aside_and_the_rest_still_walked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runnables, "MAX_DEPTH", 100)
    repo = make_repo(tmp_path / "r")
    before = runnables.take(str(repo))
    (repo / "a").mkdir()
    deep_tree(repo / "a", 120)
    git(tmp_path, "init", "-q", str(repo / "z" / "sub"))  # walked after the chain, whatever the order
    (repo / "z" / "sub" / ".envrc").write_text("touch PWNED\n")
    # A baseline over the bound is refused (the open says why) ...
    snap = runnables.take(str(repo))
    assert not snap.complete and snap.why.startswith("deeper than 100 directories (below a/d/d/...")
    # ... an end walks on and moves the part past it aside with the rest.
    end = runnables.take(str(repo), ending=True)
    assert end.complete
    todo = sorted(runnables.changes(before, end))
    assert todo == ["a/" + "d/" * 99 + "d", "z/sub/.envrc", "z/sub/.git/config"], todo
    subprocess.run(["rm", "-rf", str(repo / "a")], check=True)


@pytest.mark.parametrize("name", [".vimrc", ".gvimrc", ".bash_aliases", ".gitconfig.local", ".tmux.conf",
                                  ".husky/pre-commit", ".helix/languages.toml", ".zed/settings.json",
                                  ".gemini/settings.json", "opencode.json", ".devcontainer.json",
                                  ".kiro/settings/mcp.json", "crush.json", "mise.toml", ".mise.toml"])
def test_the_files_the_users_tools_run_are_protected_by_default(tmp_path: Path, name: str) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "notes").mkdir()
    before = runnables.take(str(repo))
    (repo / "notes" / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / "notes" / name).write_text("x\n")
    (repo / "notes" / "plain.txt").write_text("x\n")  # the twin: a file no tool runs
    assert _changes(repo, before) == [f"notes/{name.split('/')[0]}"]


@pytest.mark.parametrize("text", ["/proc/self/cwd/.git/objects/tools", "//{repo}/.git/objects/tools",
                                  "{parent}/./r/.git/objects/tools", "/dev/fd/3/tools", "/proc/1/root/x"])
def test_an_absolute_link_text_is_read_as_the_kernel_reads_it(tmp_path: Path, text: str) -> None:
    repo = make_repo(tmp_path / "r")
    before = runnables.take(str(repo))
    os.symlink(text.format(repo=str(repo).lstrip("/"), parent=tmp_path), repo / "tools")
    os.symlink("/usr/bin/python3", repo / "python")  # the twin: a venv's interpreter link, left alone
    assert _changes(repo, before) == ["tools"]


def test_a_git_directory_of_head_and_commondir_is_one(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "docs").mkdir()
    before = runnables.take(str(repo))
    store = repo / ".cache" / "store"
    for name in ("objects", "refs"):
        (store / name).mkdir(parents=True)
    (store / "config").write_text("[core]\n\tpager = touch PWNED\n")
    (repo / "docs" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / "docs" / "commondir").write_text("../.cache/store\n")
    assert _changes(repo, before) == ["docs/commondir"]  # git no longer takes docs/ for a repository


def test_a_root_of_head_and_commondir_loses_both(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    root.mkdir()
    before = runnables.take(str(root), skip_root_git=False)
    (root / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "commondir").write_text("store\n")
    assert sorted(_changes(root, before, skip_root_git=False)) == ["HEAD", "commondir"]


def test_another_parts_root_replaced_by_a_link_is_moved_aside(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "a").mkdir()
    (repo / "a" / "f").write_text("x\n")
    before = runnables.take(str(repo), excluded=[str(repo / "a")])
    assert "a" not in before.entries  # walked by its own part
    (repo / "a").rename(repo / ".git" / "objects" / "moved")  # not a fan-out name: git may have made that one
    os.symlink("elsewhere", repo / "a")  # whatever its text says: that part's root is no directory now
    assert _changes(repo, before, excluded=[str(repo / "a")]) == ["a"]


@pytest.mark.parametrize("name", [".gitignore", ".gitattributes", ".mailmap"])
def test_a_fifo_where_git_reads_a_file_is_moved_aside_and_a_file_is_not(tmp_path: Path, name: str) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "d").mkdir()
    before = runnables.take(str(repo))
    (repo / name).write_text("x\n")  # the twin: the project's own file, edited freely
    os.mkfifo(repo / "d" / name)
    assert _changes(repo, before) == [f"d/{name}"]


def test_a_baseline_over_the_depth_says_where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runnables, "MAX_DEPTH", 10)
    repo = make_repo(tmp_path / "r")
    (repo / "a").mkdir()
    deep_tree(repo / "a", 12)
    snap = runnables.take(str(repo))
    assert snap.why == "deeper than 10 directories (below a/d/d/...; remove that chain to open sessions here)"


def test_a_fifo_among_a_new_git_directory_s_files_is_moved_aside(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    before = runnables.take(str(repo))
    for name in ("objects", "refs"):
        (repo / "sub" / ".git" / name).mkdir(parents=True)
    os.mkfifo(repo / "sub" / ".git" / "HEAD")  # the user's git status outside waited on it for good
    (repo / "sub" / ".git" / "description").write_text("x\n")  # the twin: a plain file there is git's
    assert _changes(repo, before) == ["sub/.git/HEAD"]
