"""A worktree whose session's end could not be checked (what it left is
beyond the check's bounds) is refused until the daemon restarts, and so is a
worktree inside or around it: a session there would take what was left into
its own baseline, as the user's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, deep_tree


def test_a_worktree_left_unchecked_refuses_those_inside_and_around_it(tmp_path: Path) -> None:
    worktree = Path(os.path.realpath(tmp_path)) / "w" / "wt"
    (worktree / "src").mkdir(parents=True)
    (tmp_path / "d").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = Daemon(tmp_path / "d", "--cgroup", "off")
    try:
        with d.connect() as client:
            with client.open_session(str(worktree)):
                deep_tree(worktree / "src", 4100)  # made while the session ran: its, to the check
            for root in (worktree, worktree / "src", worktree.parent):  # the same, inside, around
                with pytest.raises(dispatch.DispatchError, match="could not move aside"):
                    client.open_session(str(root))
            client.open_session(str(elsewhere)).close()  # the twin: an unrelated worktree
    finally:
        assert d.stop() == 0, d.log()
