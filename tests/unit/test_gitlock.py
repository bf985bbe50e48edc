"""dispatchd.daemon.gitguard.gitlock, through the end's put-back of the
user's config (keptfiles): the file replaced under git's own ``config.lock``,
never absent at any step; a ``git config`` of the user's at each moment of
it either lands before (kept aside, said) or fails loudly on the lock; a
lock held past the wait never written around; a daemon killed at any step
leaves a whole config and a lock the next end knows for its own (and
removes), never the user's (real repositories, real git)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import gitlock, keptfiles, layouts, noroom, ournames, reftemp, snapshots
from tests.unit.gitrepo import empty_repo, git
from tests.unit.leftovers import adopt


pytestmark = pytest.mark.process  # starts git


_MADE: dict[tuple[str, str], str] = {}


def _T(leaf: str, key: str) -> str:
    """A temporary's name of ours for ``leaf`` (``ournames``: only the daemon's key makes one), one per ``key``."""
    return _MADE.setdefault((leaf, key), os.path.basename(ournames.make(leaf)))

STEPS = ["written", "locked", "kept", "replaced"]
SESSIONS = "[core]\n\trepositoryformatversion = 0\n\tfsmonitor = \"touch PLANTED; false\"\n"
MADE = "left in place, made unreadable (mode 000): no room to move it aside"


def _take(repo: Path, keep: bool = False) -> snapshots.GitSnapshot:
    return snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid()), keep=keep)


def _end(repo: Path, before: snapshots.GitSnapshot) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """As ``parts.check_part``: the look, the quarantine leaving the kept
    files to the put-back, the put-back."""
    now = _take(repo)
    moved, failed = snapshots.quarantine(str(repo), before, now,
                                         keptfiles.left_in_place(str(repo), before.kept, now.gitdirs, now.external))
    put, bad = keptfiles.put_back(str(repo), before.kept, now.gitdirs, now.external)
    return moved, put, failed + bad


def _aside(config: Path) -> list[Path]:
    return sorted(p for p in config.parent.iterdir() if p.name.startswith("config.quarantined-by-dispatchd-"))


def _ours(gitdir: Path) -> list[str]:
    return sorted(p.name for p in gitdir.iterdir() if ".dispatchd-" in p.name and p.name.endswith(".lock"))


def _user_git_config(repo: Path, key: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "config", key, "v"], cwd=repo, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = empty_repo(tmp_path / "repo")
    git(r, "config", "user.email", "me@example.invalid")
    git(r, "remote", "add", "origin", "https://example.invalid/me/repo.git")
    return r


def _at_step(monkeypatch: pytest.MonkeyPatch, act: Callable[[str], None]) -> list[str]:
    seen: list[str] = []

    def step(name: str) -> None:
        seen.append(name)
        act(name)
    monkeypatch.setattr(gitlock, "_step", step)
    return seen


def test_at_every_step_of_the_put_back_config_names_a_whole_file(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = repo / ".git" / "config"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    found: list[tuple[str, bytes]] = []
    seen = _at_step(monkeypatch, lambda name: found.append((name, config.read_bytes())))
    moved, put, failed = _end(repo, before)
    assert seen == STEPS and failed == [] and moved == []
    # Every step read a whole config (open() raised had it been absent): the session's until the rename.
    assert found == [("written", SESSIONS.encode()), ("locked", SESSIONS.encode()), ("kept", SESSIONS.encode()),
                     ("replaced", original)]
    [aside] = _aside(config)
    assert put == [(str(aside), "git configuration, hooks or state changed or new"),
                   (str(config), "yours, as it was before the session changed it, put back")]
    assert aside.read_text() == SESSIONS and aside.stat().st_nlink == 1 and config.stat().st_nlink == 1
    assert _ours(repo / ".git") == [] and not (repo / ".git" / "config.lock").exists()


def test_a_git_config_of_the_users_under_the_lock_fails_loudly_and_changes_nothing(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = repo / ".git" / "config"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    tried: list[subprocess.CompletedProcess[str]] = []
    _at_step(monkeypatch, lambda name: tried.append(_user_git_config(repo, "mine.during")) if name == "locked" else None)
    assert _end(repo, before)[2] == []
    [r] = tried
    assert (r.returncode, r.stderr) == (255, "error: could not lock config file .git/config: File exists\n")
    assert config.read_bytes() == original


def test_the_twin_a_git_config_of_the_users_just_before_the_lock_lands_and_is_kept_aside(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the lock is taken, the user's ``git config`` succeeds; its
    file is what the put-back replaces, so it is the one kept aside (not
    lost, not written over unseen)."""
    config = repo / ".git" / "config"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    tried: list[subprocess.CompletedProcess[str]] = []
    _at_step(monkeypatch, lambda name: tried.append(_user_git_config(repo, "mine.before")) if name == "written" else None)
    assert _end(repo, before)[2] == []
    assert [r.returncode for r in tried] == [0]
    [aside] = _aside(config)
    assert "[mine]\n\tbefore = v\n" in aside.read_text() and "fsmonitor" in aside.read_text()
    assert config.read_bytes() == original


