"""Sandboxes made ahead (dispatchd/daemon/pool.py), with a real daemon.

A session is given one only when its plan is the one it was made for, each
serves one session, a policy edited since gets what it says, and none
outlives the daemon. The confinement of a session made ahead is the escape
suite's (tests/escape/test_pool.py, and every escape test in full mode).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import REPO, Daemon, fork_server_of, _refuse_root, shell, wait_for_pool


def wait_ready(client: dispatch.Client, kind: str = "default/off", n: int = 2) -> None:
    wait_for_pool(client, kind, n)


def daemon_in(base: Path, *extra: str) -> Daemon:
    base.mkdir(exist_ok=True)
    return Daemon(base, "--cgroup", "off", *extra)


def made_pids(d: Daemon) -> list[int]:
    return [int(p) for p in re.findall(r"event=pool_made kind=\S+ session=\w+ pid=(\d+)", d.log())]


@pytest.fixture
def policies(tmp_path: Path) -> Path:
    p = tmp_path / "policies"
    shutil.copytree(REPO / "policies", p)
    return p


@pytest.fixture
def pooled(tmp_path: Path, policies: Path) -> Iterator[Daemon]:
    _refuse_root()
    d = daemon_in(tmp_path / "d", "--policies", str(policies))
    yield d
    assert d.stop() == 0, d.log()


def _pid_ns(session: dispatch.Session) -> str:
    result = shell(session, "readlink /proc/self/ns/pid")
    assert result.is_success, result.error
    return str(result.output).strip()


def _channel_ahead(d: Daemon, sid: str) -> str:
    return re.findall(rf"event=worker_ready session={sid} pid=\d+ made_ahead=\d channel_ahead=(\d)", d.log())[-1]


def test_a_session_gets_a_sandbox_made_ahead_and_each_serves_one_session(pooled: Daemon, worktree: Path,
                                                                        tmp_path: Path) -> None:
    other = tmp_path / "other"  # a worktree of its own: one writer per worktree
    other.mkdir()
    with pooled.connect() as client:
        wait_ready(client)
        with client.open_session(str(worktree)) as a, client.open_session(str(worktree), policy="read-only") as b:
            assert a.status()["protections"].get("made_ahead") is True
            assert b.status()["protections"].get("made_ahead", False) is False  # no read-only/off made yet: made at open
            assert shell(a, "echo hi").output == "hi\n"
            wait_ready(client)  # refilled behind the open
            with client.open_session(str(other)) as c:
                assert c.status()["protections"].get("made_ahead") is True
                assert pooled.worker_pid(c.id) != pooled.worker_pid(a.id)
                assert _pid_ns(c) != _pid_ns(a)  # a sandbox of its own, never one served before
        status = client.status()["daemon"]["pool"]
        assert re.search(r"; [2-9]\d* of \d+ opens so far served by one", status), status
    # Each sandbox made ahead served at most one session.
    served = re.findall(r"event=worker_ready session=\w+ pid=(\d+) made_ahead=1", pooled.log())
    assert len(served) == len(set(served)) >= 2


def test_the_openers_channel_comes_with_a_sandbox_made_ahead(pooled: Daemon, worktree: Path) -> None:
    """An open that attaches sends its channel with the session to a sandbox
    made ahead (AdoptSession.channel): served from the tool server's start,
    counted as an attach's, and any later attach gets one of its own."""
    (worktree / "a.txt").write_text("one\n")
    with pooled.connect() as client:
        wait_ready(client)
        with client.open_session(str(worktree)) as s:
            assert s.status()["protections"].get("made_ahead") is True
            assert _channel_ahead(pooled, s.id) == "1"
            assert s.registry.call("read_file", {"path": "a.txt"}).output == "0: one"
            assert shell(s, "echo hi").output == "hi\n"
            # A second channel (AddChannel, as always); closed here, it leaves the session open.
            with pooled.connect() as other, other.session(s.id) as again:
                assert again.registry.call("read_file", {"path": "a.txt"}).output == "0: one"
            assert shell(s, "echo still").output == "still\n"  # the first one serves on


def test_an_open_with_secrets_attaches_after_its_environment_is_set(pooled: Daemon, worktree: Path) -> None:
    """The twin: a session given secrets gets no channel with the session, so
    none of its channels is read before the tool server knows what to
    redact; read_file's answer (its C lane off then) hides the secret."""
    token = "tok-" + "7" * 24
    (worktree / "leak.txt").write_text(f"key={token}\n")
    with pooled.connect() as client:
        wait_ready(client)
        with client.open_session(str(worktree), secrets={"TOKEN": token}) as s:
            assert s.status()["protections"].get("made_ahead") is True
            assert _channel_ahead(pooled, s.id) == "0"
            out = s.registry.call("read_file", {"path": "leak.txt"}).output
            assert token not in out and "key=" in out


def test_without_a_pool_every_sandbox_is_made_at_open(tmp_path: Path, worktree: Path) -> None:
    _refuse_root()
    d = daemon_in(tmp_path / "d", "--pool", "0")
    try:
        with d.connect() as client:
            assert client.status()["daemon"]["pool"].startswith("off (dispatchd --pool 0)")
            for _ in range(2):
                with client.open_session(str(worktree)) as s:
                    assert s.status()["protections"].get("made_ahead", False) is False
                    assert shell(s, "echo hi").output == "hi\n"
            assert made_pids(d) == []
    finally:
        assert d.stop() == 0, d.log()


