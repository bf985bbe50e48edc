"""Git inside a session: add, commit and checkout -b work, in a plain repository
and in a linked worktree, while what the user's own git would run stays
read-only (full mode). Both modes: without user namespaces git still works,
and the protections are a limit the session's status lists.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import shell

IDENTITY = "GIT_AUTHOR_NAME=agent GIT_AUTHOR_EMAIL=agent@example.invalid " \
           "GIT_COMMITTER_NAME=agent GIT_COMMITTER_EMAIL=agent@example.invalid"
WORKFLOW = f"echo more >> f && git add f && {IDENTITY} git commit -qm change && git checkout -q -b feature && " \
           "git log --format=%s && git branch --show-current"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q")
    git(r, "config", "user.email", "user@example.invalid")
    git(r, "config", "user.name", "user")
    (r / "f").write_text("one\n")
    git(r, "add", "f")
    git(r, "commit", "-qm", "init")
    return r


@pytest.mark.parametrize("kind", ["repository", "linked"])
def test_git_works_in_a_repository_and_in_a_linked_worktree(mode_client, repo: Path, tmp_path: Path,
                                                            kind: str) -> None:
    mode, client = mode_client
    where = repo
    if kind == "linked":
        where = tmp_path / "linked"
        git(repo, "worktree", "add", "-q", str(where), "-b", "side")
    with client.open_session(str(where)) as s:
        r = shell(s, WORKFLOW)
        assert r.is_success, r.error
        assert r.output == "change\ninit\nfeature\n"
        st = s.status()["protections"]["git"]
        assert st["kind"] == kind
        if kind == "repository" and mode == "degraded":
            assert any(g.startswith("git metadata") for g in s.status()["protections"]["leaves_open"])
        if kind == "linked":
            assert str(repo / ".git" / "objects") in st["granted"]
            # The common dir's config is there to read (and only to read).
            assert shell(s, f"git config --file {repo}/.git/config user.name").output == "user\n"
            assert shell(s, f"echo x >> {repo}/.git/config").is_failure
    assert git(repo, "log", "--format=%s", "feature") == "change\ninit\n"  # the commit is really there


def test_hooks_and_config_stay_read_only_while_git_works(mode_client, repo: Path) -> None:
    mode, client = mode_client
    if mode == "degraded":
        # The limit, shown honestly: without a mount namespace nothing holds
        # .git read-only, and the session's status says so.
        with client.open_session(str(repo)) as s:
            assert shell(s, "echo 'echo pwned' > .git/hooks/pre-commit").is_success
            assert any(g.startswith("git metadata") for g in s.status()["protections"]["leaves_open"])
        return
    with client.open_session(str(repo)) as s:
        hook = shell(s, "echo 'echo pwned' > .git/hooks/pre-commit")
        assert "Read-only file system" in hook.metadata["stderr"]
        config = shell(s, "git config core.hooksPath /tmp/evil")
        assert "could not write config file .git/config: Device or resource busy" in config.metadata["stderr"]
        rename = shell(s, "mv .git .git-aside")
        assert "Device or resource busy" in rename.metadata["stderr"]
        assert shell(s, WORKFLOW).is_success  # and git goes on working
    assert "hooksPath" not in (repo / ".git" / "config").read_text()
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()


@pytest.mark.parametrize("set_by", ["config", "include"])
def test_a_hooks_path_inside_git_is_read_only_wherever_the_config_sets_it(mode_client, repo: Path,
                                                                          set_by: str) -> None:
    """``core.hooksPath`` names ``.git/myhooks`` and ``.githooks``, set in
    ``.git/config`` or in a file it includes (``.git/hooks.inc``). Full mode:
    the hooks in ``.git`` are held read-only as ``.git/hooks`` is (EROFS),
    and git goes on working; before, one an included file set was writable
    while the session ran (checked and put back only at its end). The twin:
    the hooks path beside the code stays writable (checkouts and the
    project's tools write there: docs/design.md), its hook put back at the
    end. Degraded mode: nothing is held, as the status says."""
    mode, client = mode_client
    users = "#!/bin/sh\n# the user's checks\n"
    for where in (".git/myhooks", ".githooks"):
        (repo / where).mkdir()
        (repo / where / "pre-commit").write_text(users)
        (repo / where / "pre-commit").chmod(0o755)
    setting = "[core]\n\thooksPath = .githooks\n\thooksPath = .git/myhooks\n"
    if set_by == "include":
        (repo / ".git" / "hooks.inc").write_text(setting)
        git(repo, "config", "include.path", "hooks.inc")
    else:
        with open(repo / ".git" / "config", "a") as config:
            config.write(setting)
    with client.open_session(str(repo)) as s:
        for where in (".git/myhooks", ".githooks"):
            r = shell(s, f"echo 'echo planted' >> {where}/pre-commit && echo WROTE")
            if mode == "full" and where == ".git/myhooks":
                assert not r.is_success and f"{where}/pre-commit: Read-only file system" in r.metadata["stderr"], r
            else:
                assert r.output == "WROTE\n", (r.output, r.error)
        assert shell(s, WORKFLOW).is_success  # the user's hook (the last hooksPath) runs, and passes
    assert {p["path"]: p["why"] for p in s.protected if "put back" in p["why"]} == {
        str(repo / where / "pre-commit"): "yours, as it was before the session changed it, put back"
        for where in ((".git/myhooks", ".githooks") if mode == "degraded" else (".githooks",))}
    for where in (".git/myhooks", ".githooks"):
        assert (repo / where / "pre-commit").read_text() == users


def _user_hook(repo: Path, where: str) -> Path:
    """An executable pre-commit of the user's in ``where``, which passes."""
    (repo / where).mkdir()
    (repo / where / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
    (repo / where / "pre-commit").chmod(0o755)
    return repo / where / "pre-commit"


def test_a_file_the_config_includes_from_inside_git_is_read_only(mode_client, repo: Path, tmp_path: Path) -> None:
    """``[include] path = hooks.inc`` sets ``core.hooksPath = .git/myhooks``:
    the hooks were held read-only, the include that names them was not, and
    a session rewrote it to ``hooksPath = evil``: the user's commit while
    the session ran ran the session's hook. Full mode: the include is held
    as ``config`` is (EROFS). The twin: the user's commit meanwhile runs
    the user's hook and works. Degraded mode: nothing is held (the status
    says so); the end puts the user's include back."""
    mode, client = mode_client
    marker = tmp_path / "PWNED"
    _user_hook(repo, ".git/myhooks")
    (repo / ".git" / "hooks.inc").write_text("[core]\n\thooksPath = .git/myhooks\n")
    git(repo, "config", "include.path", "hooks.inc")
    with client.open_session(str(repo)) as s:
        r = shell(s, f"mkdir -p evil && printf '#!/bin/sh\\ntouch {marker}\\n' > evil/pre-commit && "
                     "chmod +x evil/pre-commit && printf '[core]\\n\\thooksPath = evil\\n' > .git/hooks.inc && "
                     "echo WROTE")
        if mode == "full":
            assert not r.is_success and ".git/hooks.inc: Read-only file system" in r.metadata["stderr"], r
            git(repo, "commit", "-q", "--allow-empty", "-m", "the user's, while the session runs")
            assert not marker.exists()
        else:
            assert r.output == "WROTE\n", (r.output, r.error)
    assert (repo / ".git" / "hooks.inc").read_text() == "[core]\n\thooksPath = .git/myhooks\n"
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")
    assert not marker.exists()


@pytest.mark.known_limit
def test_an_include_beside_the_code_moves_the_hooks_path_while_the_session_runs_known_limit(mode_client, repo: Path,
                                                                                            tmp_path: Path) -> None:
    """The documented limit: an include beside the code (a shared config
    the user's config includes) is the code's, writable while the session
    runs, as a tracked ``.githooks`` is: rewritten to name a hooks path of
    the session's, a commit of the user's meanwhile runs the session's
    hook. The end puts the user's include back and moves the session's
    hook aside, saying both; the user's next commit runs their own."""
    mode, client = mode_client
    marker = tmp_path / "PWNED"
    _user_hook(repo, ".git/myhooks")
    (repo / "shared.gitconfig").write_text("[core]\n\thooksPath = .git/myhooks\n")
    git(repo, "config", "include.path", "../shared.gitconfig")
    with client.open_session(str(repo)) as s:
        r = shell(s, f"mkdir -p evil && printf '#!/bin/sh\\ntouch {marker}\\n' > evil/pre-commit && "
                     "chmod +x evil/pre-commit && printf '[core]\\n\\thooksPath = evil\\n' > shared.gitconfig && "
                     "echo WROTE")
        assert r.output == "WROTE\n", (r.output, r.error)
        git(repo, "commit", "-q", "--allow-empty", "-m", "the user's, while the session runs")
        assert marker.exists()  # the limit, as SECURITY.md states it
    marker.unlink()
    said = {p["path"]: p["why"] for p in s.protected}
    assert said[str(repo / "shared.gitconfig")] == "yours, as it was before the session changed it, put back"
    assert any(p.startswith(f"{repo}/evil/pre-commit.quarantined-by-dispatchd-") for p in said), said
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")
    assert not marker.exists()


@pytest.mark.parametrize("named", [".git/index.lock", ".git/hooks/pre-commit"])
def test_an_include_a_session_rewrote_has_no_open_make_a_directory_git_stops_on(mode_client, repo: Path,
                                                                                named: str) -> None:
    """The user's config includes a shared config beside the code. A session
    writes ``core.hooksPath = NAMED`` there; another session opens on the
    worktree meanwhile: its open made NAMED a directory (a missing hooks
    path inside ``.git`` is made, to be held), and after both ends the
    user's ``git commit`` failed ("Unable to create '.git/index.lock': File
    exists", or "cannot exec '.git/hooks/pre-commit'"), nothing moved aside.
    Now nothing is made at a name git gives a file of its own. The twin: an
    honest missing hooks path (``.git/myhooks2``) is made and held."""
    mode, client = mode_client
    (repo / "shared.gitconfig").write_text("[core]\n\thooksPath = .git/myhooks2\n")
    git(repo, "config", "include.path", "../shared.gitconfig")
    with client.open_session(str(repo)) as a:
        assert (repo / ".git" / "myhooks2").is_dir()  # the twin: made by the open
        assert shell(a, f"printf '[core]\\n\\thooksPath = {named}\\n' > shared.gitconfig && echo W").output \
            == "W\n"
        with client.open_session(str(repo)):  # its open is all it does
            assert not (repo / named).is_dir()
    assert (repo / "shared.gitconfig").read_text() == "[core]\n\thooksPath = .git/myhooks2\n"
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")


@pytest.mark.parametrize("users", [True, False])
@pytest.mark.parametrize("where", [".git/hooks", ".githooks"])
def test_a_directory_at_a_hook_s_name_is_moved_aside_and_the_user_s_hook_put_back(mode_client, repo: Path,
                                                                                  where: str, users: bool) -> None:
    """A session makes a directory at a hook's name (``mkdir
    .git/hooks/pre-commit``: degraded mode; a hooks path beside the code,
    any mode): the end neither moved it aside nor said it, and every commit
    of the user's failed ("cannot exec ... Permission denied"). Now it is a
    change: moved aside, said, and the user's hook there put back. The
    twins: full mode refuses the directory in ``.git/hooks`` (EROFS); a
    directory at a name git runs no hook by (``pre-commit.d``) is left."""
    mode, client = mode_client
    hooks = repo / where
    hooks.mkdir(exist_ok=True)
    if users:
        (hooks / "pre-commit").write_text("#!/bin/sh\nexit 0\n")
        (hooks / "pre-commit").chmod(0o755)
    if where == ".githooks":
        git(repo, "config", "core.hooksPath", ".githooks")
    with client.open_session(str(repo)) as s:
        r = shell(s, f"rm -f {where}/pre-commit; mkdir {where}/pre-commit {where}/pre-commit.d && echo MADE")
    if mode == "full" and where == ".git/hooks":
        assert not r.is_success and "Read-only file system" in r.metadata["stderr"], r
    else:
        assert r.output == "MADE\n", (r.output, r.error)
        said = {p["path"]: p["why"] for p in s.protected}
        aside = [p for p in said if p.startswith(f"{hooks}/pre-commit.quarantined-by-dispatchd-")]
        assert len(aside) == 1 and os.path.isdir(aside[0]), said
        assert said[aside[0]] == "git configuration, hooks or state changed or new"
        if users:
            assert said[str(hooks / "pre-commit")] == "yours, as it was before the session changed it, put back"
        assert (hooks / "pre-commit.d").is_dir()  # the twin: no hook of git's
    assert (hooks / "pre-commit").is_file() == users and not (hooks / "pre-commit").is_dir()
    git(repo, "commit", "-q", "--allow-empty", "-m", "the user's")


def test_a_planted_commondir_is_moved_aside_when_the_session_ends(mode_client, repo: Path) -> None:
    mode, client = mode_client
    with client.open_session(str(repo)) as s:
        assert shell(s, "echo ../elsewhere > .git/commondir").is_success
    assert not (repo / ".git" / "commondir").exists()
    assert [p.name.startswith("commondir.quarantined-by-dispatchd-") for p in (repo / ".git").iterdir()
            if p.name.startswith("commondir")] == [True]


def test_a_linked_worktrees_pointer_files_stay_read_only(mode_client, repo: Path, tmp_path: Path) -> None:
    mode, client = mode_client
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    gitdir = repo / ".git" / "worktrees" / "linked"
    with client.open_session(str(linked)) as s:
        if mode == "degraded":
            # The limit: the pointer file is in the writable worktree, and
            # without a mount namespace nothing holds it read-only.
            assert shell(s, "cat .git > .git.saved && echo 'gitdir: /tmp' > .git && mv .git.saved .git").is_success
            assert any(g.startswith("git metadata") for g in s.status()["protections"]["leaves_open"])
        else:
            for target in (".git", f"{gitdir}/commondir", f"{gitdir}/gitdir"):
                r = shell(s, f"echo 'gitdir: /tmp' > {target}")
                assert "Read-only file system" in r.metadata["stderr"], target
    assert (linked / ".git").read_text().startswith(f"gitdir: {gitdir}")


def test_an_index_the_session_garbled_is_moved_aside_and_the_worktree_opens_again(mode_client, repo: Path) -> None:
    """What the end-of-session check cannot read (a garbled index) is moved
    aside, not handed to the user's git, and the next session opens (the same
    for an index recording a submodule it cannot look at: tests/escape/test_filesystem.py,
    test_a_nested_repository_hidden_behind_an_unsearchable_directory_...; what cannot be moved aside keeps sessions off the worktree)."""
    mode, client = mode_client
    with client.open_session(str(repo)) as s:
        assert shell(s, "printf 'not an index' > .git/index").is_success
    assert [p.name.startswith("index.quarantined-by-dispatchd-") for p in (repo / ".git").iterdir()
            if p.name.startswith("index")] == [True]
    with client.open_session(str(repo)) as s:
        # git starts over from an empty index: the committed file reads as
        # deleted from it, and present in the worktree
        r = shell(s, "git status --porcelain")
        assert (r.metadata["exit_code"], r.metadata["stdout"]) == (0, "D  f\n?? f\n"), r.metadata["stderr"]



def test_the_users_own_work_beside_a_read_only_session_stays(mode_client, repo: Path) -> None:
    """A session of the read-only policy (the kernel holds its worktree
    read-only; no command runs) cannot have changed anything, so what
    changed while it was open is the user's: their ``git push -u``-like
    config, a new branch and an ``.envrc`` stay as they made them, and
    nothing is reported. Before, the end moved the whole ``.git/config``
    aside as a session's. The twin: the same by a default-policy session
    that ran a command is moved aside (it could have)."""
    _, client = mode_client
    for policy, ran in (("read-only", False), ("default", True)):
        with client.open_session(str(repo), policy=policy) as s:
            if ran:
                assert shell(s, "true").is_success
            git(repo, "config", f"branch.{policy}.remote", "origin")
            git(repo, "branch", f"users-{policy}")
            (repo / ".envrc").write_text(f"export FROM={policy}\n")
        if not ran:
            assert s.protected == []
            assert git(repo, "config", "branch.read-only.remote") == "origin\n"
            assert (repo / ".envrc").read_text() == "export FROM=read-only\n"
        else:
            assert {".git/config", ".envrc"} <= {p["path"].removeprefix(f"{repo}/").split(".quarantined")[0]
                                                 for p in s.protected}, s.protected
            assert git(repo, "config", "branch.read-only.remote") == "origin\n"  # the baseline's, put back
        assert f"users-{policy}" in git(repo, "branch")