def test_a_lock_held_past_the_wait_is_never_written_around(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``config.lock`` nobody removes (a git of the user's that stopped, or
    a session's plant beside its config): after the wait, the config is
    left in place but unreadable (git stops on it, saying so), the lock
    untouched, the check failing; once the lock is gone, the next end puts
    the user's back."""
    monkeypatch.setattr(gitlock, "WAIT_S", 0.05)
    config, lock = repo / ".git" / "config", repo / ".git" / "config.lock"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    lock.write_text("the user's git is writing\n")
    lock_ino = lock.stat().st_ino
    moved, put, failed = _end(repo, before)
    assert (moved, put) == ([], [])
    assert failed == [f"{config}: changed, yours not put back: git's lock {config}.lock is held (a git command of "
                      "yours, or one that stopped without removing it); what stands there is left in place, made "
                      "unreadable (mode 000); once no git of yours runs, remove the lock if it is still there, and a "
                      "restart's check puts yours back"]
    assert stat.S_IMODE(config.stat().st_mode) == 0 and config.exists()
    assert lock.stat().st_ino == lock_ino and lock.read_text() == "the user's git is writing\n"
    status = subprocess.run(["git", "status"], cwd=repo, capture_output=True, text=True)
    assert status.stderr.endswith("fatal: unable to access '.git/config': Permission denied\n"), status.stderr
    lock.unlink()
    moved, put, failed = _end(repo, before)
    assert failed == [] and config.read_bytes() == original and len(put) == 2


def test_the_twin_a_lock_released_within_the_wait_is_waited_for(repo: Path) -> None:
    config, lock = repo / ".git" / "config", repo / ".git" / "config.lock"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    lock.write_text("")
    timer = threading.Timer(0.2, lock.unlink)
    timer.start()
    try:
        moved, put, failed = _end(repo, before)
    finally:
        timer.join()
    assert failed == [] and config.read_bytes() == original and len(put) == 2


@pytest.mark.parametrize("killed_after", STEPS)
def test_a_daemon_killed_at_a_step_leaves_a_whole_config_and_the_next_end_removes_only_its_own_lock(
        repo: Path, killed_after: str) -> None:
    config = repo / ".git" / "config"
    original = config.read_bytes()
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    state = str(repo.parent / "state")
    pid = os.fork()
    if pid == 0:  # the daemon, killed (no clean-up of any kind) once the step is done
        try:
            ournames.use(state)  # its journal: what it writes down outlives it
            gitlock._step = lambda name: os._exit(9) if name == killed_after else None
            _end(repo, before)
        finally:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] >> 8 == 9
    ournames.use(state)  # the next start reads the dead daemon's journal
    assert config.read_bytes() in (SESSIONS.encode(), original)  # a whole file, never absent
    held = (repo / ".git" / "config.lock").exists()
    assert held == (killed_after in ("locked", "kept")), killed_after  # ours: a second name of our temporary
    moved, put, failed = _end(repo, before)  # the next start's check
    assert failed == [] and config.read_bytes() == original
    assert _ours(repo / ".git") == [] and not (repo / ".git" / "config.lock").exists()
    assert git(repo, "config", "user.email") == "me@example.invalid\n"


def test_the_users_own_lock_beside_a_killed_daemons_temporary_is_never_removed(repo: Path) -> None:
    """The leftover temporary is ours (removed); the ``config.lock`` beside
    it is another inode, the user's git's: left, whatever its content."""
    gitdir = repo / ".git"
    (gitdir / _T("config", "0123456789abcdef")).write_bytes(b"[core]\n")
    (gitdir / "config.lock").write_bytes(b"[core]\n")
    adopt(gitdir)  # a killed daemon's temporary: written down in its journal
    fd = os.open(gitdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        removed = gitlock.sweep(fd, str(gitdir), {"config"})
    finally:
        os.close(fd)
    assert removed == [str(gitdir / _T("config", "0123456789abcdef"))]
    assert (gitdir / "config.lock").read_bytes() == b"[core]\n"
    # A temporary whose second name is the lock, held by no live put-back (no
    # flock): what a killed end left, which the start's sweep removes, both
    # names (no git of the user's makes a pair of that shape).
    os.link(gitdir / "config.lock", gitdir / _T("config", "fedcba9876543210"))
    adopt(gitdir)
    assert reftemp.sweep(str(gitdir), ["HEAD"]) == [str(gitdir / _T("config", "fedcba9876543210")),
                                                    str(gitdir / "config.lock")]
    assert not (gitdir / "config.lock").exists()


def test_a_live_put_backs_temporary_is_left_by_the_sweep(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its flock is held for as long as it runs: another sweep of the same
    directory (a check of another domain) leaves it and its lock."""
    config = repo / ".git" / "config"
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)
    swept: list[list[str]] = []

    def sweep_now(name: str) -> None:
        if name == "locked":
            fd = os.open(repo / ".git", os.O_RDONLY | os.O_DIRECTORY)
            try:
                swept.append(gitlock.sweep(fd, str(repo / ".git"), {"config"}))
            finally:
                os.close(fd)
    _at_step(monkeypatch, sweep_now)
    assert _end(repo, before)[2] == [] and swept == [[]]


def test_with_no_room_for_the_aside_name_config_is_made_unreadable_and_said(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noroom, "_ballast", [])
    config = repo / ".git" / "config"
    before = _take(repo, keep=True)
    config.write_text(SESSIONS)

    def no_room(*args: object, **kw: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(gitlock, "_link", no_room)
    moved, put, failed = _end(repo, before)
    assert (moved, put) == ([], [])
    assert failed == [f"{config}: changed by a session, yours cannot be put back ({MADE})"]
    assert stat.S_IMODE(config.stat().st_mode) == 0
    assert _ours(repo / ".git") == [] and not (repo / ".git" / "config.lock").exists()
    config.chmod(0o644)
    assert config.read_bytes() == SESSIONS.encode()  # left where it was, never absent
