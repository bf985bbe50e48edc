"""A worktree whose session's end could not be checked (its repository taken
away, what it left beyond the check's bounds) is refused until the daemon restarts, and so is a
worktree inside or around it: a session there would take what was left into
its own baseline, as the user's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, shell


def test_a_worktree_left_unchecked_refuses_those_inside_and_around_it(tmp_path: Path) -> None:
    worktree = Path(os.path.realpath(tmp_path)) / "w" / "wt"
    (worktree / "src").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(worktree)], check=True)
    (tmp_path / "d").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Degraded mode: .git is no mount point there, so a session can take it
    # away, and the end cannot check the repository it recorded.
    d = Daemon(tmp_path / "d", "--cgroup", "off", "--no-user-namespaces")
    try:
        with d.connect() as client:
            with client.open_session(str(worktree)) as s:
                assert shell(s, "mv .git .git-gone && echo gone").output == "gone\n"
            # The close said so (not only the log), and so does status.
            said = [p["why"] for p in s.protected if p["why"].startswith("NOT checked whole: ")]
            assert len(said) == 1 and "the repository's git directory is gone" in said[0], s.protected
            assert any(p["path"] == str(worktree) and p["why"].startswith("NOT checked whole")
                       for p in client.status()["protected"]), client.status()["protected"]
            for root in (worktree, worktree / "src", worktree.parent):  # the same, inside, around
                with pytest.raises(dispatch.DispatchError, match="could not move aside"):
                    client.open_session(str(root))
            client.open_session(str(elsewhere)).close()  # the twin: an unrelated worktree
    finally:
        assert d.stop() == 0, d.log()