# Whether /opt can be listed: not once the policy's root lacks it, whether it
# is then absent or only the way to an interpreter installed below it (conda,
# a build of one's own: the daemon binds its library paths, cli._code_paths,
# and /opt is then a directory the session cannot read). ls says which.
_LIST_OPT = "ls /opt 2>&1 >/dev/null && echo listed"
_NOT_LISTED = ("ls: cannot access '/opt': No such file or directory\n",
               "ls: cannot open directory '/opt': Permission denied\n")


def test_a_policy_edited_since_the_sandbox_was_made_gets_a_new_one(pooled: Daemon, policies: Path,
                                                                   worktree: Path) -> None:
    """The root a sandbox made ahead has bound is the policy's of that
    moment: a policy whose root changed since never gets it (the daemon
    compares the plans' ``pool_key``). The twin: before the edit, it does."""
    with pooled.connect() as client:
        wait_ready(client)
        with client.open_session(str(worktree)) as before:
            assert before.status()["protections"].get("made_ahead") is True
            assert shell(before, _LIST_OPT).metadata["stdout"] == "listed\n"
        wait_ready(client)
        text = (policies / "default.toml").read_text()
        (policies / "default.toml").write_text(text.replace('"/etc", "/opt",', '"/etc",'))
        with client.open_session(str(worktree)) as after:
            assert after.status()["protections"].get("made_ahead", False) is False
            # The channel made for the sandbox let go of is closed; attach made one.
            assert _channel_ahead(pooled, after.id) == "0"
            assert shell(after, _LIST_OPT).metadata["stdout"] in _NOT_LISTED
    assert "event=pool_mismatch" in pooled.log()


def _open_after_an_edit(client: dispatch.Client, policies: Path, worktree: Path) -> dispatch.Session:
    """Edit the default policy's open-file limit to 321, open a session from
    the pool (closed again on return) and show the new limit reached it."""
    wait_ready(client)
    text = (policies / "default.toml").read_text()
    (policies / "default.toml").write_text(text.replace("[limits]\n", "[limits]\nmax_open_files = 321\n"))
    with client.open_session(str(worktree)) as after:
        assert after.status()["protections"].get("made_ahead") is True
        assert shell(after, "ulimit -n").output == "321\n"
    return after


def test_rlimits_of_an_edited_policy_reach_a_sandbox_made_ahead(pooled: Daemon, policies: Path,
                                                                worktree: Path) -> None:
    """What is applied at adoption (rlimits, Landlock, seccomp, the
    environment) comes from the session's own plan."""
    with pooled.connect() as client:
        wait_ready(client)
        with client.open_session(str(worktree)) as before:
            assert shell(before, "ulimit -n").output == "4096\n"
        _open_after_an_edit(client, policies, worktree)


def _planned_ahead(d: Daemon) -> list[tuple[str, int]]:
    return [(m.group(1), int(m.group(2)))
            for m in re.finditer(r"event=worker_started session=(\w+) \S+ planned_ahead=(\d)", d.log())]


def test_a_plan_made_ahead_serves_an_open_alike_and_an_edited_policy_is_planned_afresh(
        pooled: Daemon, policies: Path, worktree: Path) -> None:
    """Once a session of the kind has opened, each sandbox made ahead comes
    with its next session's plan, made as if that session opened alike
    (planahead.py): an open alike uses it; after an edit of the policy's
    bytes the open plans again and gets what the file says now."""
    with pooled.connect() as client:
        for _ in range(3):  # every sandbox in the pool made after an open alike
            wait_ready(client)
            with client.open_session(str(worktree)) as s:
                assert shell(s, "ulimit -n").output == "4096\n"
        wait_ready(client)
        with client.open_session(str(worktree)) as alike:
            assert alike.status()["protections"].get("made_ahead") is True
            assert shell(alike, "ulimit -n").output == "4096\n"
        assert _planned_ahead(pooled)[-1] == (alike.id, 1), pooled.log()
        after = _open_after_an_edit(client, policies, worktree)
        assert _planned_ahead(pooled)[-1] == (after.id, 0), pooled.log()


def test_sandboxes_made_ahead_end_with_the_daemon(tmp_path: Path, worktree: Path) -> None:
    """Stopped, the daemon lets them go; killed, they die with the fork
    server (a parent-death signal), their network stacks too."""
    _refuse_root()
    for how in ("stop", "kill"):
        d = daemon_in(tmp_path / how)
        with d.connect() as client:
            wait_ready(client)
            with client.open_session(str(worktree), network="on"):
                pass
            wait_ready(client, "default/on", 1)
            fork_server = fork_server_of(d.proc.pid)
            made = [psutil.Process(p) for p in made_pids(d) if psutil.pid_exists(p)]
            assert len(made) >= 3, d.log()
            everything = [fork_server, *fork_server.children(recursive=True)]
            if how == "stop":
                assert d.stop() == 0, d.log()
            else:
                os.kill(d.proc.pid, signal.SIGKILL)
                d.proc.wait()
                d.stop()
        _gone, alive = psutil.wait_procs(everything, timeout=10)
        assert alive == [], alive


def test_a_negative_pool_is_refused_at_start(tmp_path: Path) -> None:
    """The twin, --pool 0, starts: test_without_a_pool_every_sandbox_is_made_at_open."""
    import subprocess
    import sys

    _refuse_root()
    out = subprocess.run([sys.executable, "-m", "dispatchd", "--socket", str(tmp_path / "d.sock"), "--pool", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == "dispatchd: --pool: a number of sandboxes, 0 or more\n"
    assert not (tmp_path / "d.sock").exists()
