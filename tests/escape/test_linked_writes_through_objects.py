"""A file git reads or runs that no end splits as the user's (the paused
rebase's todo, a hook manager's script), linked by a session into
``objects``, which a later linked worktree's session is granted writable
(``arealinks``): with a real daemon."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Daemon, shell
from tests.escape.test_trusted_baseline import IDENTITY, _clone_beside, git, mode_daemon

__all__ = ["mode_daemon"]


def _pause_a_rebase(main: Path) -> Path:
    for i in range(2):
        git(main, "commit", "-q", "--allow-empty", "-m", f"c{i}")
    env = {**os.environ, **IDENTITY, "GIT_SEQUENCE_EDITOR": "sed -i 1s/^pick/edit/"}
    subprocess.run(["git", "rebase", "-q", "-i", "--keep-empty", "HEAD~2"], cwd=main, env=env, check=True,
                   capture_output=True, timeout=60)
    return main / ".git" / "rebase-merge" / "git-rebase-todo"


@pytest.mark.parametrize("link", [True, False])
@pytest.mark.parametrize("where", ["own", "nested"])
def test_a_rebase_todo_linked_into_objects_runs_no_exec_of_a_later_linked_session(
        mode_daemon: tuple[str, Daemon], tmp_path: Path, where: str, link: bool) -> None:
    """The user's interactive rebase is paused in the main worktree. A
    session on it (``own``: ``.git`` is one mount, ``objects`` and
    ``rebase-merge`` in it) or on an outer worktree holding it as a clone
    (``nested``) links the todo into ``.git/objects`` at a name not of
    git's. ``own``: the session's end makes that name a file of its own;
    ``nested``: the linked open is refused while it is there. Either way
    the linked session's ``exec touch PWNED`` reaches nothing the user's
    ``git rebase --continue`` runs (before: it ran). The twin (no link):
    the same write has nothing to reach, and the rebase continues as the
    user's."""
    mode, daemon = mode_daemon
    real = Path(os.path.realpath(tmp_path))
    top, main, linked = _clone_beside(real, where, {".githooks/pre-commit": b"#!/bin/sh\nexit 0\n"})
    todo = _pause_a_rebase(main)
    name = main / ".git" / "objects" / "aa-todo"
    with daemon.connect() as c:
        with c.open_session(str(top if where == "nested" else main)) as a:
            cmd = f"ln {todo} {name} && echo LINKED" if link else "echo LINKED"
            assert shell(a, cmd).output == "LINKED\n"
        with c.open_session(str(linked)) as s:
            shell(s, f"echo 'exec touch {real}/PWNED' >> {name}")
    git(main, "rebase", "--continue", check=False)
    assert not (real / "PWNED").exists(), (mode, where)


@pytest.mark.parametrize("link", [True, False])
def test_a_hook_manager_s_script_linked_into_objects_is_written_by_no_later_linked_session(
        mode_daemon: tuple[str, Daemon], tmp_path: Path, link: bool) -> None:
    """The clone's ``.git/hooks/pre-commit`` runs every script of
    ``.git/hooks/pre-commit.d/`` (a hook manager's layout). A session on the
    outer worktree holding the clone links one of those scripts into the
    clone's ``.git/objects`` (``hooks/*`` is one level: no end splits it as
    the user's). The clone's linked open is refused while that name is
    there; before, its session appended ``touch PWNED`` through it and the
    user's commit in the clone ran it. The twin (no link): nothing reached."""
    mode, daemon = mode_daemon
    real = Path(os.path.realpath(tmp_path))
    top, main, linked = _clone_beside(real, "nested", {".githooks/pre-commit": b"#!/bin/sh\nexit 0\n"})
    git(main, "config", "--unset", "core.hooksPath")
    hooks = main / ".git" / "hooks"
    (hooks / "pre-commit").write_text('#!/bin/sh\nfor f in "$(dirname "$0")"/pre-commit.d/*; do "$f" || exit 1; done\n')
    (hooks / "pre-commit").chmod(0o755)
    (hooks / "pre-commit.d").mkdir()
    script = hooks / "pre-commit.d" / "lint"
    script.write_text("#!/bin/sh\ntrue\n")
    script.chmod(0o755)
    name = main / ".git" / "objects" / "aa-lint"
    with daemon.connect() as c:
        with c.open_session(str(top)) as a:
            cmd = f"ln {script} {name} && echo LINKED" if link else "echo LINKED"
            assert shell(a, cmd).output == "LINKED\n"
        with c.open_session(str(linked)) as s:
            shell(s, f"echo 'touch {real}/PWNED' >> {name}")
    git(main, "commit", "-q", "--allow-empty", "-m", "the user's", check=False)
    assert not (real / "PWNED").exists(), mode
