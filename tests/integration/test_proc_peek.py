"""What a session reads of other processes through /proc (dispatchd/confine/gaps.py).

Degraded mode shares the host's /proc: another session's mountinfo (its
worktree, its scratch path) and the sockets of its network namespace are
readable, for no ptrace check guards them. That is a known limit, said in
the degraded session's ``leaves_open``. Full mode has a pid namespace of
its own: another session's processes are not there to read, and its status
does not list the gap.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from dispatchd.confine.gaps import PROC_PEEK_GAP
from tests.conftest import Daemon, daemon_with_nons, shell

FIND = "grep -l -F -e '{path}' /proc/[0-9]*/mountinfo 2>/dev/null | wc -l"


@pytest.fixture(scope="module")
def nons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, dispatch.Client]]:
    d = daemon_with_nons(tmp_path_factory.mktemp("peek"))
    try:
        with d.connect() as client:
            if not client.status()["kernel"]["user_namespaces"]:
                pytest.skip("this kernel refuses user namespaces: no full-mode session to look at")
            yield d, client
    finally:
        assert d.stop() == 0, d.log()


def _worktree(tmp_path: Path, name: str) -> Path:
    wt = tmp_path / name
    wt.mkdir()
    (wt / "a.txt").write_text("a\n")
    return Path(os.path.realpath(wt))


@pytest.mark.known_limit
def test_a_degraded_session_reads_another_sessions_mounts_and_the_daemons_sockets(
        nons: tuple[Daemon, dispatch.Client], tmp_path: Path) -> None:
    d, client = nons
    theirs = _worktree(tmp_path, "theirs")
    with client.open_session(str(theirs)) as victim, client.open_session(str(_worktree(tmp_path, "mine")),
                                                                          policy="nons") as s:
        assert shell(victim, "cat a.txt").output == "a\n"
        pid = d.worker_pid(victim.id)
        assert s.status()["protections"]["mode"] == "degraded"
        assert PROC_PEEK_GAP in s.status()["protections"]["leaves_open"]
        # The known limit, as it stands: the full session's worktree, and the daemon's own socket.
        assert shell(s, f"grep -c -F -e '{theirs}' /proc/{pid}/mountinfo").output.strip() != "0"
        assert "/dispatchd.sock\n" in shell(s, f"cat /proc/{d.proc.pid}/net/unix").output  # bound via /proc/self/fd


def test_a_full_session_sees_its_own_mounts_and_not_another_sessions(
        nons: tuple[Daemon, dispatch.Client], tmp_path: Path) -> None:
    _, client = nons
    theirs, mine = _worktree(tmp_path, "theirs"), _worktree(tmp_path, "mine")
    with client.open_session(str(theirs)) as victim, client.open_session(str(mine)) as s:
        assert shell(victim, "cat a.txt").output == "a\n"
        assert s.status()["protections"]["mode"] == "full"
        assert PROC_PEEK_GAP not in s.status()["protections"]["leaves_open"]
        assert shell(s, FIND.format(path=mine)).output.strip() != "0"  # its own mounts: there
        assert shell(s, FIND.format(path=theirs)).output.strip() == "0"  # the other's: not in its /proc
