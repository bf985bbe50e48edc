"""Sessions through the public client against a real daemon: open, refuse, close, status."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, processes_in, shell


def test_open_list_close(client: dispatch.Client, worktree: Path) -> None:
    session = client.open_session(str(worktree))
    assert len(session.id) == 12
    assert session.network is False  # the default policy's default
    ids = [s["id"] for s in client.list_sessions()]
    assert session.id in ids
    session.close()
    assert session.id not in [s["id"] for s in client.list_sessions()]


def test_status_reports_kernel_and_protections(client: dispatch.Client, session: dispatch.Session) -> None:
    st = client.status()
    assert st["kernel"]["landlock_abi"] >= 1
    assert isinstance(st["kernel"]["user_namespaces"], bool)
    mine = [s for s in st["sessions"] if s["id"] == session.id][0]
    prot = mine["protections"]
    assert prot["landlock"]["filesystem"] == "enforced"
    assert prot["seccomp"] == "enforced"
    assert prot["network"]["mode"] == "off"
    assert session.status()["protections"] == prot


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda wt: str(wt / "missing"), "worktree does not exist"),
        (lambda wt: str(wt / "README.md"), "worktree is not a directory"),
        (lambda wt: "/", "cannot be /"),
        (lambda wt: os.path.expanduser("~"), "home directory itself"),
    ],
)
def test_bad_worktrees_are_refused(client: dispatch.Client, worktree: Path, make, message: str) -> None:
    with pytest.raises(dispatch.RequestFailed) as exc:
        client.open_session(make(worktree))
    assert exc.value.code == "bad_worktree"
    assert message in exc.value.message


def test_worktree_of_another_user_is_refused(client: dispatch.Client) -> None:
    with pytest.raises(dispatch.RequestFailed) as exc:
        client.open_session("/usr")  # root's directory
    assert "belongs to uid 0" in exc.value.message


def test_worktree_holding_the_daemon_state_is_refused(client: dispatch.Client, daemon: Daemon) -> None:
    with pytest.raises(dispatch.RequestFailed) as exc:
        client.open_session(str(daemon.base))
    assert "contains dispatchd's own files" in exc.value.message


def test_unknown_policy_is_refused(client: dispatch.Client, worktree: Path) -> None:
    with pytest.raises(dispatch.RequestFailed) as exc:
        client.open_session(str(worktree), policy="nope")
    assert exc.value.code == "bad_policy"
    assert "no policy named 'nope'" in exc.value.message and "default" in exc.value.message


def test_unknown_session(client: dispatch.Client) -> None:
    with pytest.raises(dispatch.RequestFailed) as exc:
        client.close_session("000000000000")
    assert exc.value.code == "unknown_session"


def test_close_ends_every_process(client: dispatch.Client, worktree: Path) -> None:
    # The sleeps are visible from outside under their host pids: found by cwd.
    def sleepers() -> list[int]:
        return [pid for pid in processes_in(worktree) if _comm(pid) == "sleep"]

    with client.open_session(str(worktree)) as session:
        r = shell(session, "(setsid sleep 300 >/dev/null 2>&1 & sleep 300 >/dev/null 2>&1 &) ; echo started",
                  background=True)
        assert r.is_success, r.error
        # Until they have exec'd sleep, the children are still called bash.
        deadline = time.monotonic() + 5
        while len(sleepers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(sleepers()) == 2
    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleepers() == []


def test_read_only_policy_offers_read_tools_only(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree), policy="read-only") as s:
        # The sandbox's tools (the client adds its own retrieve_output beside them).
        assert [n for n in s.registry.tool_names if n != "retrieve_output"] == ["read_file", "list_files", "search_files"]
        assert s.registry.get("read_file").call({"path": "README.md"}).is_success
        # The worktree is read-only to the kernel too, not only to the tool list.
        r = s.call_tool("write_file", {"path": "x", "content": "y"})
        assert r.is_failure and "unknown tool: 'write_file'" in r.error


def test_sessions_are_isolated_from_each_other(client: dispatch.Client, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (b / "secret.txt").write_text("b's secret")
    with client.open_session(str(a)) as sa:
        r = shell(sa, f"cat {b}/secret.txt")
        assert r.is_failure
        assert "Permission denied" in r.metadata["stderr"] or "No such file" in r.metadata["stderr"]
        assert shell(sa, "echo mine > mine.txt && cat mine.txt").output.startswith("mine")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_tool_servers_share_the_fork_servers_session_each_in_a_group_of_its_own(daemon: Daemon, client: dispatch.Client,
                                                                               tmp_path: Path) -> None:
    """One session for every tool server (the kernel makes a scheduler group
    per session), which has no controlling terminal; each tool server leads a
    process group of its own. The twin: the daemon's session is another."""
    trees = [tmp_path / "a", tmp_path / "b"]
    for tree in trees:
        tree.mkdir()
    with client.open_session(str(trees[0])) as a, client.open_session(str(trees[1])) as b:
        workers = [daemon.worker_pid(a.id), daemon.worker_pid(b.id)]
        sids = {os.getsid(pid) for pid in workers}
        assert len(sids) == 1, sids
        (fork_server,) = sids
        for pid in (fork_server, *workers):  # tty_nr: no controlling terminal
            assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[4] == "0"
        assert [os.getpgid(pid) for pid in workers] == workers
        assert [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in workers] == \
            [fork_server] * 2  # ppid: the session is the fork server's own
        assert os.getsid(daemon.proc.pid) != fork_server
