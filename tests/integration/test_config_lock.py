"""The end's put-back of ``.git/config`` under git's own lock, with a real
daemon (gitguard/gitlock.py), both modes: while a session closes,
``.git/config`` is never absent (a watcher looks at it all along); with
the user's ``config.lock`` held through the close, the put-back waits,
then leaves the config where it is (unreadable) and the close says so;
the twin, with no lock, puts the baseline's config back and keeps the one
it replaced aside. A change the user makes to the config by hand during a
session cannot be told from the session's (docs/git-protection.md, "What
is left open"): here it is the change the end finds."""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import dispatch
import pytest

from tests.conftest import shell

TAIL = ("What the session left there may still be live: look before you run git or your tools in it; dispatchd "
        "refuses sessions on it until a restart's check passes")


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = Path(os.path.realpath(tmp_path)) / "repo"
    r.mkdir()
    for args in (("init", "-q"), ("config", "user.email", "me@example.invalid"), ("config", "user.name", "me"),
                 ("remote", "add", "origin", "https://example.invalid/me/repo.git"),
                 ("commit", "-q", "--allow-empty", "-m", "init")):
        assert git(r, *args).returncode == 0
    return r


class Watch:
    """Looks at a path until stopped: how often it was absent."""

    def __init__(self, path: Path) -> None:
        self.path, self.looks, self.absent = path, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.looks += 1
            if not os.path.lexists(self.path):
                self.absent += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def watched(repo: Path) -> Iterator[Watch]:
    w = Watch(repo / ".git" / "config")
    yield w
    w.stop()


def test_a_held_config_lock_is_waited_for_then_the_config_left_in_place_and_said(
        mode_client: tuple[str, dispatch.Client], repo: Path, watched: Watch) -> None:
    _, client = mode_client
    config, lock = repo / ".git" / "config", repo / ".git" / "config.lock"
    with client.open_session(str(repo)) as s:
        assert shell(s, "git status --short && echo ran").output == "ran\n"
        assert git(repo, "config", "mine.during", "v").returncode == 0  # the user's, by hand
        lock.write_text("held by a git of the user's\n")
    watched.stop()
    assert watched.absent == 0 and watched.looks > 100
    [said] = [p["why"] for p in s.protected if p["path"] == str(repo)]
    assert said == (f"NOT checked whole: {config}: changed, yours not put back: git's lock {lock} is held (a git "
                    "command of yours, or one that stopped without removing it); what stands there is left in "
                    "place, made unreadable (mode 000); once no git of yours runs, remove the lock if it is still "
                    f"there, and a restart's check puts yours back. {TAIL}")
    assert lock.read_text() == "held by a git of the user's\n"  # never removed, never written around
    assert stat.S_IMODE(config.stat().st_mode) == 0
    config.chmod(0o644)
    assert "[mine]\n\tduring = v\n" in config.read_text()  # left where it was
    lock.unlink()
    with pytest.raises(dispatch.DispatchError, match="could not move aside"):
        client.open_session(str(repo))  # until a restart's check passes


def test_the_twin_with_no_lock_puts_config_back_and_keeps_the_one_it_replaced_aside(
        mode_client: tuple[str, dispatch.Client], repo: Path, watched: Watch) -> None:
    _, client = mode_client
    config = repo / ".git" / "config"
    original = config.read_bytes()
    with client.open_session(str(repo)) as s:
        assert shell(s, "git status --short && echo ran").output == "ran\n"
        assert git(repo, "config", "mine.during", "v").returncode == 0
    watched.stop()
    assert watched.absent == 0 and watched.looks > 100
    [aside] = [p for p in config.parent.iterdir() if p.name.startswith("config.quarantined-by-dispatchd-")]
    said = {p["path"]: p["why"] for p in s.protected}
    assert said == {str(aside): "git configuration, hooks or state changed or new",
                    str(config): "yours, as it was before the session changed it, put back"}
    assert config.read_bytes() == original and "[mine]\n\tduring = v\n" in aside.read_text()
    assert not (repo / ".git" / "config.lock").exists()
    assert git(repo, "remote", "get-url", "origin").stdout == "https://example.invalid/me/repo.git\n"
    client.open_session(str(repo)).close()  # checked whole: open again


def test_a_session_that_leaves_a_config_lock_beside_its_config_runs_nothing(
        mode_client: tuple[str, dispatch.Client], repo: Path, tmp_path: Path) -> None:
    """A session writes ``core.fsmonitor`` into ``.git/config`` and leaves a
    ``config.lock`` of its own, so that the put-back, which never writes
    around git's lock, gives up. Full mode: the config is held read-only
    (the lock alone is made; nothing to put back). Degraded mode: the config
    is left in place unreadable, and the user's git stops on it, saying so.
    The control: the same config by hand runs."""
    mode, client = mode_client
    marker = tmp_path / "PWNED"
    config, lock = repo / ".git" / "config", repo / ".git" / "config.lock"
    plant = (f": > .git/config.lock; printf '[core]\\n\\tfsmonitor = \"touch {marker}; false\"\\n' > .git/config "
             "&& echo PLANTED")
    with client.open_session(str(repo)) as s:
        r = shell(s, plant)
        assert r.is_success == (mode == "degraded"), (r.output, r.error)
    assert lock.exists()
    status = git(repo, "status")
    assert not marker.exists()
    if mode == "degraded":
        assert status.stderr.endswith("fatal: unable to access '.git/config': Permission denied\n"), status.stderr
        assert any(p["why"].startswith(f"NOT checked whole: {config}: changed, yours not put back: git's lock")
                   for p in s.protected), s.protected
        config.chmod(0o644)
    else:
        assert status.returncode == 0, status.stderr
    lock.unlink()
    config.write_text(f'[core]\n\tfsmonitor = "touch {marker}; false"\n')
    git(repo, "status")
    assert marker.exists()  # the control
