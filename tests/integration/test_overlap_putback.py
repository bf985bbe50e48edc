"""Two sessions of one worktree, with a real daemon (gitguard/taints.py):
the first closes while the second, still running, makes its end fail, so
that the user's files cannot be put back. Full mode: the second rewrote the
user's hooks (``core.hooksPath = .githooks``) and keeps their directory
read-only (``chmod 555`` in a loop: the write permission the end lends it is
taken back at once; 40 hooks, so that the loop wins some of the races).
Degraded mode, the same shape without a race: the second rewrote
``.git/config`` and holds ``config.lock``, which the end waits for and never
writes around. The worktree is refused, and said so, until the last
session's end, which runs with no process of the domain left, puts the
files back, and lifts the refusal (before, it stayed refused until the
daemon restarted). A daemon killed between the two ends leaves the record,
and the next start's check puts them back. The twin: with nothing held, the
first end puts them back and refuses nothing.

"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, shell, wait_until

N = 40  # hooks: the loop wins the race for some of them, every time
LAST_END = "until the check at the end of the last session still open on it passes, or a restart's"
LIFTED = ("checked whole at its last session's end: what an earlier end's check could not move aside or put back "
          "is done now, and sessions on it are no longer refused")
HELD_S = 6  # how long the loop keeps the hooks directory read-only


def git(cwd: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.invalid",
           "GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@example.invalid"}
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("overlap"))
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def degraded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("overlap-degraded"), "--no-user-namespaces")
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def wt(tmp_path: Path) -> Path:
    w = Path(os.path.realpath(tmp_path)) / "wt"
    w.mkdir()
    git(w, "init", "-q", "-b", "main")
    git(w, "commit", "-q", "--allow-empty", "-m", "init")
    (w / ".githooks").mkdir()
    for i in range(N):
        (w / ".githooks" / f"h{i:02d}").write_text(_hook(i))
        (w / ".githooks" / f"h{i:02d}").chmod(0o755)
    git(w, "config", "core.hooksPath", ".githooks")
    return w


def _hook(i: int) -> str:
    return f"#!/bin/sh\n# the user's {i}\n"


def _hooks_are_the_user_s(w: Path) -> bool:
    return all((w / ".githooks" / f"h{i:02d}").read_text() == _hook(i) for i in range(N))


def _plant_and_hold(b: dispatch.Session) -> None:
    r = shell(b, "for f in .githooks/h*; do echo 'touch PLANTED' >> $f; done; echo OK")
    assert r.output == "OK\n", (r.output, r.error)
    r = shell(b, f"end=$(( $(date +%s) + {HELD_S} )); while [ $(date +%s) -lt $end ]; do chmod 555 .githooks; done; "
                 "chmod 755 .githooks; touch .held-no-more", background=True)
    assert r.is_success, (r.output, r.error)
    time.sleep(1.5)


FSMONITOR = r"[core]\n\tfsmonitor = \"touch PLANTED; false\"\n"  # printf's escapes


def _config_and_lock(b: dispatch.Session) -> None:
    r = shell(b, f"printf '{FSMONITOR}' >> .git/config && : > .git/config.lock && echo OK")
    assert r.output == "OK\n", (r.output, r.error)


def _not_whole(items: list[dict[str, object]]) -> list[dict[str, object]]:
    return [p for p in items if str(p["why"]).startswith("NOT checked whole")]


def test_a_first_end_that_cannot_put_back_refuses_until_the_last_end_lifts_it(daemon: Daemon, wt: Path) -> None:
    with daemon.connect() as cb, daemon.connect() as ca:
        b = cb.open_session(str(wt))
        a = ca.open_session(str(wt))
        _plant_and_hold(b)
        a.close()  # beside b's loop
        [said] = _not_whole(a.protected)
        assert said["path"] == str(wt)
        assert str(said["why"]).startswith(f"NOT checked whole: {wt}/.githooks/h")
        assert ": changed by a session, yours cannot be put back (Permission denied)" in str(said["why"])
        assert str(said["why"]).endswith(f"dispatchd refuses sessions on it {LAST_END}")
        refused = f"could not move aside .*sessions on it are refused {LAST_END}"
        with pytest.raises(dispatch.DispatchError, match=refused):
            ca.open_session(str(wt))
        [listed] = [p for p in ca.status()["protected"] if p["path"] == str(wt)]
        assert str(listed["why"]).endswith(f"sessions on it are refused {LAST_END}")
        assert wait_until(lambda: (wt / ".held-no-more").exists(), timeout=HELD_S + 30)
        b.close()  # the last end: no process of the domain left
        assert _not_whole(b.protected) == []
        assert [p["why"] for p in b.protected if p["path"] == str(wt)] == [LIFTED]
        # Neither what the first end kept aside renamed again, nor its own temporaries taken for plants.
        assert [p["path"] for p in b.protected if str(p["path"]).count(".quarantined-by-dispatchd-") > 1] == []
        assert [p["path"] for p in b.protected if ".dispatchd-" in str(p["path"])] == []
        assert _hooks_are_the_user_s(wt)
        assert [p for p in ca.status()["protected"] if p["path"] == str(wt)] == []
        with ca.open_session(str(wt)) as again:  # opens again
            assert shell(again, "echo hi").output == "hi\n"


def test_without_a_race_a_held_config_lock_refuses_until_the_last_end_lifts_it(degraded: Daemon, wt: Path) -> None:
    config, lock = wt / ".git" / "config", wt / ".git" / "config.lock"
    user_s = config.read_bytes()
    with degraded.connect() as cb, degraded.connect() as ca:
        b = cb.open_session(str(wt))
        a = ca.open_session(str(wt))
        _config_and_lock(b)
        a.close()  # waits a second for the lock, never writes around it
        [said] = _not_whole(a.protected)
        assert said["path"] == str(wt)
        assert str(said["why"]).startswith(f"NOT checked whole: {config}: changed, yours not put back: git's lock "
                                           f"{lock} is held")
        assert str(said["why"]).endswith(f"dispatchd refuses sessions on it {LAST_END}")
        with pytest.raises(dispatch.DispatchError, match=f"sessions on it are refused {LAST_END}"):
            ca.open_session(str(wt))
        r = shell(b, "rm .git/config.lock && echo gone")  # before its end: the last end's check can put back
        assert r.output == "gone\n", (r.output, r.error)
        b.close()
        assert _not_whole(b.protected) == []
        assert [p["why"] for p in b.protected if p["path"] == str(wt)] == [LIFTED]
        assert [p["why"] for p in b.protected if p["path"] == str(config)] == [
            "yours, as it was before the session changed it, put back"]
        assert config.read_bytes() == user_s
        ca.open_session(str(wt)).close()  # opens again


def test_the_twin_with_nothing_held_the_first_end_puts_back_and_refuses_nothing(daemon: Daemon, wt: Path) -> None:
    with daemon.connect() as cb, daemon.connect() as ca:
        b = cb.open_session(str(wt))
        a = ca.open_session(str(wt))
        r = shell(b, "for f in .githooks/h*; do echo 'touch PLANTED' >> $f; done; echo OK")
        assert r.output == "OK\n", (r.output, r.error)
        a.close()
        assert _not_whole(a.protected) == [] and _hooks_are_the_user_s(wt)
        assert {p["why"] for p in a.protected if p["path"] == f"{wt}/.githooks/h00"} == {
            "yours, as it was before the session changed it, put back"}
        ca.open_session(str(wt)).close()  # while b lives
        b.close()
        assert [p for p in b.protected if p["path"] == str(wt)] == []


def test_the_twin_a_config_rewritten_with_no_lock_is_put_back_by_the_first_end(degraded: Daemon, wt: Path) -> None:
    config = wt / ".git" / "config"
    user_s = config.read_bytes()
    with degraded.connect() as cb, degraded.connect() as ca:
        b = cb.open_session(str(wt))
        a = ca.open_session(str(wt))
        r = shell(b, f"printf '{FSMONITOR}' >> .git/config && echo OK")
        assert r.output == "OK\n", (r.output, r.error)
        a.close()
        assert _not_whole(a.protected) == [] and config.read_bytes() == user_s
        ca.open_session(str(wt)).close()  # while b lives
        b.close()
        assert [p for p in b.protected if p["path"] == str(wt)] == []


def test_a_daemon_killed_between_the_ends_leaves_its_record_and_the_next_start_puts_back(tmp_path: Path,
                                                                                        wt: Path) -> None:
    """The refusal lives in the daemon's memory; the record, still naming
    the live session, on disk: the next start runs the last end's check on
    it before it serves anyone."""
    _refuse_root()
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    config = wt / ".git" / "config"
    user_s = config.read_bytes()
    first = Daemon(tmp_path / "first", "--no-user-namespaces")
    second: Daemon | None = None
    try:
        cb, ca = first.connect(), first.connect()
        b = cb.open_session(str(wt))
        a = ca.open_session(str(wt))
        _config_and_lock(b)
        a.close()
        assert _not_whole(a.protected)
        assert shell(b, "rm .git/config.lock && echo gone").output == "gone\n"
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        for client in (cb, ca):
            with contextlib.suppress(dispatch.DispatchError, OSError):
                client.close()
        assert config.stat().st_mode & 0o777 == 0  # the session's, made unreadable, until a check puts it back
        second = Daemon(tmp_path / "second", "--no-user-namespaces", state=first.state)
        with second.connect() as c:
            assert config.read_bytes() == user_s  # the start's check, before it serves anyone
            said = {p["path"]: p["why"] for p in c.status()["protected"]}
            assert said[str(config)] == "yours, as it was before the session changed it, put back"
            assert not any(str(why).startswith("NOT checked whole") for why in said.values())
            c.open_session(str(wt)).close()
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.log()
