"""Where the end's walk of the worktree does not look, a session cannot
hide what the user's git runs: a repository made inside ``.git/objects``
and reached through a new symlink, the worktree's own root made to look like
a git directory (git enters it when no ``.git`` comes first), a chain of
directories past the walk's depth. Each attack runs for the user when done
outside a session (the control), and runs nothing after one (real daemons,
full and degraded mode)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, shell
from tests.escape.test_trusted_baseline import MODES, fsmonitor_config, git


@pytest.fixture(scope="module", params=MODES)
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dispatch.Client]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp(f"blind-{request.param}"),
               *(["--no-user-namespaces"] if request.param == "degraded" else []))
    try:
        with d.connect() as c:
            yield c
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    (r / "pkg").mkdir(parents=True)
    git(r, "init", "-q", "-b", "main")
    (r / "pkg" / "f").write_text("x\n")
    git(r, "add", "pkg/f")
    git(r, "-c", "user.name=u", "-c", "user.email=u@example.invalid", "commit", "-qm", "c")
    return r


def hidden_repo(marker: Path) -> str:
    return (f"git init -q --bare .git/objects/tools && git -C .git/objects/tools config core.bare false && "
            f"git -C .git/objects/tools config core.worktree . && "
            f"git -C .git/objects/tools config core.fsmonitor 'touch {marker}' && ln -s .git/objects/tools tools")


def root_as_git_directory(marker: Path) -> str:
    return (f"mkdir objects refs && echo 'ref: refs/heads/main' > HEAD && "
            f"printf '{fsmonitor_config(marker)}\\tbare = false\\n\\tworktree = .\\n' > config")


def test_control_the_plants_run_for_the_user(repo: Path, tmp_path: Path) -> None:
    hid, root = tmp_path / "hid", tmp_path / "root"
    subprocess.run(["bash", "-c", hidden_repo(hid)], cwd=repo, check=True)
    git(repo / "tools", "status", check=False)
    subprocess.run(["bash", "-c", root_as_git_directory(root)], cwd=repo / "pkg", check=True)
    git(repo / "pkg", "status", check=False)
    assert hid.exists() and root.exists()


def test_a_repository_hidden_in_the_objects_and_linked_to_runs_nothing(client: dispatch.Client, repo: Path,
                                                                       tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with client.open_session(str(repo)) as s:
        r = shell(s, hidden_repo(marker) + " && echo made")
        assert r.output == "made\n", r.error
    assert any(p["path"].startswith(str(repo / "tools.quarantined-by-dispatchd-")) for p in s.protected), s.protected
    assert not (repo / "tools").exists()
    git(repo, "status", check=False)
    assert not marker.exists()
    # The twin: a link of the project's own is left alone.
    with client.open_session(str(repo)) as s:
        assert shell(s, "ln -s pkg alias && echo made").output == "made\n"
    assert os.readlink(repo / "alias") == "pkg" and s.protected == []


def test_a_worktree_root_made_a_git_directory_runs_nothing(client: dispatch.Client, repo: Path,
                                                           tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pkg = repo / "pkg"  # a monorepo's subdirectory: no .git of its own
    with client.open_session(str(pkg)) as s:
        r = shell(s, root_as_git_directory(marker) + " && echo made")
        assert r.output == "made\n", r.error
    assert {os.path.basename(p["path"]).split(".quarantined-by-dispatchd-")[0] for p in s.protected} >= {"HEAD"}, \
        s.protected
    git(pkg, "status", check=False)
    assert not marker.exists()
    assert (pkg / "f").read_text() == "x\n"  # the session's other files are its own


def test_another_sessions_root_swapped_for_a_link_into_the_objects_runs_nothing(client: dispatch.Client,
                                                                               repo: Path, tmp_path: Path) -> None:
    """A session on the repository moves the directory another session works
    in into .git/objects, links its name there, and makes .git/objects look
    like a git directory; the part of the other session walked through the
    link and the repository's part left that name to it."""
    marker = tmp_path / "ran"
    inner = client.open_session(str(repo / "pkg"))
    try:
        with client.open_session(str(repo)) as outer:
            r = shell(outer, "mv pkg .git/objects/moved && ln -s .git/objects/moved pkg && cd .git/objects && "
                             "echo 'ref: refs/heads/main' > HEAD && mkdir -p refs objects && "
                             f"printf '[core]\\n\\trepositoryformatversion = 0\\n\\tworktree = moved\\n"
                             f"\\tfsmonitor = \"touch {marker}\"\\n' > config && echo made")
            assert r.output == "made\n", r
    finally:
        inner.close()
    assert not (repo / "pkg").is_symlink()
    if (repo / "pkg").exists():
        git(repo / "pkg", "status", check=False)
    git(repo, "status", check=False)
    assert not marker.exists()


def test_control_a_root_swapped_for_a_link_into_the_objects_runs_for_the_user(repo: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    subprocess.run(["bash", "-c", "mv pkg .git/objects/moved && ln -s .git/objects/moved pkg && cd .git/objects && "
                                  "echo 'ref: refs/heads/main' > HEAD && mkdir -p refs objects && "
                                  f"printf '[core]\\n\\trepositoryformatversion = 0\\n\\tworktree = moved\\n"
                                  f"\\tfsmonitor = \"touch {marker}\"\\n' > config"], cwd=repo, check=True)
    git(repo / "pkg", "status", check=False)
    assert marker.exists()


def _status_rc(repo: Path) -> int:
    return subprocess.run(["timeout", "5", "git", "status"], cwd=repo, capture_output=True, timeout=30).returncode


def test_a_fifo_head_in_a_new_repository_hangs_no_git_of_the_user_s(client: dispatch.Client, repo: Path) -> None:
    plant = "mkdir -p sub/.git/objects sub/.git/refs && mkfifo sub/.git/HEAD && echo made"
    with client.open_session(str(repo)) as s:
        assert shell(s, plant).output == "made\n"
    assert any(p["path"].startswith(str(repo / "sub" / ".git" / "HEAD.quarantined-by-dispatchd-")) for p in s.protected)
    assert _status_rc(repo) == 0


def test_control_a_fifo_head_in_a_new_repository_hangs_the_user_s_git(repo: Path) -> None:
    subprocess.run(["bash", "-c", "mkdir -p sub/.git/objects sub/.git/refs && mkfifo sub/.git/HEAD"], cwd=repo,
                   check=True)
    assert _status_rc(repo) == 124  # timeout's: git waited on the FIFO
