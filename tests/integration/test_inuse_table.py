"""Where a daemon keeps its table of worktrees in use (dispatchd/daemon/inusedir.py):
the user's, under the passwd entry's home, whatever XDG_STATE_HOME says; its
state directory's, said as a weaker mode, when that cannot be used. The
daemons here have a home of their own in their passwd entry
(tests/passwd_home.py), so that what they break is theirs alone."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon
from tests.integration.test_cli import run


def _daemon(base: Path, home: Path) -> Daemon:
    base.mkdir()
    return Daemon(base, "--cgroup", "off", prefix=(sys.executable, str(REPO / "tests" / "passwd_home.py"), str(home)))


def _entries(top: Path) -> list[str]:
    return [json.loads(t)["session"] for n in os.listdir(top) if n.endswith(".uses")
            if (t := (top / n).read_text()).strip()]


def test_the_table_is_the_user_s_whatever_the_state_directory(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    d = _daemon(tmp_path / "d", home)
    table = home / ".local" / "state" / "dispatchd" / "inuse"
    try:
        with d.connect() as c:
            report = c.status()["daemon"]
            assert report["in_use"] == (f"{table}, shared by every dispatchd of yours whatever its state "
                                        "directory")
            assert report.get("in_use_shared", True) is True
            wt = tmp_path / "wt"
            wt.mkdir()
            with c.open_session(str(wt)) as s:
                assert _entries(table) == [s.id]
                state = json.loads(next((table / n).read_text() for n in os.listdir(table)
                                        if n.endswith(".uses") and (table / n).read_text().strip()))["state"]
                assert state == os.path.realpath(d.state / "dispatchd")  # where a recovery finds its baselines
        assert (table.stat().st_mode & 0o777) == 0o700
        assert not (d.state / "dispatchd" / "inuse").exists()
        assert re.search(r"event=inuse_table path=\S+ shared=yes", d.log())
        out = run(d, "status")
        assert f"\nworktrees in use recorded in {table}, shared by every dispatchd of yours" in out.stdout, out.stdout
    finally:
        assert d.stop() == 0, d.log()


def test_a_table_whose_mode_was_changed_is_set_back_and_stays_shared(tmp_path: Path) -> None:
    """A session's chmod (degraded mode) must not choose that the next daemon
    falls back to a table no other daemon sees: the mode is set back."""
    home = tmp_path / "home"
    table = home / ".local" / "state" / "dispatchd" / "inuse"
    table.mkdir(parents=True)
    table.chmod(0o755)
    d = _daemon(tmp_path / "d", home)
    try:
        with d.connect() as c:
            assert c.status()["daemon"].get("in_use_shared", True) is True
        assert (table.stat().st_mode & 0o777) == 0o700
        assert f"event=state_mode_repaired path={table} was=0o755 now=0o700" in d.log()
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("broken", ["unwritable_home"])
def test_a_table_that_cannot_be_the_user_s_is_the_state_directory_s_and_said(tmp_path: Path, broken: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    table = home / ".local" / "state" / "dispatchd" / "inuse"
    home.chmod(0o500)
    why = f"{home / '.local'}: Permission denied"  # the first directory it could not make
    d = _daemon(tmp_path / "d", home)
    own = d.state / "dispatchd" / "inuse"
    note = (f"{own}, seen only by the dispatchd daemons on this state directory ({table} cannot be used: {why}): "
            "a daemon of yours on another state directory would not see this one's sessions, and could take "
            "one's changes to a worktree's git files for yours")
    try:
        with d.connect() as c:
            report = c.status()["daemon"]
            assert report["in_use"] == note
            assert report["in_use_shared"] is False
            wt = tmp_path / "wt"
            wt.mkdir()
            with c.open_session(str(wt)) as s:  # it still refuses another daemon on its state directory
                assert _entries(own) == [s.id]
        assert f"event=inuse_table path={own} shared=no why={note!r}" in d.log()
        out = run(d, "status")
        assert f"\nwarning: worktrees in use recorded in {note}\n" in out.stdout, out.stdout
    finally:
        home.chmod(0o700)
        assert d.stop() == 0, d.log()


def test_no_worktree_holds_the_table(tmp_path: Path) -> None:
    """A session that could write the table could name any state directory
    for a related open to recover from: a worktree may not hold it."""
    home = tmp_path / "home"
    (home / "proj").mkdir(parents=True)
    d = _daemon(tmp_path / "d", home)
    table = home / ".local" / "state" / "dispatchd" / "inuse"
    try:
        with d.connect() as c:
            with pytest.raises(dispatch.DispatchError) as err:
                c.open_session(str(home / ".local"))
            assert str(err.value) == f"worktree {home / '.local'} contains dispatchd's own files ({table})"
            c.open_session(str(home / "proj")).close()  # the twin: a worktree beside it
    finally:
        assert d.stop() == 0, d.log()

